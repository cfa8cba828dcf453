"""One rich Console for every command: full width in a terminal, 150 columns in a pipe or
a log (rich's default of 80 would cut the tables), no colour codes there."""
from __future__ import annotations

import sys

from rich.console import Console


def make_console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 150, highlight=False)
