"""The option tables of docs/commands.md, generated from the real parser (``python3 tests/support/cli_tables.py``
prints them; tests/tools/test_cli.py checks that the page holds exactly these)."""
from __future__ import annotations

import argparse

from cudagraph_rt.cli import COMMANDS, build_parser


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: action.choices[name] for name in COMMANDS}


def rows(p: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    """(option, value, meaning) per option of ``p`` as ``--help`` shows them."""
    fmt = p._get_formatter()
    out = []
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        value = "" if a.nargs == 0 else (a.metavar or a.dest.upper())
        if a.nargs == "?":
            value = f"[{value}]"
        out.append((", ".join(a.option_strings), value, " ".join(fmt._expand_help(a).split())))
    return out


def markdown(name: str, p: argparse.ArgumentParser) -> str:
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = [f"### `cgrt {name}`", "", "| option | value | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{o}` | {f'`{esc(v)}`' if v else ''} | {esc(h)} |" for o, v, h in rows(p)]
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(markdown(n, p) for n, p in subparsers().items()))
