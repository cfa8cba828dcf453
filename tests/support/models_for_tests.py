"""Small step functions the runtime tests share (a few layers and a slot-indexed state),
a model that fails on demand, and the hand capture the GPU tests use outside the runtime."""
import torch

from cudagraph_rt import InputSpec, eager


class Boom(RuntimeError):
    """What a ``failing`` model's step function raises."""


def failing(cls):
    """``cls`` whose call raises Boom while ``fail`` is set (before it writes any state)."""
    class Failing(cls):
        fail = False

        def __call__(self, x):
            if self.fail:
                raise Boom("step function failed on purpose")
            return super().__call__(x)
    return Failing


class SlotModel:
    """Embed tokens, a few tanh layers, write each row's hidden state into ``state[slot]``
    and read ``state[read]`` back into the output. Slot ``n_slots`` is the scratch slot
    that padding rows write and read."""

    def __init__(self, device, H=32, vocab=50, layers=3, n_slots=256, seed=0, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.emb = (torch.randn(vocab, H, generator=g) * 0.5).to(device, dtype)
        self.ws = [(torch.randn(H, H, generator=g) / H ** 0.5).to(device, dtype) for _ in range(layers)]
        self.n_slots = n_slots
        self.state = torch.zeros(n_slots + 1, H, device=device, dtype=dtype)

    def specs(self):
        return {
            "tokens": InputSpec((), torch.int64, 0),
            "slot": InputSpec((), torch.int64, self.n_slots),
            "read": InputSpec((), torch.int64, self.n_slots),
            "scale": InputSpec((1,), torch.float32, 0.0),
        }

    def __call__(self, x):
        h = self.emb[x["tokens"]] * (1 + x["scale"]).to(self.emb.dtype)
        for w in self.ws:
            h = torch.tanh(h @ w)
        self.state.index_copy_(0, x["slot"], h)
        out = h + 0.5 * self.state[x["read"]]
        return {"hidden": out, "tok": out.argmax(-1)}

    def random_inputs(self, T, device="cpu", gen=None):
        """Fresh rows; reads only hit slots this step does not write, so a sliced step
        and one unsliced call agree (a step's rows never depend on each other here)."""
        perm = torch.randperm(self.n_slots, generator=gen)
        others = perm[T:]
        return {
            "tokens": torch.randint(0, self.emb.shape[0], (T,), generator=gen),
            "slot": perm[:T],
            "read": others[torch.randint(0, others.numel(), (T,), generator=gen)],
            "scale": torch.rand(T, 1, generator=gen),
        }


class ChoosingSlotModel(SlotModel):
    """SlotModel whose step also chooses its accepted rows on the device, with no host
    sync: the rows whose argmax is even, in row order."""

    def __call__(self, x):
        out = super().__call__(x)
        keep = (out["tok"] % 2 == 0).to(torch.int32)
        out["accept_rows"] = torch.sort(1 - keep, stable=True).indices.to(torch.int32)
        out["accept_count"] = keep.sum().to(torch.int32).reshape(1)
        return out


def chosen_rows(tok):
    """The rows ChoosingSlotModel accepts, computed on the host."""
    return [i for i, t in enumerate(tok.tolist()) if t % 2 == 0]


def warm_and_capture(body, *, pool=None, keep_graph=False) -> "torch.cuda.CUDAGraph":
    """Warm ``body`` up (compiles, cuBLAS handles) on a side stream, then capture it into
    a CUDA graph (``keep_graph``: its cudaGraph_t stays readable, for inspection)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        body()
    torch.cuda.synchronize()
    return g


def python_acceptance(tokens: list[int], rows: list[tuple]) -> list[bool]:
    """Greedy acceptance written the slow way (the oracle of models.accept.greedy_accept):
    rows are (token, position, seq, want, next_token); per sequence (seq >= 0: -1 is
    padding), walk its rows by position, commit each wanted row, stop after the first
    whose greedy token differs from the draft it checks."""
    committed = [False] * len(rows)
    for s in {r[2] for r in rows if r[2] >= 0}:
        for i in sorted((i for i, r in enumerate(rows) if r[2] == s), key=lambda i: rows[i][1]):
            if rows[i][3] == 1:
                committed[i] = True
                if tokens[i] != rows[i][4]:
                    break
    return committed


@eager
def _scaled_rows(emb, tokens, scale):
    """SlotModel's first line, as a marked call (it returns a fresh tensor: copied into
    the capture's output at each piecewise replay)."""
    return emb[tokens] * (1 + scale).to(emb.dtype)


@eager
def _state_rw(state, h, slot, read, out):
    """SlotModel's state write and read, as a marked call writing ``out`` in place."""
    state.index_copy_(0, slot, h)
    return torch.add(h, state[read], alpha=0.5, out=out)


def _bind_state_rw(state, h, slot, read, out):
    """_state_rw's bind: the same ops on the recorded tensors, as a zero-argument callable."""
    def state_rw():
        state.index_copy_(0, slot, h)
        return torch.add(h, state[read], alpha=0.5, out=out)
    return state_rw


_bound_state_rw = eager(_state_rw._cgrt_eager, bind=_bind_state_rw)  # the same call, bound at record


class MarkedSlotModel(SlotModel):
    """SlotModel with its first line and its state write/read in calls marked
    ``cudagraph_rt.eager``: captured in pieces it runs three pieces (the feed's prologue;
    the tanh layers; the argmax and gather) around two eager calls, one returning a fresh
    tensor (copied into the static one) and one writing its ``out`` in place. The same
    math, op for op, as SlotModel: the same outputs bit for bit."""

    state_rw = staticmethod(_state_rw)

    def __call__(self, x):
        h = _scaled_rows(self.emb, x["tokens"], x["scale"])
        for w in self.ws:
            h = torch.tanh(h @ w)
        out = self.state_rw(self.state, h, x["slot"], x["read"], torch.empty_like(h))
        return {"hidden": out, "tok": out.argmax(-1)}


class BoundMarkedSlotModel(MarkedSlotModel):
    """MarkedSlotModel whose state write/read is marked with a ``bind``: piecewise replays
    run the bound callable, not the function (the same ops: the same outputs)."""

    state_rw = staticmethod(_bound_state_rw)


@eager
def _fill_in_place(x, outs, *, col):
    """Writes its tensor arguments in place and returns nothing: the first tensor of a list
    argument is overwritten, the second added to, and a column view of a buffer (passed by
    keyword) overwritten."""
    outs[0].copy_(x * 2 + 1)
    outs[1].add_(x)
    col.copy_(x - 1)


class InPlaceArgsModel:
    """A step whose marked call (``_fill_in_place``) writes its arguments in place, and
    whose code after the call reads those arguments only, never a result of the call.
    What the call writes starts as NaN, or as a value of the code before it (the call adds
    to it), so a write the code after the call misses shows in the output.
    ``reference(x)``: the output, written out with integer-valued rows (exact in float32)."""

    def __init__(self, device="cpu"):
        self.device = device

    def specs(self):
        return {"x": InputSpec((), torch.float32, 0.0)}

    def __call__(self, v):
        x = v["x"]
        a = torch.full_like(x, float("nan"))
        b = x * 0 + 3
        buf = torch.stack([torch.full_like(x, float("nan")), x], 1)
        _fill_in_place(x, [a, b], col=buf[:, 0])
        return {"y": a * 10 + b + buf.sum(1)}

    @staticmethod
    def reference(x: torch.Tensor) -> torch.Tensor:
        return (x * 2 + 1) * 10 + (x + 3) + ((x - 1) + x)

    def random_inputs(self, T, gen=None):
        return {"x": torch.randint(-60, 60, (T,), generator=gen).to(torch.float32)}
