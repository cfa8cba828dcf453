"""torch.compile beside a GraphRuntime in one process (issue 12), and the cause found: a
captured matmul bakes in the cuBLAS workspace it ran with, and torch.compile's CUDA graphs
free torch's cached workspaces on every recording. The runtime now releases the cached
workspaces around each capture, so its graphs own theirs (inside the graph pool)."""
import os
import subprocess
import sys

import pytest
import torch

from cudagraph_rt import GraphRuntime
from tests.support import ROOT, SUPPORT
from tests.support.models_for_tests import SlotModel

pytestmark = pytest.mark.cuda


def test_compile_reduce_overhead_then_runtime_in_one_process():
    """The issue's run: runtime steps, a reduce-overhead compile with automatic dynamic
    shapes at widths 64..1, then runtime steps again, all checked against graphs off."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), env_path()]))
    p = subprocess.run([sys.executable, str(SUPPORT / "compile_beside_runtime.py")],
                       capture_output=True, text=True, timeout=500, env=env)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-3000:] + p.stderr[-3000:]


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")


def test_graphs_survive_a_release_of_torchs_cached_blas_workspaces():
    """What torch.compile does, done directly: free the cached workspaces, let other
    tensors take that memory, give the cache back to the driver; replays stay exact and
    write nothing into the other tensors."""
    H = 2048  # big enough for cuBLAS to use a workspace
    m, twin = SlotModel("cuda", H=H, layers=4, seed=3), SlotModel("cuda", H=H, layers=4, seed=3)
    rt = GraphRuntime(m, m.specs(), graphs=True)
    off = GraphRuntime(twin, twin.specs(), graphs=False)
    rt.capture()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    fillers = [torch.full((4 << 20,), float(i), device="cuda") for i in range(64)]  # 1 GiB
    for T in [64, 1, 33, 7, 64, 16]:
        x = m.random_inputs(T, gen=gen)
        a, b = rt.step(**x).outputs, off.step(**x).outputs
        assert torch.equal(a["hidden"], b["hidden"]) and torch.equal(a["tok"], b["tok"]), T
    torch.cuda.synchronize()
    for i, f in enumerate(fillers):
        assert bool((f == float(i)).all()), f"filler {i} was written by a replay"
