"""The device loop on a GPU (issue 38): with graphs on, one outer graph of conditional
nodes where the driver allows (else the host-driven rounds, as ``DeviceLoop.note``
says), the same tokens as the host-driven loop, committed rows handed over on the host,
and streamed tokens equal to the finished ones."""
from __future__ import annotations

import pytest
import torch

from cudagraph_rt.dispatch.loop import DeviceLoop
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative.device_drafter import DeviceDrafter
from cudagraph_rt.speculative.loop_drafter import CoinRounds
from cudagraph_rt.speculative.runner import Request, SpecRunner
from tests.support.seeds import seeded_rng

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loop_on_cuda_equals_the_host_runner_with_rows_on_the_host(dtype):
    rng = seeded_rng("CGRT_LOOP_SEED")
    model = ToyDecoder(ToyConfig.tiny(max_len=96, max_seqs=4, dtype=dtype), "cuda")
    V, k, p, seed = model.config.vocab, 4, rng.choice([0.5, 0.8]), rng.randrange(2**31)
    reqs = [Request(tuple(rng.randrange(V) for _ in range(rng.randint(1, 8))), rng.randint(8, 40)) for _ in range(4)]
    runner = SpecRunner(model, DeviceDrafter(model, p, seed, k=k), k=k, lanes=1, graphs=True, record_rows=True)
    runner.submit(reqs)
    runner.run()
    want = {q.uid: q for q in runner.finished}
    model.reset_cache()
    heard: dict[int, list[int]] = {}
    loop = DeviceLoop(model, CoinRounds(model, p, seed), k=k, graphs=True, rounds=rng.randint(3, 64),
                      record_rows=True, on_tokens=lambda uid, toks: heard.setdefault(uid, []).extend(toks))
    loop.submit(reqs)
    loop.run()
    got = {q.uid: q for q in loop.finished}
    assert sorted(got) == sorted(want) and loop.note
    for uid, q in got.items():
        assert q.tokens == want[uid].tokens
        assert heard[uid] == q.generated
        rows = torch.cat(q.rows)
        assert rows.device.type == "cpu" and rows.shape[0] == len(q.generated)
        ref = torch.cat(want[uid].rows).float().cpu()
        tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
        torch.testing.assert_close(rows.float(), ref, **tol)
