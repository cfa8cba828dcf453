"""The `cgrt` command: sweep | inspect | bench | demo | train-drafter.

Each subcommand lives in cudagraph_rt.tools.<name> with ``add_arguments(parser)`` and
``run(args) -> int`` (the exit code). The arguments every command shares, and the checks
made before a command runs, are in cudagraph_rt.tools.options. Exit codes: 0 all good,
1 a failed check (a mismatch, a hazard, a failed section), 2 a usage error (one line:
``cgrt <command>: --flag: expected ..., got ...``), 141 (128 + SIGPIPE, what a shell shows
for a process that pipe closing killed) when the reader of stdout closed it, quietly:
``cgrt demo | head -1``.

Parsing comes before torch: this module, tools/options.py and each tool's
``add_arguments`` import no torch, so ``--help`` and usage errors answer at once; a tool
imports torch when it runs. Options are never abbreviated (``--rep`` is not ``--repeats``):
a prefix that names an option today would name another one tomorrow.
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import re
import select
import signal
import sys

COMMANDS = {
    "sweep": ("sweep", "width-sweep test harness: every width against the eager reference"),
    "inspect": ("inspect_cmd", "what each width's graph holds, and what breaks capture"),
    "bench": ("bench", "cudagraph_rt against eager, a bare CUDA graph and torch.compile"),
    "demo": ("demo", "a speculative-decoding host runner on the toy decoder"),
    "train-drafter": ("train_drafter", "self-distil a draft head or draft model from the model's own generations"),
}


class Parser(argparse.ArgumentParser):
    """argparse with the commands' one error style: ``cgrt sweep: --widths: expected ...``
    on one line, exit code 2 (argparse's own is a usage block and ``error: argument``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D102 - argparse's hook
        message = message[len("argument "):] if message.startswith("argument ") else message
        both = re.match(r"^(\S+): not allowed with argument (\S+)$", message)  # a mutually exclusive pair
        if both:
            message = f"{both[1]}: expected it or {both[2]}, not both, got both"
        self.exit(2, f"{self.prog}: {message}\n")


def version() -> str:
    import cudagraph_rt

    try:
        import torch
        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_version = "missing"
    return (f"cgrt (cudagraph_rt) {cudagraph_rt.__version__} from {cudagraph_rt.__path__[0]}; "
            f"torch {torch_version}, python {platform.python_version()}")


class _Version(argparse.Action):
    """``--version``: one line as is (argparse's own action wraps it at the terminal width)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="cgrt", description=__doc__.splitlines()[0])
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}", parser_class=Parser)
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        try:
            tool = importlib.import_module(f"cudagraph_rt.tools.{module}")
        except ImportError as e:  # one missing or broken tool must not take the others down
            sp.set_defaults(_module=None, _unavailable=f"cgrt {name}: unavailable ({type(e).__name__}: {e})")
            continue
        sp.set_defaults(_module=module)
        tool.add_arguments(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (``--help``, ``--version`` and usage errors
    included: nothing here raises SystemExit)."""
    try:
        return _main(argv)
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        return _quiet_after_closed_stdout()


def _main(argv: list[str] | None) -> int:
    from cudagraph_rt.tools.options import UsageError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0) or a usage error (2), already printed
        sys.stdout.flush()
        if _stdout_closed():  # argparse's help ignores a failed write
            return _quiet_after_closed_stdout()
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if getattr(args, "_unavailable", None):
        print(args._unavailable, file=sys.stderr)
        return 2
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    tool = importlib.import_module(f"cudagraph_rt.tools.{args._module}")
    try:
        return int(tool.run(args) or 0)
    except UsageError as e:  # a check of several flags together, made before the run
        print(f"cgrt {args.command}: {e}", file=sys.stderr)
        return 2


CLOSED_STDOUT = 128 + signal.SIGPIPE  # the exit status a shell shows for a process SIGPIPE ended


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll says POLLERR)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by an object without a file (tests)
        return False
    poll = select.poll()
    poll.register(fd, select.POLLERR)
    return bool(poll.poll(0))


def _quiet_after_closed_stdout() -> int:
    """The reader of stdout is gone (``cgrt demo | head -1``): nothing more to say, no
    traceback. stdout now writes to /dev/null, so the interpreter's last flush at exit does
    not fail a second time. Returns :data:`CLOSED_STDOUT`."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)
    return CLOSED_STDOUT


if __name__ == "__main__":
    sys.exit(main())
