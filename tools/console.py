"""One rich Console for every command: full width in a terminal, 150 columns in a pipe or
a log (rich's default of 80 would cut the tables), no colour codes there. Tables built by
the commands fold a cell that does not fit instead of cutting it (``fit``), so they stay
readable on an 80-column terminal."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table


def make_console(stderr: bool = False, markup: bool = True) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 150, highlight=False, markup=markup)


def fit(table: Table) -> Table:
    """``table`` with every column folding what does not fit (rich's default cuts it to
    ``27…``); the table itself is returned."""
    for col in table.columns:
        col.overflow = "fold"
    return table
