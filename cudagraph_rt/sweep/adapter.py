"""The adapter protocol: what the width sweep needs from a model, and the toy's adapter.

An adapter builds a runtime over the model, turns a planned step into step inputs, picks
the tokens and tapped hidden rows out of a step's outputs, and gives an eager reference
for one sequence. Everything else (plans, checks, report) is model-agnostic.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

from ..inputs.spec import InputSpec
from ..errors import InputError, expected
from ..models.protocol import Decoder
from ..models.toy import ToyConfig, ToyDecoder
from ..runtime import GraphRuntime
from .checks import Tolerance
from .plans import Capacity, StepPlan

REQUIRED = ("name", "device", "capacity", "build", "step_inputs", "reference")


@runtime_checkable
class SweepAdapter(Protocol):
    """What ``run_sweep`` needs. Subclass :class:`BaseAdapter` for the optional hooks.

    * ``name`` (str), ``device`` (torch.device), ``capacity`` (:class:`Capacity`).
    * ``build(graphs)`` -> a NEW GraphRuntime over model state as if fresh (KV cache reset):
      the harness builds one per graph mode and closes it after that mode.
    * ``step_inputs(step)`` -> the keyword inputs of ``rt.step`` for a :class:`StepPlan`
      (its per-row columns ``seq_ids``, ``positions``, ``tokens``, ``want``; its ``chunks``).
    * ``reference(tokens)`` -> ``(greedy [L], hidden [L, H] or None)``: eager, one sequence,
      positions 0..L-1, reads and writes no runtime state.

    Optional hooks (defaults in :class:`BaseAdapter`): ``outputs``, ``continuation``,
    ``release``, ``check_state``, ``cli_args``, ``tolerance``, ``clear``.
    """

    name: str
    device: torch.device
    capacity: Capacity

    def build(self, graphs: bool) -> GraphRuntime: ...

    def step_inputs(self, step: StepPlan) -> Mapping[str, Any]: ...

    def reference(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class BaseAdapter:
    """Default optional hooks; the harness falls back to these for duck-typed adapters.

    * ``outputs(outputs)`` -> ``(tokens [T] int, hidden [T, H] or None)`` from
      ``StepResult.outputs``: greedy token where the row wants one, -1 elsewhere (default:
      the "tokens" and "hidden" entries of a dict).
    * ``continuation(prompt, n)``: the n greedy tokens after ``prompt`` (default: n calls of
      ``reference``; override with a faster rule — the harness re-checks it anyway).
    * ``release(seq)``: sequence id ``seq`` is being handed to a new sequence that starts
      at position 0 (free its cache pages here if the model needs that; default nothing).
    * ``check_state()``: model invariants after each step, as messages (default none).
    * ``cli_args()``: ``cgrt sweep`` flags that rebuild this adapter, or None when the CLI
      cannot (then failures print a Python call to reproduce them).
    * ``tolerance``: a ``Tolerance`` for the hidden rows, or None (chosen by dtype).
    * ``clear(tokens)``: [L] bool, where the reference's greedy token (after ``tokens[:p+1]``)
      has a clear top-1/top-2 margin, or None (default: every position is clear). Where it
      is not, a differing token is counted as a near-tie and is not a failure: for models
      with random weights, whose logits have near-ties that rounding may flip.
    """

    tolerance = None

    def outputs(self, outputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        try:
            return outputs["tokens"], outputs.get("hidden") if isinstance(outputs, Mapping) else None
        except (KeyError, TypeError, IndexError):
            raise InputError(expected("adapter.outputs", "a dict with 'tokens' (and 'hidden')",
                                      type(outputs).__name__)) from None

    def continuation(self, prompt: list[int], n: int) -> list[int]:
        toks = list(prompt)
        for _ in range(n):
            toks.append(int(self.reference(toks)[0][-1]))
        return toks[len(prompt):]

    def release(self, seq: int) -> None:
        return None

    def check_state(self) -> list[str]:
        return []

    def cli_args(self) -> list[str] | None:
        return None

    def _machine_args(self) -> list[str]:
        """``--device`` when not this machine's default, ``--widths`` when set."""
        args = []
        if self.device.type != ("cuda" if torch.cuda.is_available() else "cpu"):
            args += ["--device", self.device.type]
        if getattr(self, "widths", None) is not None:
            args += ["--widths", ",".join(map(str, self.widths))]
        return args

    def clear(self, tokens: Sequence[int]) -> torch.Tensor | None:
        return None


def check_adapter(adapter: Any) -> None:
    """InputError naming the first missing or malformed member of the protocol."""
    for name in REQUIRED:
        if not hasattr(adapter, name):
            raise InputError(expected("adapter", f"an object with {', '.join(REQUIRED)}",
                                      f"{type(adapter).__name__} without {name!r}"))
    for name in REQUIRED[3:]:
        if not callable(getattr(adapter, name)):
            raise InputError(expected(f"adapter.{name}", "a method", type(getattr(adapter, name)).__name__))
    if not isinstance(adapter.capacity, Capacity):
        raise InputError(expected("adapter.capacity", "a Capacity(max_seqs, max_len, vocab)",
                                  type(adapter.capacity).__name__))
    if not isinstance(adapter.device, torch.device):
        raise InputError(expected("adapter.device", "a torch.device", repr(adapter.device)))


def hook(adapter: Any, name: str):
    """The adapter's optional hook ``name``, or BaseAdapter's default bound to it."""
    fn = getattr(adapter, name, None)
    if fn is not None:
        return fn
    default = getattr(BaseAdapter, name)
    return default.__get__(adapter) if callable(default) else default


class PoolAdapter(BaseAdapter):
    """What the adapters of models on the paged KV pool share (``self.model`` a
    :class:`~cudagraph_rt.models.protocol.Decoder`): the step's cells from the pool, and a
    model-state check that padding rows left every live cell alone.

    Sequence ids are reused WITHOUT freeing: a row reads its own sequence's positions up
    to its own only, and every new sequence rewrites its cells from position 0 in order,
    so a correct runtime needs nothing else — and stale rows replayed by a broken one
    rewrite cells the id's new sequence reads, which the comparison then sees.

    The check: before each step, if the pad of ``cells`` (:meth:`input_specs`) is a live
    cell of the pool that none of the step's rows writes, its K/V (every layer) are kept;
    after the step they must be unchanged.

    ``stepped`` is the model whose pool the runtime's steps use (``self.model``, unless a
    subclass steps another one, e.g. the tensor-parallel split of it). ``pieces``: the
    runtime captures every width in pieces (``GraphRuntime(pieces=True)``), with the
    model's ``step_values`` function (varlen attention needs one).
    """

    model: Decoder
    pieces = False
    _watch: tuple[int, torch.Tensor, torch.Tensor] | None = None
    _shared: tuple[int, int] | None = None
    _rt: GraphRuntime | None = None

    def runtime(self, graphs, widths) -> GraphRuntime:
        """A new runtime over the model's step (its cache reset first)."""
        self.model.reset_cache()
        return self._runtime(GraphRuntime(self.model.step, self.input_specs(), widths=widths, graphs=graphs,
                                          device=self.device, pieces=self.pieces,
                                          step_values=getattr(self.model, "step_values", None)))

    def _piece_args(self) -> list[str]:
        """``--attention`` / ``--pieces`` as the CLI rebuilds them."""
        att = getattr(self.model, "attention", "cells")
        return (["--attention", att] if att != "cells" else []) + (["--pieces"] if self.pieces else [])

    @property
    def stepped(self) -> Decoder:
        return self.model

    def input_specs(self) -> dict[str, InputSpec]:
        """The runtime's inputs: the model's own specs (pad cell = its scratch cell)."""
        return self.model.inputs()

    def step_inputs(self, step: StepPlan) -> dict[str, torch.Tensor]:
        def col(v) -> torch.Tensor:  # host rows: the runtime stages them in one copy per step
            return torch.tensor(v, dtype=torch.int64)

        cells = [self.stepped.cell_for(s, p) for s, p in zip(step.seq_ids, step.positions)]
        self._watch_pad(set(cells))
        return dict(tokens=col(step.tokens), positions=col(step.positions), seq_ids=col(step.seq_ids),
                    cells=col(cells), want=col([int(w) for w in step.want]))

    def _watch_pad(self, written: set[int]) -> None:
        pool, pad = self.stepped.pool, int(self.input_specs()["cells"].pad)
        self._watch = self._shared = None
        if pad == pool.scratch_cell or not 0 <= pad < pool.scratch_cell:
            return
        if pad not in written and pool.readers(pad):
            self._watch = (pad, pool.k[:, pad].clone(), pool.v[:, pad].clone())
        elif pad in written and self._rt is not None:  # a live row and the pads write one cell
            self._shared = (pad, self._rt.stats().padding_rows)

    def _runtime(self, rt: GraphRuntime) -> GraphRuntime:
        """What ``build`` returns, kept: the check reads its padding counter."""
        self._rt = rt
        return rt

    def check_state(self) -> list[str]:
        """Padding rows wrote no live cell: the watched pad cell's K/V did not change, and
        no step with padding rows wrote the pad cell where a live row of it writes too
        (the pads' K/V then replace the live row's, which no later step can see)."""
        pool, why = self.stepped.pool, None
        if self._watch is not None:
            pad, k, v = self._watch
            if not (torch.equal(pool.k[:, pad], k) and torch.equal(pool.v[:, pad], v)):
                why = "no row of the step writes it, yet its K/V changed"
        elif self._shared is not None:
            pad, before = self._shared
            if self._rt.stats().padding_rows > before:
                why = "a live row of the step writes it and the step's padding rows wrote it too"
        if why is None:
            return []
        where = ", ".join(f"seq {s}, pos {p}" for s, p in pool.readers(pad))
        return [f"padding rows wrote live cell(s) {pad} ({where}): {why}; the pad of 'cells' must be the scratch "
                f"cell {pool.scratch_cell}"]


class ToyAdapter(PoolAdapter):
    """The embedded toy decoder (``models/toy.py``) under the sweep (see
    :class:`PoolAdapter` for its cells and its model-state check).

    One ToyDecoder lives as long as the adapter; ``build`` resets its KV cache and wraps
    ``model.step`` in a new runtime.
    """

    def __init__(self, config: ToyConfig | None = None, device: str | torch.device | None = None,
                 widths: Sequence[int] | None = None, *, attention: str = "cells", pieces: bool = False):
        self.config = config or ToyConfig.tiny()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise InputError(expected("device", "a torch device such as 'cpu' or 'cuda'", repr(device))) from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(expected("device", "a device this machine has", f"{device} (no CUDA here)"))
        self.widths = tuple(widths) if widths is not None else None
        self.model = ToyDecoder(self.config, self.device, attention=attention)
        self.pieces = pieces
        self.capacity = Capacity(self.config.max_seqs, self.config.max_len, self.config.vocab)
        self.tolerance = Tolerance.for_dtype(self.config.dtype, self.device)
        self.name = f"toy {self._size()} {str(self.config.dtype).replace('torch.', '')}"

    def _size(self) -> str:
        """"tiny" / "bench" when the config is one of those (any dtype), else "custom"."""
        c = self.config
        for size, make in (("bench", ToyConfig.bench), ("tiny", ToyConfig.tiny)):
            if c == make(dtype=c.dtype):
                return size
        return "custom"

    def build(self, graphs: bool) -> GraphRuntime:
        return self.runtime(graphs, self.widths)

    def reference(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.reference(list(tokens))

    def continuation(self, prompt: list[int], n: int) -> list[int]:
        """Guess with the rule the weights implement, then let the reference correct the
        first wrong token and guess again: one reference call when the rule holds (it is
        built to), never a wrong answer when it does not."""
        toks, m = list(prompt), self.model

        def regrow(upto: int) -> None:  # keep toks[:upto], guess the rest by the rule
            del toks[upto:]
            while len(toks) < len(prompt) + n:
                toks.append(m.design_next(toks[-2] if len(toks) > 1 else toks[-1], toks[-1]))

        regrow(len(prompt))
        while n:
            greedy = m.reference(toks)[0].tolist()
            bad = next((p for p in range(len(prompt) - 1, len(toks) - 1) if greedy[p] != toks[p + 1]), None)
            if bad is None:
                break
            toks[bad + 1] = greedy[bad]  # right now: everything before it was right
            regrow(bad + 2)
        return toks[len(prompt):]

    def cli_args(self) -> list[str] | None:
        c, size = self.config, self._size()
        if size == "custom":
            return None  # the CLI cannot rebuild it
        args = ["--size", "bench"] if size == "bench" else []
        default_dtype = (ToyConfig.bench() if size == "bench" else ToyConfig.tiny()).dtype
        if c.dtype != default_dtype:
            args += ["--dtype", str(c.dtype).replace("torch.", "")]
        return args + self._piece_args() + self._machine_args()


class HFAdapter(PoolAdapter):
    """A transformers causal LM (``models/hf.py``) under the sweep, built by
    ``hf.build(family, size, ...)`` (random weights from a config, or a local directory with
    ``path``) or passed in as an :class:`~cudagraph_rt.models.hf.HFDecoder` (``model=``).

    Random weights leave small logit margins, so :meth:`clear` tells the harness where the
    reference's greedy token is clear (``HFDecoder.clear_positions``: top-1 beats top-2 by
    more than a few ulps of the row's largest logit); a token that differs elsewhere is
    counted as a near-tie, not a failure. Graphs on and off must still agree bit for bit
    (the sweep's own comparison of each mode against the same reference, and the GPU tests,
    check it). ``compile``: ``model.compile_decoder(compile)`` first, so every mode steps the
    compiled rows (compiled at the runtime's warm-up) while :meth:`reference` stays eager.
    Cells and the model-state check: :class:`PoolAdapter`.
    """

    def __init__(self, family: str = "llama", size: str = "tiny", dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, widths: Sequence[int] | None = None, *,
                 model=None, seed: int = 0, path: str | None = None, attention: str = "cells", pieces: bool = False,
                 compile: str | None = None):
        from ..models import hf

        self._rebuildable = model is None  # a model passed in: the CLI cannot rebuild it
        if model is None:
            if device is not None:
                try:
                    device = torch.device(device)
                except (RuntimeError, TypeError):
                    raise InputError(expected("device", "a torch device such as 'cpu' or 'cuda'",
                                              repr(device))) from None
                if device.type == "cuda" and not torch.cuda.is_available():
                    raise InputError(expected("device", "a device this machine has", f"{device} (no CUDA here)"))
            model = hf.build(family, size, dtype=dtype, device=device, seed=seed, path=path, attention=attention)
        self.model, self.family, self.size, self.path = model, model.config.family, model.config.size, path
        self.pieces, self.compile = pieces, compile
        if compile is not None:  # every mode then steps the compiled rows; reference() stays eager
            model.compile_decoder(compile)
        self.device = model.device
        self.widths = tuple(widths) if widths is not None else None
        c = model.config
        self.capacity = Capacity(c.max_seqs, c.max_len, c.vocab)
        self._logits: tuple[tuple[int, ...], torch.Tensor] | None = None
        self.name = f"hf:{self.family} {self.size} {str(c.dtype).replace('torch.', '')}"

    def build(self, graphs: bool) -> GraphRuntime:
        return self.runtime(graphs, self.widths)

    def reference(self, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = self.model.reference_logits(list(tokens))
        self._logits = (tuple(int(t) for t in tokens), logits)  # for clear(): no second forward
        return logits.argmax(-1), hidden

    def clear(self, tokens: Sequence[int]) -> torch.Tensor:
        """[L] bool: positions whose reference greedy token has a clear margin."""
        key = tuple(int(t) for t in tokens)
        if self._logits is None or self._logits[0] != key:
            self.reference(key)
        return self.model.clear_positions(self._logits[1]).cpu()

    def continuation(self, prompt: list[int], n: int) -> list[int]:
        """Greedy continuation that the one-call reference of the whole sequence agrees with:
        ``model.greedy_generate`` (transformers' generate with its own cache), then checked
        with one reference call over all of it (another computation rounds differently and
        may flip a near-tie) and repaired from the first disagreement. Terminates: each
        repair fixes one more position for good (the logits at p do not depend on later
        tokens)."""
        toks = list(prompt) + (self.model.greedy_generate(list(prompt), n) if n else [])
        for _ in range(n + 1):
            greedy = self.reference(toks)[0].tolist()
            bad = next((p for p in range(len(prompt) - 1, len(toks) - 1) if greedy[p] != toks[p + 1]), None)
            if bad is None:
                break
            toks[bad + 1:] = greedy[bad:len(toks) - 1]
        return toks[len(prompt):]

    def cli_args(self) -> list[str] | None:
        if not self._rebuildable or (self.path is None and self.size not in ("tiny", "1b")):
            return None
        if self.path is not None:  # a local checkpoint folder: built as tiny (fp32 unless --dtype)
            args = ["--model", str(self.path)]
        else:
            args = ["--model", f"hf:{self.family}"] + (["--size", self.size] if self.size != "tiny" else [])
        default = torch.float32 if self.size in ("tiny", "local") else torch.bfloat16
        if self.model.config.dtype != default:
            args += ["--dtype", str(self.model.config.dtype).replace("torch.", "")]
        return args + (["--compile", self.compile] if self.compile else []) + self._piece_args() + self._machine_args()
