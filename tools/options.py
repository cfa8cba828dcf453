"""The arguments every ``cgrt`` command takes, with one meaning each, and the checks every
command makes before it runs anything.

One language:

- ``--model M``: ``toy`` (the embedded toy decoder), ``hf:<family>`` (a transformers model
  with random weights) or the path of a local transformers checkpoint folder (what
  ``save_pretrained`` wrote; loaded with ``local_files_only``, never downloaded).
- ``--size S``: the model's size: ``tiny`` | ``bench`` for the toy, ``tiny`` | ``1b`` for
  ``hf:`` models (not for a checkpoint folder, whose size is its own).
- ``--device``: ``cuda`` | ``cpu`` (default: cuda where torch sees one).
- ``--widths W,W,..``: positive step widths.
- ``--graphs``: ``auto`` | ``on`` | ``off`` | ``both`` | ``emulate``, one meaning in every
  command that runs graphs (``cudagraph_rt.sweep.graph_modes``); what needs CUDA graphs
  (``on``, ``both``) is a usage error on a device without CUDA, naming what runs there.
- ``--seed N``: the seed of every random draw the command makes (an int >= 0), the
  sampled tokens' included (each request's seed derives from it and its uid).
- ``--temperature T --top-k K --top-p P --min-p M``: every request's sampling settings
  (:class:`cudagraph_rt.SamplingParams`; default greedy), checked while parsing.
- ``--tp N``: tensor-parallel ranks, under ``torchrun --nproc-per-node N``.
- ``--threads N``: torch's intra-op CPU threads while the command runs (default: see
  :func:`thread_count`). The CLI sets it; the library never does.
- ``--quiet`` / ``--verbose``: no progress display / the library's log messages on stderr
  (``tools/progress.py``).
- ``--json [FILE]``: the whole report as JSON, into FILE, or on stdout without one (then
  everything meant for people goes to stderr, so stdout is the JSON alone). A file is for
  long runs that also print tables (bench); stdout is for pipes (``cgrt sweep --json | jq``).
- ``--drafter D``: what drafts for the speculative runner: ``ngram`` (prompt lookup),
  ``head:PATH`` (a head from ``cgrt train-drafter --kind head``), ``model:PATH`` (a draft
  model: a transformers checkpoint folder, e.g. ``cgrt train-drafter --kind model``'s),
  ``coin`` (a test double: right with probability ``--accept-prob``; ``host`` is its old
  name, ``gpu`` the same coin drafting in its own GraphRuntime, toy only). A PATH that is
  not there is a usage error at parsing; one for another vocabulary, once the model is built.
- ``--plot DIR``: an existing folder; the command writes its named PNGs into it (sweep one,
  bench two) and prints their paths. A folder because one command writes several plots,
  and the same everywhere.

Every output path (``--json FILE``, ``--plot DIR``, ``--dot DIR``, ``--profile FILE``) is
checked while the arguments are parsed by writing it: the file is opened for appending (a
probe file in a folder), and what the check created is removed again. So a path the run
could not write is a usage error before the run, never a traceback after it, whatever
``os.access`` says (for root it says yes to ``/proc``); no folder is ever created. A bad
value is one line, ``cgrt <command>: --flag: expected ..., got ...``, and exit code 2;
exit code 1 is kept for a failed check.

Nothing here imports torch at import time: ``cgrt <command> --help`` and a usage error
answer before torch loads (the commands import it when they run).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from cudagraph_rt.errors import InputError, expected
from cudagraph_rt.extras import available, message
from cudagraph_rt.sweep.graph_modes import GRAPHS, MEANING, resolve_graphs

if TYPE_CHECKING:
    import torch

TOY_SIZES = ("tiny", "bench")
HF_SIZES = ("tiny", "1b")
# torch.compile modes that leave CUDA graphs to the runtime: cudagraph_rt.models.compiled.MODES
# (tests/tools/test_cli.py keeps the two equal; that module imports torch).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
STDOUT = "-"  # --json without a file


class UsageError(InputError):
    """A command-line value the command cannot use: printed as one line, exit code 2."""


def _bad(want: str, got: str) -> argparse.ArgumentTypeError:
    """The parser prefixes the flag: ``--flag: expected <want>, got '<got>'``."""
    return argparse.ArgumentTypeError(f"expected {want}, got {got!r}")


# --------------------------------------------------------------------------- value types
def int_at_least(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """``type=`` for an int >= ``lo`` (and <= ``hi`` when given)."""
    what = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            raise _bad(what, text)
        return v
    parse.__name__ = what.removeprefix("an ")
    return parse


def probability(text: str) -> float:
    """``type=`` for a number in [0, 1]."""
    try:
        v = float(text)
    except ValueError:
        v = None
    if v is None or not 0.0 <= v <= 1.0:
        raise _bad("a number in [0, 1]", text)
    return v


def real_in(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
            what: str | None = None) -> Callable[[str], float]:
    """``type=`` for a finite number between ``lo`` and ``hi`` (each end open or closed)."""
    want = what or f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = None
        ok = v is not None and math.isfinite(v) and (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
        if not ok:
            raise _bad(want, text)
        return v
    parse.__name__ = want
    return parse


def sampling_setting(field: str, parse: Callable[[str], float]) -> Callable[[str], float]:
    """``type=`` for a SamplingParams field: ``parse`` first, then the field's own check (a
    value that does not hold as a float32, 1e39 for a temperature, is refused here too)."""
    def check(text: str):
        v = parse(text)
        from cudagraph_rt.errors import InputError
        from cudagraph_rt.sampling_params import SamplingParams
        try:
            SamplingParams(**{field: v})
        except InputError as e:
            raise _bad(str(e).split(": expected ", 1)[-1].split(", got ")[0], text) from None
        return v
    check.__name__ = parse.__name__
    return check


def one_of(*choices: str) -> Callable[[str], str]:
    """``type=`` for one of ``choices`` (argparse's ``choices=`` has a message of its own)."""
    def parse(text: str) -> str:
        if text not in choices:
            raise _bad(" | ".join(choices), text)
        return text
    parse.__name__ = "one of " + ", ".join(choices)
    return parse


def positive_ints(text: str) -> tuple[int, ...]:
    """``type=`` for comma-separated positive ints (``1,2,4``)."""
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or any(x < 1 for x in out):
        raise _bad("comma-separated positive ints such as 1,2,4", text)
    return out


def output_file(text: str) -> str:
    """``type=`` for a file the command writes: not a folder, and writable, which is
    checked by opening it for appending (an existing file keeps its content; a file the
    check created is removed again). No folder is created."""
    folder = os.path.dirname(os.path.abspath(text)) or "."
    if os.path.isdir(text):
        raise _bad("a file path, not a folder", text)
    if not os.path.isdir(folder):
        raise _bad(f"a file in an existing folder ({folder} does not exist)", text)
    existed = os.path.lexists(text)
    try:
        with open(text, "a"):
            pass
    except OSError as e:
        raise _bad(f"a file this user can write (writing it fails: {e.strerror or e})", text) from None
    if not existed:
        os.unlink(text)
    return text


def output_folder(text: str) -> str:
    """``type=`` for an existing folder the command writes files into; writable, which is
    checked by creating a probe file in it and removing it again."""
    if not os.path.isdir(text):
        raise _bad("an existing folder (it is not created)", text)
    try:
        fd, probe = tempfile.mkstemp(prefix=".cgrt-probe-", dir=text)
    except OSError as e:
        raise _bad(f"a folder this user can write (writing a file in it fails: {e.strerror or e})", text) from None
    os.close(fd)
    os.unlink(probe)
    return text


def json_target(text: str) -> str:
    return text if text == STDOUT else output_file(text)


def plot_folder(text: str) -> str:
    """``--plot DIR``: an existing folder, and matplotlib (the plot extra) importable."""
    folder = output_folder(text)
    if not available("plot"):
        raise argparse.ArgumentTypeError(message("plot", "--plot"))
    return folder


DRAFTERS = ("ngram", "head:PATH", "model:PATH", "coin")
COIN_DRAFTERS = ("coin", "host", "gpu")  # the test doubles (host: coin's old name; gpu: on the device)


def is_coin(kind: str) -> bool:
    """Whether ``--drafter kind`` is a test double whose acceptance is set, not measured."""
    return kind in COIN_DRAFTERS


def drafter(text: str) -> str:
    """``--drafter``: one of :data:`DRAFTERS` (or ``host`` / ``gpu``); a ``head:`` PATH must be
    a file and a ``model:`` PATH a folder. Returns the text."""
    kind, _, path = text.partition(":")
    if text in ("ngram", *COIN_DRAFTERS) and not path:
        return text
    if kind == "head" and path:
        if not os.path.isfile(path):
            raise _bad("a draft head file after head: (cgrt train-drafter --kind head --out PATH)", path)
        return text
    if kind == "model" and path:
        if not os.path.isdir(path):
            raise _bad("a checkpoint folder after model: (cgrt train-drafter --kind model --out PATH)", path)
        return text
    raise _bad(" | ".join(DRAFTERS), text)


def add_drafter(p: argparse.ArgumentParser, default: str = "coin", note: str = "") -> None:
    p.add_argument("--drafter", type=drafter, default=default, metavar="D",
                   help="ngram (prompt lookup) | head:PATH (cgrt train-drafter --kind head) | model:PATH (a draft "
                        "model's checkpoint folder) | coin (a test double, right with probability --accept-prob; "
                        f"gpu: the coin in its own GraphRuntime, toy only) (default {default}){note}")


DISPATCH_DEVICE_WANTS = "the coin drafter (--drafter coin: the device loop draws its drafts on the device) and one process"
LAUNCH_ROUNDS, MAX_LAUNCH_ROUNDS = 64, 1 << 16  # cudagraph_rt.dispatch.loop.MAX_ROUNDS


def add_dispatch(p: argparse.ArgumentParser, note: str = "") -> None:
    """``--dispatch host|device`` and ``--launch-rounds N`` (the device loop's rounds per launch;
    :func:`check_dispatch` gives it its default, and refuses it without ``--dispatch device``)."""
    p.add_argument("--dispatch", type=one_of("host", "device"), default="host", metavar="WHERE",
                   help="host: the runner plans every speculative step on the host (default); device: the rounds "
                        "run on the device (cudagraph_rt.dispatch.DeviceLoop: one launch of conditional graph nodes "
                        "for up to --launch-rounds rounds where CUDA allows, else host-driven rounds with a message "
                        "saying why; emulated with graphs off). Device dispatch takes " + DISPATCH_DEVICE_WANTS + note)
    p.add_argument("--launch-rounds", type=int_at_least(1, MAX_LAUNCH_ROUNDS), default=None, metavar="N",
                   help=f"--dispatch device: rounds per launch of the loop (default {LAUNCH_ROUNDS})")


def check_dispatch(args: argparse.Namespace, host_only: dict[str, bool], why: str) -> None:
    """``--dispatch`` with the flags beside it (UsageError naming the first that does not
    apply): ``--launch-rounds`` only with ``--dispatch device`` (given its default here),
    and with it none of ``host_only`` (flag -> whether it was given; ``why``: whose they are)."""
    if args.dispatch != "device":
        if args.launch_rounds is not None:
            raise UsageError(expected("--launch-rounds", "--dispatch device with it", args.launch_rounds))
        return
    if args.launch_rounds is None:
        args.launch_rounds = LAUNCH_ROUNDS
    for flag, given in host_only.items():
        if given:
            value = getattr(args, flag[2:].replace("-", "_"), None)
            raise UsageError(expected(flag, f"none with --dispatch device ({why})", value))


# --------------------------------------------------------------------------- the arguments
def add_model(p: argparse.ArgumentParser, *, size_default: str = "tiny", size_note: str = "",
              model_note: str = "") -> None:
    p.add_argument("--model", default="toy", metavar="M",
                   help="toy (default) | hf:llama | hf:qwen2 | hf:qwen3 | hf:mistral (transformers, random "
                        f"weights) | PATH of a local transformers checkpoint folder{model_note}")
    p.add_argument("--size", default=None, metavar="S",
                   help=f"the model's size: tiny | bench for the toy, tiny | 1b (Llama-3.2-1B shape, bf16) for "
                        f"hf: models (default {size_default}{size_note})")


COMPILE_WANTS = "an hf model (--model hf:... or a checkpoint folder)"  # what --compile needs


def add_compile(p: argparse.ArgumentParser, does: str, note: str) -> None:
    """``--compile MODE``: hf models only (the caller refuses it for the toy with
    :data:`COMPILE_WANTS`)."""
    p.add_argument("--compile", default=None, metavar="MODE", type=one_of(*COMPILE_MODES),
                   help=f"hf models: {does} the decoder through torch.compile(mode=MODE), MODE "
                        f"{' | '.join(COMPILE_MODES)}{note}")


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=one_of("cuda", "cpu"), metavar="DEV",
                   help="cuda | cpu (default: cuda where torch sees one)")


def add_widths(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--widths", type=positive_ints, metavar="W,W,..", help=help)


def add_graphs(p: argparse.ArgumentParser) -> None:
    """``--graphs``: one value set and one meaning in every command (graph_modes)."""
    p.add_argument("--graphs", type=one_of(*GRAPHS), default="auto", metavar="MODE", help=MEANING)


def add_seed(p: argparse.ArgumentParser, default: int | None, what: str) -> None:
    p.add_argument("--seed", type=int_at_least(0), default=default, metavar="N",
                   help=f"seed of {what} (default: {'a fresh one, printed' if default is None else default})")


def add_sampling(p: argparse.ArgumentParser, applies: str = "every request") -> None:
    """``--temperature --top-k --top-p --min-p``: the sampling settings of {applies}
    (``sampling_params(args)``); ``--seed`` seeds the draws."""
    g = p.add_argument_group("sampling", f"how {applies} draws its tokens (default greedy); --seed seeds the draws")
    g.add_argument("--temperature", type=sampling_setting("temperature", real_in(0.0, math.inf, hi_open=True,
                                                                                  what="a finite number >= 0")),
                   default=0.0, metavar="T", help="softmax temperature; 0 is greedy (default 0)")
    g.add_argument("--top-k", type=sampling_setting("top_k", int_at_least(0)), default=0, metavar="K",
                   help="keep the K most likely tokens; 0 is off (default 0)")
    g.add_argument("--top-p", type=sampling_setting("top_p", real_in(0.0, 1.0, lo_open=True)), default=1.0, metavar="P",
                   help="keep the most likely tokens up to mass P of the top-k set; 1 is off (default 1)")
    g.add_argument("--min-p", type=sampling_setting("min_p", real_in(0.0, 1.0, hi_open=True)), default=0.0, metavar="M",
                   help="keep the tokens with p >= M * p_max; 0 is off (default 0)")


def sampling_params(args: argparse.Namespace):
    """The :class:`cudagraph_rt.SamplingParams` of ``add_sampling``'s flags (seed None: each
    request's seed derives from the runner's, ``--seed``, and its uid)."""
    from cudagraph_rt.sampling_params import SamplingParams

    return SamplingParams(temperature=getattr(args, "temperature", 0.0), top_k=getattr(args, "top_k", 0),
                          top_p=getattr(args, "top_p", 1.0), min_p=getattr(args, "min_p", 0.0))


def add_tp(p: argparse.ArgumentParser, note: str = "") -> None:
    p.add_argument("--tp", type=int_at_least(1), default=1, metavar="N",
                   help=f"tensor-parallel ranks: launch with torchrun --nproc-per-node N{note} (default 1)")


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int_at_least(1), metavar="N",
                   help="torch's CPU intra-op threads (default: 1 for a tiny model on a CPU, else torch's own)")


def add_verbosity(p: argparse.ArgumentParser) -> None:
    """``--quiet`` and ``--verbose``, which exclude each other (tools/progress.py)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quiet", action="store_true",
                   help="no progress display on stderr (it shows only on a terminal anyway)")
    g.add_argument("--verbose", action="store_true",
                   help="the library's log messages on stderr (builds, compiles, captures, sweeps)")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", nargs="?", const=STDOUT, type=json_target, metavar="FILE",
                   help="the report as JSON into FILE, or on stdout without one (text then goes to stderr)")


def add_plot(p: argparse.ArgumentParser, writes: str) -> None:
    p.add_argument("--plot", type=plot_folder, metavar="DIR",
                   help=f"write {writes} into DIR, an existing folder (needs the plot extra)")


# --------------------------------------------------------------------------- resolution
@dataclass(frozen=True)
class ModelChoice:
    """What ``--model``/``--size`` name: ``kind`` toy | hf | path; ``family`` (hf: the
    family; path: the checkpoint's model_type); ``size``; ``path`` (a checkpoint folder)."""

    kind: str
    size: str
    family: str | None = None
    path: str | None = None

    @property
    def label(self) -> str:
        return {"toy": f"toy {self.size}", "hf": f"hf:{self.family} {self.size}"}.get(self.kind, str(self.path))

    @property
    def tiny(self) -> bool:
        return self.size == "tiny"


def model_choice(args: argparse.Namespace, default_size: str = "tiny", hf_default_size: str | None = None) -> ModelChoice:
    """``--model`` and ``--size`` checked together; UsageError naming the flag."""
    from cudagraph_rt.models.hf import FAMILIES

    text, size = args.model, args.size
    if text == "toy":
        size = size or default_size
        if size not in TOY_SIZES:
            raise UsageError(expected("--size", " | ".join(TOY_SIZES) + " for the toy", repr(size)))
        return ModelChoice("toy", size)
    if text.startswith("hf:") and text[3:] in FAMILIES:
        size = size or hf_default_size or default_size
        if size not in HF_SIZES:
            raise UsageError(expected("--size", " | ".join(HF_SIZES) + " for hf: models", repr(size)))
        return ModelChoice("hf", size, family=text[3:])
    if os.path.isdir(text):
        return _checkpoint(text, size)
    want = "toy | " + " | ".join(f"hf:{f}" for f in FAMILIES) + " | a local checkpoint folder"
    raise UsageError(expected("--model", want, repr(text)))


def _checkpoint(path: str, size: str | None) -> ModelChoice:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise UsageError(expected("--model", "a transformers checkpoint folder (with config.json)", repr(path)))
    if size is not None:
        raise UsageError(expected("--size", "no size with a checkpoint folder (its size is its own)", repr(size)))
    try:
        with open(config) as f:
            family = str(json.load(f).get("model_type") or "custom")
    except (OSError, ValueError) as e:
        raise UsageError(expected("--model", "a readable config.json", f"{path}: {e}")) from None
    return ModelChoice("path", "local", family=family, path=path)


def device(args: argparse.Namespace) -> "torch.device":
    """``--device`` as a torch.device; UsageError for cuda where torch sees none."""
    import torch

    name = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError(expected("--device", "a device this machine has", "cuda (torch sees no CUDA device)"))
    return torch.device(name)


def graph_modes(mode: str, dev: "torch.device") -> tuple[list[bool | str], list[str]]:
    """``--graphs`` on ``dev`` -> the graph modes to run, in order (True: on, False: off,
    "emulate"), and notes; UsageError for a mode that cannot run on ``dev``. The meaning is
    the sweep harness's own (cudagraph_rt.sweep.graph_modes), for every command."""
    try:
        modes, notes = resolve_graphs(mode, dev, name="--graphs")
    except InputError as e:
        raise UsageError(str(e)) from None
    return list(modes), list(notes)


def thread_count(args: argparse.Namespace, dev: "torch.device", tiny: bool) -> int | None:
    """``--threads``, or its default: 1 for a tiny model on a CPU, else None (torch's own)."""
    n = getattr(args, "threads", None)
    if n is None and dev.type == "cpu" and tiny:
        return 1
    return n


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` (None: unchanged) for the block, then
    restored (the commands may run in-process, from tests)."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def json_to_stdout(args: argparse.Namespace) -> bool:
    return getattr(args, "json", None) == STDOUT


def write_json(target: str | None, obj: Any) -> str | None:
    """``obj`` as JSON into the file ``target`` or on stdout (``-``); returns the file
    written (None for stdout or no target)."""
    if target is None:
        return None
    text = json.dumps(obj, indent=1, default=str)
    if target == STDOUT:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return None
    with open(target, "w") as f:
        f.write(text + "\n")
    return target


def text_to_stderr(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """With ``--json`` on stdout, what the block prints for people goes to stderr (so
    stdout is the JSON alone); otherwise nothing changes."""
    return contextlib.redirect_stdout(sys.stderr) if json_to_stdout(args) else contextlib.nullcontext()


CPU_NOTE = ("CPU run: these figures are not GPU figures; goals are judged on a GPU only, and none is judged "
            "here (BENCHMARKS.md has the H200's)")
