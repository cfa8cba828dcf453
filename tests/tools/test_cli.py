"""The `cgrt` commands speak one language (tools/options.py): every friction a newcomer met
has a test here. Usage errors are one line in one style and exit 2, before anything runs;
output paths are checked before the run and never created; ``--json`` agrees with the exit
code; ``--version``; a local transformers checkpoint folder as ``--model``; tables stay
readable at 80 columns; the README's option tables are the parsers' own.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from cudagraph_rt import InputError, __version__
from cudagraph_rt.cli import main
from tests.support import ROOT
from tests.support.cli_tables import markdown, rows, subparsers
from tests.support.extras import needs, require

QUICK_SWEEP = ["--repeats", "1", "--widths", "1,2,4", "--extras", "none", "--device", "cpu"]
QUICK_DEMO = ["--sequences", "3", "--max-new", "6", "--device", "cpu"]


def usage_error(capsys, argv: list[str], flag: str, want: str) -> str:
    """``main(argv)`` is exit 2 with one line ``cgrt <cmd>: <flag>: expected <want>...``."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"cgrt {argv[0]}: {flag}: expected {want}"), err
    return err


@pytest.mark.parametrize("argv, flag, want", [
    (["demo", "--sequences", "0"], "--sequences", "an int >= 1, got '0'"),
    (["demo", "--sequences", "-3"], "--sequences", "an int >= 1, got '-3'"),
    (["demo", "--accept-prob", "1.5"], "--accept-prob", "a number in [0, 1]"),
    (["demo", "--graphs", "sometimes"], "--graphs", "auto | on | off | both"),
    (["demo", "--size", "1b"], "--size", "tiny | bench for the toy"),
    (["sweep", "--widths", "0,2"], "--widths", "comma-separated positive ints"),
    (["sweep", "--seed", "x"], "--seed", "an int >= 0"),
    (["sweep", "--tp", "0"], "--tp", "an int >= 1"),
    (["sweep", "--threads", "0"], "--threads", "an int >= 1"),
    (["sweep", "--model", "hf:bert"], "--model", "toy | hf:llama"),
    (["bench", "--device", "tpu"], "--device", "cuda | cpu"),
    (["bench", "--sections", "9"], "--sections", "section numbers"),
    (["inspect", "--widths", "3"], "--widths", "widths the target captures (1,2,4,8,16,32,64)"),
    (["inspect", "--replays", "0"], "--replays", "an int >= 1"),
])
def test_bad_values_are_one_line_and_exit_2(capsys, argv, flag, want):
    usage_error(capsys, argv, flag, want)


@pytest.mark.parametrize("argv, flag, want", [
    (["sweep", "--extras", "5"], "--extras", "widths past the widest captured width + 1 (65;"),
    (["sweep", "--widths", "1,2,4", "--extras", "5,9"], "--extras", "widths past the widest captured width + 1 (5;"),
    (["sweep", "--attention", "varlen", "--graphs", "emulate"], "--attention", "cells | eager-piece for the toy"),
    (["bench", "--no-compile", "--compile-setups", "static"], "--compile-setups", "no torch.compile option with "
                                                                                  "--no-compile"),
    (["bench", "--no-compile", "--compile-timeout", "9"], "--compile-timeout", "no torch.compile option"),
    (["bench", "--no-compile", "--cgrt-compile-mode", "default"], "--cgrt-compile-mode", "no torch.compile option"),
    (["bench", "--hf-prompt", "8"], "--hf-prompt", "an hf model"),
    (["bench", "--tp", "2", "--sections", "1"], "--sections", "none with --tp"),
    (["inspect", "--model", "hf:llama", "--target", "cudagraph_rt.tools.inspect_cmd:toy_target"], "--model",
     "toy (the default) with --target"),
    (["demo", "--drafter", "gpu", "--model", "hf:llama"], "--drafter", "coin for transformers models"),
    (["demo", "--dispatch", "device", "--drafter", "ngram"], "--drafter", "with --dispatch device: the coin drafter"),
    (["demo", "--dispatch", "device", "--rounds", "3"], "--rounds", "none with --dispatch device"),
    (["demo", "--dispatch", "device", "--lanes", "3"], "--lanes", "none with --dispatch device (the host runner's"),
    (["demo", "--dispatch", "device", "--chunk", "7"], "--chunk", "none with --dispatch device"),
    (["demo", "--dispatch", "device", "--drafter", "gpu"], "--drafter", "with --dispatch device: the coin drafter"),
    (["demo", "--launch-rounds", "3"], "--launch-rounds", "--dispatch device with it"),
    (["bench", "--sections", "7", "--temperature", "0.8"], "--temperature", "the hf spec section with it"),
    (["bench", "--model", "hf:llama", "--sections", "dispatch", "--top-p", "0.5"], "--top-p",
     "the hf spec section with it"),
])
def test_flags_that_conflict_are_a_usage_error_before_the_run(capsys, argv, flag, want):
    """Each flag parses, together they make no sense: these were accepted without a word
    (the one left out, or the run failing later with exit 1)."""
    usage_error(capsys, argv, flag, want)


def test_varlen_attention_needs_pieces_when_graphs_are_captured(capsys):
    """`sweep --model hf:... --attention varlen --graphs emulate` without --pieces failed its
    capture after building the model (exit 1, a failed check): a usage error up front.
    With --pieces, or with graphs off, it runs."""
    usage_error(capsys, ["sweep", "--model", "hf:llama", "--attention", "varlen", "--graphs", "emulate"],
                "--attention", "cells | eager-piece when graphs are captured whole")


def test_options_are_never_abbreviated(capsys):
    """`--rep 1` was `--repeats 1`: a prefix that names one option today names another
    tomorrow. Every parser refuses them."""
    from cudagraph_rt.cli import build_parser

    for argv in (["sweep", "--rep", "1"], ["demo", "--seq", "2"], ["bench", "--sec", "5"], ["inspect", "--rep", "2"],
                 ["--vers"]):
        assert main(argv) == 2, argv
        assert "unrecognized arguments: " + argv[-2 if len(argv) > 2 else -1] in capsys.readouterr().err
    parsers = [build_parser(), *subparsers().values()]
    assert all(p.allow_abbrev is False for p in parsers)


def test_sweep_tp_refuses_compile_before_asking_for_torchrun(capsys):
    """``cgrt sweep --tp 2 --compile default``: the toy under TP compiles nothing, which the
    ranks only found out after torchrun had started them all (outside torchrun the answer
    was "launch with torchrun", and doing so got the --compile refusal). Refused up front."""
    usage_error(capsys, ["sweep", "--tp", "2", "--compile", "default"], "--compile", "an hf model")


def test_sweep_rerun_line_quotes_a_checkpoint_path(checkpoint, tmp_path):
    """The rerun line is pasted into a shell: a checkpoint folder with a space (or any shell
    character) in its path was joined unquoted, so the line named another folder."""
    import shlex
    import shutil

    from cudagraph_rt.sweep import HFAdapter, SweepOptions
    from cudagraph_rt.sweep.harness import default_repro

    odd = tmp_path / "my ckpt's"
    shutil.copytree(checkpoint, odd)
    adapter = HFAdapter("qwen3", "tiny", device="cpu", widths=(1, 2), path=str(odd), compile="default")
    line = default_repro(adapter, SweepOptions())(7, None, False)
    argv = shlex.split(line)
    assert argv[argv.index("--model") + 1] == str(odd) and argv[argv.index("--compile") + 1] == "default", line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU machine refuses graphs on")
@pytest.mark.parametrize("value", ["on", "both"])
@pytest.mark.parametrize("command", ["sweep", "demo"])
def test_graphs_that_need_cuda_are_one_usage_error_in_every_command(capsys, command, value):
    """One value set, one meaning: what cannot run without CUDA is refused alike in every
    command that runs graphs (sweep refused `both` as "'off' or 'auto'", demo ran it,
    `on` said "off, both or auto"), naming what runs here; the library says the same."""
    from cudagraph_rt.sweep import resolve_graphs

    err = usage_error(capsys, [command, "--graphs", value], "--graphs", "auto | off | emulate here")
    assert err.rstrip().endswith(f"got {value!r}") and "CUDA graphs need a GPU" in err
    with pytest.raises(InputError, match=r"^graphs: expected auto \| off \| emulate here .*, got " + repr(value)):
        resolve_graphs(value, torch.device("cpu"))


def test_every_command_with_graphs_takes_the_same_values():
    """`emulate` was accepted by sweep alone: every command that runs graphs takes the
    harness's own value set, and `--help` says the same of it."""
    from cudagraph_rt.sweep.graph_modes import GRAPHS

    parsers = {n: p for n, p in subparsers().items() if any("--graphs" in a.option_strings for a in p._actions)}
    assert set(parsers) == {"sweep", "demo", "train-drafter"}
    for name, p in parsers.items():
        act = next(a for a in p._actions if "--graphs" in a.option_strings)
        for value in GRAPHS:
            assert act.type(value) == value, (name, value)
    assert GRAPHS == ("auto", "on", "off", "both", "emulate")


def test_demo_runs_emulated_graphs(capsys):
    """`cgrt demo --graphs emulate`: the runner's runtime on the emulated graph path, every
    token and host row checked; the report names the mode."""
    assert main(["demo", *QUICK_DEMO, "--graphs", "emulate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["graphs"] for r in doc["runs"]] == ["emulate"] and doc["ok"]
    assert all(r["widths"]["graph_replays"] for r in doc["runs"])  # the graph path ran, emulated


@pytest.mark.parametrize("argv, flag", [
    (["sweep", *QUICK_SWEEP, "--json", "{missing}/out.json"], "--json"),
    (["sweep", *QUICK_SWEEP, "--plot", "{missing}"], "--plot"),
    (["demo", *QUICK_DEMO, "--json", "{missing}/out.json"], "--json"),
    (["demo", *QUICK_DEMO, "--profile", "{missing}/profile.txt"], "--profile"),
    (["inspect", "--json", "{missing}/out.json"], "--json"),
    (["inspect", "--dot", "{missing}"], "--dot"),
    (["bench", "--quick", "--sections", "5", "--json", "{missing}/bench.json"], "--json"),
    (["bench", "--quick", "--sections", "5", "--plot", "{missing}"], "--plot"),
])
def test_output_paths_are_checked_before_the_run_and_never_created(capsys, tmp_path, argv, flag):
    missing = tmp_path / "no" / "such"
    err = usage_error(capsys, [a.format(missing=missing) for a in argv], flag, "a")
    assert "exist" in err and not (tmp_path / "no").exists()  # "an existing folder" / "a file in an existing folder"


@pytest.mark.parametrize("argv, flag", [
    (["sweep", *QUICK_SWEEP, "--json", "/proc/cgrt-x.json"], "--json"),
    pytest.param(["sweep", *QUICK_SWEEP, "--plot", "/proc"], "--plot", marks=needs("matplotlib")),  # else refused
    (["demo", *QUICK_DEMO, "--profile", "/proc/cgrt-p.txt"], "--profile"),
    (["demo", *QUICK_DEMO, "--json", "/proc/cgrt-x.json"], "--json"),
    (["inspect", "--dot", "/proc"], "--dot"),
    (["bench", "--quick", "--sections", "5", "--json", "/proc/cgrt-b.json"], "--json"),
])
def test_an_output_path_nobody_can_write_is_refused_before_the_run(capsys, argv, flag):
    """os.access says yes to root for /proc, so these ran to the end and then failed with a
    traceback: the check writes the path instead (a probe file in a folder)."""
    err = usage_error(capsys, argv, flag, "a")
    assert "can write" in err, err


def test_the_output_check_leaves_nothing_behind_and_keeps_what_was_there(tmp_path):
    """The check creates what it probes and removes what it created: a new file or a probe
    in a folder leaves nothing; an existing file keeps its content; no folder is made."""
    from cudagraph_rt.tools import options

    new = tmp_path / "new.json"
    assert options.output_file(str(new)) == str(new) and not new.exists()
    old = tmp_path / "old.json"
    old.write_text("keep me")
    assert options.output_file(str(old)) == str(old) and old.read_text() == "keep me"
    assert options.output_folder(str(tmp_path)) == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        options.output_file(str(tmp_path / "no" / "x.json"))
    assert not (tmp_path / "no").exists()


def test_an_output_file_that_is_a_folder_is_refused(capsys, tmp_path):
    usage_error(capsys, ["sweep", "--json", str(tmp_path)], "--json", "a file path, not a folder")


def test_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"cudagraph_rt) {__version__}" in out and torch.__version__ in out
    proc = subprocess.run([sys.executable, "-m", "cudagraph_rt", "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and __version__ in proc.stdout


def _with_closed_stdout(argv: list[str]) -> subprocess.CompletedProcess:
    """``python -m cudagraph_rt *argv`` whose stdout is a pipe nobody reads: its reader is
    closed before the command starts, so its first write fails (``cgrt demo | head -1``
    once head has gone), whenever that write comes."""
    read, write = os.pipe()
    os.close(read)
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return subprocess.run([sys.executable, "-m", "cudagraph_rt", *argv], stdout=write, stderr=subprocess.PIPE,
                              cwd=ROOT, env=env, text=True, timeout=300)
    finally:
        os.close(write)


@pytest.mark.parametrize("argv", [
    ["demo", *QUICK_DEMO],
    ["sweep", *QUICK_SWEEP],
    ["inspect", "--widths", "1,2", "--replays", "1"],
    ["bench", "--quick", "--sections", "5"],
    ["sweep", *QUICK_SWEEP, "--json"],
    ["sweep", "--help"],
    ["--version"],
], ids=lambda a: "-".join(w.lstrip("-") for w in a if w[:1] != "-" or w in ("--json", "--help", "--version"))[:40])
def test_a_closed_stdout_ends_the_command_quietly(argv):
    """`cgrt demo | head -1` exited 1 (a failed check, to the commands), from rich's own
    answer to a closed pipe; print() raised BrokenPipeError. Now every command ends with
    141 (what a shell shows for a process that SIGPIPE ended), with no traceback and no
    "Exception ignored" from the interpreter's last flush."""
    from cudagraph_rt.cli import CLOSED_STDOUT

    proc = _with_closed_stdout(argv)
    assert proc.returncode == CLOSED_STDOUT == 141, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]


def test_help_is_exit_0(capsys):
    assert main(["demo", "--help"]) == 0
    assert "--sequences" in capsys.readouterr().out


# ------------------------------------------------------------------ before torch
PARSE_ONLY = [["sweep", "--help"], ["demo", "--help"], ["inspect", "--help"], ["bench", "--help"], ["--help"],
              ["sweep", "--widths", "0"], ["sweep", "--rep", "1"], ["demo", "--sequences", "0"],
              ["inspect", "--replays", "0"], ["bench", "--sections", "9"], ["sweep", "--json", "/proc/x.json"]]


def test_help_and_usage_errors_answer_without_importing_torch():
    """`cgrt <cmd> --help` and a usage error took 4-7 s, all of it importing torch (the
    package's __init__, each tool's module): parsing now comes first, torch only when a
    command runs. A fresh interpreter, every command's --help and several usage errors."""
    code = ("import json, sys\nfrom cudagraph_rt.cli import main\nout = []\n"
            f"for argv in {PARSE_ONLY!r}:\n"
            "    out.append([main(argv), sorted(m for m in ('torch', 'numpy') if m in sys.modules)])\n"
            "print(json.dumps(out), file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stderr.strip().splitlines()[-1])
    assert [rc for rc, _ in results] == [0] * 5 + [2] * 6, results
    assert all(not loaded for _, loaded in results), results  # neither torch nor numpy was imported


def test_the_package_and_the_tools_import_without_torch():
    """What parsing imports stays light: the package (its public names load on first use),
    the shared options, the progress display, each tool's module, the harness's plans."""
    mods = ["cudagraph_rt", "cudagraph_rt.cli", "cudagraph_rt.tools.options", "cudagraph_rt.tools.progress",
            "cudagraph_rt.tools.sweep", "cudagraph_rt.tools.demo", "cudagraph_rt.tools.inspect_cmd",
            "cudagraph_rt.tools.bench", "cudagraph_rt.sweep.plans", "cudagraph_rt.sweep.graph_modes"]
    code = f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr[-3000:]
    import cudagraph_rt

    assert cudagraph_rt.GraphRuntime.__name__ == "GraphRuntime"  # the lazy names are the real ones
    assert set(cudagraph_rt.__all__) <= set(dir(cudagraph_rt))
    with pytest.raises(AttributeError):
        cudagraph_rt.no_such_name  # noqa: B018
    from cudagraph_rt.models.compiled import MODES
    from cudagraph_rt.tools.options import COMPILE_MODES

    assert COMPILE_MODES == MODES  # --compile's values, kept torch-free in options


# ------------------------------------------------------------------ threads
@pytest.fixture
def two_threads():
    """torch on two intra-op threads (what a 2-CPU box defaults to), put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_a_tiny_model_is_built_and_run_on_one_thread_and_the_count_is_put_back(capsys, monkeypatch):
    """A tiny model on a CPU only loses time to torch's thread hand-offs (118 s where one
    thread takes 11 s): the command sets one thread for all its work, the model's build
    included (it ran on torch's default before), and puts the count back."""
    from cudagraph_rt.models import hf
    from cudagraph_rt.sweep import harness

    seen = {}

    def build(*args, **kw):
        seen["build"] = torch.get_num_threads()
        raise ImportError("stop here")  # exit 2: no model needed to see the setting

    monkeypatch.setattr(hf, "build", build)
    assert main(["demo", "--model", "hf:llama", "--device", "cpu"]) == 2 and "stop here" in capsys.readouterr().err
    real = harness.run_sweep

    def run_sweep(*args, **kw):
        seen["sweep"] = torch.get_num_threads()
        return real(*args, **kw)

    monkeypatch.setattr("cudagraph_rt.sweep.run_sweep", run_sweep)
    assert main(["sweep", *QUICK_SWEEP]) == 0
    assert seen == {"build": 1, "sweep": 1} and torch.get_num_threads() == 2
    assert main(["sweep", *QUICK_SWEEP, "--threads", "2"]) == 0 and seen["sweep"] == 2


def test_importing_the_library_leaves_the_thread_count_alone():
    """torch.set_num_threads is process-wide: the CLI and assert_sweep may set it for their
    run; importing the library (every module) must not."""
    code = ("import importlib, pkgutil, torch\ntorch.set_num_threads(3)\nimport cudagraph_rt\n"
            "for m in pkgutil.walk_packages(cudagraph_rt.__path__, 'cudagraph_rt.'):\n"
            "    if not any(s in m.name for s in ('.tools', '.kernels', '__main__')):\n"
            "        importlib.import_module(m.name)\n"
            "print(torch.get_num_threads())")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "3", proc.stdout + proc.stderr[-3000:]


# ------------------------------------------------------------------ progress and logging
def test_verbose_prints_the_librarys_log_and_quiet_prints_nothing(capsys):
    """Long work printed nothing for minutes. The library logs what it does (a logger per
    module, no handler of its own); --verbose shows those messages on stderr, without it
    a pipe or a log gets one line per phase, --quiet not even that. After the run the
    library's logger is as it was."""
    import logging

    logger = logging.getLogger("cudagraph_rt")
    level, handlers = logger.level, list(logger.handlers)
    assert main(["sweep", *QUICK_SWEEP, "--graphs", "emulate", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "cudagraph_rt.graphs.policy: capturing width 4 (1 of 3)" in err, err
    assert "cudagraph_rt.sweep.harness: graphs emulated: building the runtime and capturing" in err
    assert (logger.level, logger.handlers) == (level, handlers)
    assert main(["sweep", *QUICK_SWEEP, "--graphs", "emulate"]) == 0
    err = capsys.readouterr().err
    assert "capturing width" not in err and "cgrt sweep: sweeping ..." in err  # a phase line, not a display
    assert main(["sweep", *QUICK_SWEEP, "--graphs", "emulate", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    usage_error(capsys, ["sweep", "--quiet", "--verbose"], "--verbose", "it or --quiet, not both")


def test_the_library_configures_no_logging_handler():
    """A library logs and leaves the handlers to the program: nothing under cudagraph_rt/
    adds one or calls basicConfig."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "cudagraph_rt").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"basicConfig\(|addHandler\(|setLevel\(", line)]
    assert not found, found


def test_on_a_terminal_the_display_shows_the_phase_and_the_latest_message():
    """On a terminal: a spinner line per phase, followed by the library's latest message,
    and a bar for counted work; all of it gone when the command ends (transient)."""
    import logging

    from rich.console import Console

    from cudagraph_rt.tools.progress import Activity

    con = Console(file=io.StringIO(), force_terminal=True, width=120, color_system=None)
    with Activity("cgrt test", console=con) as activity:
        assert activity.live
        with activity.phase("capturing"):
            logging.getLogger("cudagraph_rt.graphs.policy").info("capturing width %d (%d of %d)", 8, 2, 3)
            done = activity.counter("graphs off", 10)
            done(4)
            activity.progress.refresh()
            shown = con.file.getvalue()
    assert "capturing: capturing width 8 (2 of 3)" in shown and "4/10" in shown, shown
    quiet = Console(file=io.StringIO(), force_terminal=True)
    with Activity("cgrt test", quiet=True, console=quiet) as activity:
        assert not activity.live
        with activity.phase("capturing"):
            logging.getLogger("cudagraph_rt.graphs.policy").info("capturing width 8")
    assert quiet.file.getvalue() == ""


@pytest.mark.parametrize("extra, loop_extra", [([], []), (["--slots", "2", "--k", "2"], ["--launch-rounds", "2"]),
                                               (["--temperature", "4", "--top-k", "30"], [])])
def test_demo_with_device_dispatch_serves_the_host_runners_tokens(capsys, extra, loop_extra):
    """`cgrt demo --dispatch device` on a CPU: the device loop, emulated (graphs off runs it
    so, and says so), every token and host row checked; greedy, so its tokens are the host
    runner's for the same requests, and sampled, the same seeds and drafts draw them too."""
    assert main(["demo", *QUICK_DEMO, "--max-new", "12", *extra, "--json"]) == 0
    host = json.loads(capsys.readouterr().out)
    assert main(["demo", *QUICK_DEMO, "--max-new", "12", *extra, *loop_extra, "--dispatch", "device", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["config"]["dispatch"] == "device" and any("emulated" in n for n in doc["notes"])
    (run,) = doc["runs"]
    assert run["graphs"] == "emulate" and run["loop"]["rounds_ran"] == "host"
    assert run["loop"]["rounds"] == run["steps"] > 0 and run["check"]["rows_checked"] == run["tokens"] > 0
    assert doc["tokens"] == host["tokens"] and all(doc["tokens"])
    assert doc["config"]["lanes"] is None and doc["config"]["chunk"] is None  # the host runner's, not the loop's
    if loop_extra:  # two rounds a launch: the loop launched more than once
        assert run["loop"]["loop_launches"] > 1 and set(run["loop"]["stops"]) <= {"ROUNDS", "FINISHED", "RETIRED"}


def test_a_failed_check_of_the_device_loop_is_exit_1(capsys, monkeypatch):
    from cudagraph_rt.tools.demo import serve as demo

    real = demo.check
    monkeypatch.setattr(demo, "check", lambda model, seqs, **kw: {**real(model, seqs, **kw), "ok": False})
    assert main(["demo", *QUICK_DEMO, "--dispatch", "device", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


# ------------------------------------------------------------------ exit codes and --json
def test_json_on_stdout_is_the_json_alone_and_agrees_with_the_exit_code(capsys, tmp_path):
    rc = main(["sweep", *QUICK_SWEEP, "--json"])
    cap = capsys.readouterr()
    doc = json.loads(cap.out)  # stdout holds nothing else
    assert rc == 0 and doc["ok"] is True and "sweep PASSED" in cap.err
    path = tmp_path / "demo.json"
    rc = main(["demo", *QUICK_DEMO, "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and json.loads(path.read_text())["ok"] is True
    assert "tokens/s" in out and f"json: {path}" in out  # a file: the tables still print


def test_inspect_json_ok_agrees_with_the_exit_code(capsys):
    rc = main(["inspect", "--json", "--widths", "1,2"])
    doc = json.loads(capsys.readouterr().out)
    assert (rc == 0) == doc["ok"] and rc in (0, 1)
    if not torch.cuda.is_available():  # the hazard finder alone, on a clean toy: all clear
        assert rc == 0 and doc["ok"] is True and doc["available"] is False


def test_a_failed_check_is_exit_1_and_json_says_not_ok(capsys, monkeypatch):
    from cudagraph_rt.tools.demo import serve as demo

    real = demo.check

    def wrong(model, runner, **kw):
        out = real(model, runner, **kw)
        return {**out, "ok": False, "token_mismatches": [0]}

    monkeypatch.setattr(demo, "check", wrong)
    assert main(["demo", *QUICK_DEMO, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


# ------------------------------------------------------------------ bench on a CPU
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU defaults of cgrt bench")
def test_bench_on_a_cpu_defaults_to_its_smoke_settings_and_judges_no_goal(capsys, tmp_path):
    path = tmp_path / "b.json"
    assert main(["bench", "--sections", "5", "--json", str(path)]) == 0  # no --quick
    data = json.loads(path.read_text())
    assert data["meta"]["config"]["hidden"] == 64 and data["meta"]["repeats"] == 5  # tiny, 5 repeats
    assert data["padding"]["steps"] == 200 and data["goals"] == [] and data["ok"] is True
    out = capsys.readouterr().out
    assert "not GPU figures" in out and "met" not in out and "missed" not in out


# ------------------------------------------------------------------ a local checkpoint
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    require("transformers")
    from cudagraph_rt.models import hf

    folder = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    hf.build("qwen3", "tiny", device="cpu", seed=0).model.save_pretrained(folder)
    return folder


def test_model_path_runs_sweep_demo_and_inspect_on_a_saved_checkpoint(capsys, checkpoint):
    assert main(["sweep", "--model", str(checkpoint), *QUICK_SWEEP]) == 0
    cap = capsys.readouterr()
    assert "sweep PASSED" in cap.out and "building" in cap.err  # progress while the model builds
    assert f"--model {checkpoint}" in cap.out  # the rerun command names the folder
    assert main(["demo", "--model", str(checkpoint), *QUICK_DEMO, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["config"]["model"] == str(checkpoint) and doc["config"]["size"] == "local"
    assert main(["inspect", "--model", str(checkpoint), "--widths", "1,2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_model_path_that_is_not_a_checkpoint_is_refused(capsys, tmp_path, checkpoint):
    usage_error(capsys, ["sweep", "--model", str(tmp_path)], "--model", "a transformers checkpoint folder")
    usage_error(capsys, ["demo", "--model", str(checkpoint), "--size", "1b"], "--size", "no size with a checkpoint")


# ------------------------------------------------------------------ 80 columns
def _render(tables) -> str:
    con = Console(width=80, file=io.StringIO(), highlight=False, color_system=None)
    for t in tables:
        con.print(t)
    return con.file.getvalue()


def _assert_readable(text: str, values: list[str]) -> None:
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for v in values:  # every figure shows whole: not cut, not folded over two lines
        assert v in text, (v, text)


def test_tables_are_readable_at_80_columns(capsys, tmp_path, monkeypatch):
    from cudagraph_rt.sweep import ToyAdapter, run_sweep
    from cudagraph_rt.sweep.report import rich_tables
    from cudagraph_rt.tools.bench import report as bench_report
    from cudagraph_rt.tools.demo import report as demo_report
    from cudagraph_rt.tools import console as console_mod

    rep = run_sweep(ToyAdapter(device="cpu", widths=(1, 2, 4)), graphs="off", repeats=1, extras=())
    _assert_readable(_render(rich_tables(rep)), [f"{w.mean_ms:.3f}" for m in rep.modes for w in m.widths])

    assert main(["demo", *QUICK_DEMO, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    con = Console(width=80, file=io.StringIO(), highlight=False, color_system=None)
    monkeypatch.setattr(console_mod, "make_console", lambda stderr=False, markup=True: con)
    demo_report._print(doc)
    run = doc["runs"][0]
    _assert_readable(con.file.getvalue(), [f"{run['tokens_per_s']:.1f}", f"{run['steps_per_s']:.1f}",
                                           *(f"{v:.1f}" for v in run["host_phases_us_per_step"].values())])

    path = tmp_path / "b.json"
    assert main(["bench", "--quick", "--sections", "1,2,5", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    for key in ("step_time", "mixed_trace", "padding"):
        tables = bench_report.tables(key, res[key])
        _assert_readable(_render(tables), [w for t in tables for r in t.rows for c in r for w in str(c).split()])


def test_a_wide_table_splits_its_columns_at_80_and_cuts_no_figure():
    from cudagraph_rt.tools.console import SplitTable

    cols = ["T"] + [f"variant {i} µs" for i in range(13)]
    rows = [[str(T)] + [f"{1000 * T + i + 0.5:.1f}" for i in range(13)] for T in (1, 2, 64)]
    t = SplitTable("a 14-column table", cols, rows, caption="the caption")
    text = _render([t])
    _assert_readable(text, [c for r in rows for c in r])
    assert text.count("a 14-column table (continued)") >= 1 and text.count("the caption") == 1
    wide = Console(width=200, file=io.StringIO(), color_system=None)
    wide.print(t)
    assert "(continued)" not in wide.file.getvalue()  # one table where it fits


# ------------------------------------------------------------------ the README's tables
def test_readme_option_tables_are_the_parsers_own():
    """The option tables the README points to (docs/commands.md) are the parsers' own."""
    text = (ROOT / "docs" / "commands.md").read_text()
    for name, parser in subparsers().items():
        want = markdown(name, parser)
        assert want in text, f"docs/commands.md's options of cgrt {name} differ from --help; they should read:\n\n{want}"
        help_text = parser.format_help()
        for option, _, _ in rows(parser):  # and --help itself lists each option the table names
            assert re.search(rf"(^|\s){re.escape(option)}\b", help_text), option


def test_every_command_takes_the_shared_arguments_with_one_meaning():
    """The shared flags read the same in every command that has them."""
    seen: dict[str, dict[str, str]] = {}
    for name, parser in subparsers().items():
        for option, value, meaning in rows(parser):
            seen.setdefault(option, {})[name] = value
    for flag in ("--model", "--size", "--json", "--threads", "--seed", "--tp", "--device", "--graphs", "--plot",
                 "--widths"):
        assert flag in seen, flag
        assert len(set(seen[flag].values())) == 1, (flag, seen[flag])  # one value syntax everywhere
    assert set(seen["--json"].values()) == {"[FILE]"} and set(seen["--plot"].values()) == {"DIR"}
    assert set(seen["--threads"]) >= {"sweep", "demo", "bench", "inspect"}  # every command that times
    assert importlib.util.find_spec("cudagraph_rt.tools.options") is not None


# ======================================================================================
# From the bad-input catalogue (issue 7): the CLI's arguments; every tool it
# lists must import.
# Each test runs graphs off, then with emulated graphs (rig_graphs); a refused call is
# checked for its error class and message, for nothing written (Rig.snapshot: the static
# arena, the KV state, the host-row ring, the commit snapshots, the counters) and for a
# valid step after it that matches the eager reference (tests.support.reliability_harness.refused).
# ======================================================================================
@pytest.fixture
def cli():
    """cudagraph_rt.cli as installed: every tool it lists must import (a deleted or broken
    tool fails the tests below, it is never stubbed or skipped)."""
    from cudagraph_rt import cli as cli_mod
    for name, (module, _help) in cli_mod.COMMANDS.items():
        importlib.import_module(f"cudagraph_rt.tools.{module}")
    return cli_mod


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_cli_no_command_prints_help_and_returns_2(cli, capsys):
    assert cli.main([]) == 2
    assert "usage: cgrt" in capsys.readouterr().out


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("argv,msg", [
    (["no-such-command"], r"invalid choice: 'no-such-command'"),
    (["--no-such-flag"], r"unrecognized arguments: --no-such-flag"),
])
def test_cli_bad_top_level_arguments_exit_2(cli, capsys, argv, msg):
    assert cli.main(argv) == 2  # main returns every exit code, usage errors included
    err = capsys.readouterr().err
    assert re.search(msg, err) and err.startswith("cgrt: ") and err.count("\n") == 1


def _subparser(cli, name):
    p = cli.build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _commands():
    from cudagraph_rt import cli as cli_mod
    return list(cli_mod.COMMANDS.items())


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("name,module", [(n, m) for n, (m, _h) in _commands()], ids=[n for n, _ in _commands()])
def test_cli_tool_rejects_bad_flags(cli, capsys, name, module):
    assert cli.main([name, "--definitely-not-a-flag"]) == 2
    assert "unrecognized arguments: --definitely-not-a-flag" in capsys.readouterr().err
    sp = _subparser(cli, name)
    checked = 0
    for act in sp._actions:  # every flag whose value is checked while parsing
        if not act.option_strings or act.nargs == 0 or act.type is None:
            continue
        flag = act.option_strings[-1]
        assert cli.main([name, flag, "__bogus__/x"]) == 2, flag
        err = capsys.readouterr().err
        assert err.startswith(f"cgrt {name}: {flag}: expected ") and err.count("\n") == 1, (flag, err)
        checked += 1
    assert checked >= 3, name
    assert cli.main([name, "--help"]) == 0
    assert f"usage: cgrt {name}" in capsys.readouterr().out


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_cli_survives_one_missing_tool(cli, monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "ghost", ("ghost_tool_not_written", "a tool that does not exist"))
    assert cli.main([]) == 2
    assert "usage: cgrt" in capsys.readouterr().out
