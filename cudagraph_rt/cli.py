"""The `cgrt` command: sweep | inspect | bench | demo.

Each subcommand lives in cudagraph_rt.tools.<name> with ``add_arguments(parser)`` and
``run(args) -> int`` (the exit code: non-zero on any failure).
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "sweep": ("sweep", "width-sweep test harness: every width against the eager reference"),
    "inspect": ("inspect_cmd", "what each width's graph holds, and what breaks capture"),
    "bench": ("bench", "cudagraph_rt against eager, a bare CUDA graph and torch.compile"),
    "demo": ("demo", "a speculative-decoding host runner on the toy decoder"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cgrt", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(args._unavailable, file=sys.stderr)
        return 2
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    tool = importlib.import_module(f"cudagraph_rt.tools.{args._module}")
    return int(tool.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
