"""Shared test setup.

TRITON_INTERPRET must be set before triton or any kernel is imported, so the CPU runs
the Triton kernels in the interpreter; on a GPU machine it stays unset.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Tiny CPU ops only lose time to torch's intra-op threads, badly so on a small shared
    CPU box: run the test on one thread and restore the setting after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=[False, "emulate"], ids=["graphs-off", "emulated"])
def rig_graphs(request):
    """Run the test twice: every Rig built without ``graphs=`` runs graphs off, then with
    emulated graphs (the graph path's feed, short path, views and static outputs, on a CPU)."""
    from tests.support import reliability_harness
    reliability_harness.GRAPHS[0] = request.param
    yield request.param
    reliability_harness.GRAPHS[0] = False
