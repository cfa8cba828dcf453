"""Inputs shared by the staging, direct-step and runtime tests: three inputs of three
dtypes (``SPECS``) and random rows for them, an event that never waits, and a step
function that returns what it read (``_echo`` over ``ECHO``)."""
import torch

from cudagraph_rt import InputSpec

SPECS = {"a": InputSpec((), torch.int64, -5), "b": InputSpec((3,), torch.float32, 0.25),
         "c": InputSpec((2,), torch.bfloat16, -1.5)}


def rows(T, gen):
    return {"a": torch.randint(0, 99, (T,), generator=gen), "b": torch.randn(T, 3, generator=gen),
            "c": torch.randn(T, 2, generator=gen).bfloat16()}


class FakeEvent:
    def synchronize(self):
        pass

    def record(self):
        pass


def _echo(x):
    """Returns what the graph read, so a test sees every real and padding row it got."""
    return {"a": x["a"] * 1, "b": x["b"] * 1, "h": x["h"] * 1}


ECHO = {"a": InputSpec((), torch.int64, -5), "b": InputSpec((3,), torch.float32, 0.25),
        "h": InputSpec((2,), torch.bfloat16, -1.5)}
