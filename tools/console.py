"""One rich Console for every command: full width in a terminal, 150 columns in a pipe or
a log (rich's default of 80 would cut the tables), no colour codes there.

Tables stay readable on an 80-column terminal: ``fit`` makes a table fold a cell that does
not fit instead of cutting it to ``27…``, and :class:`SplitTable` (the bench's wide tables)
splits its columns over as many tables as the width needs, the key column repeated in
each, so no figure is cut or folded.
"""
from __future__ import annotations

import errno
import sys
from typing import Any, Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text


class CommandConsole(Console):
    """A Console whose closed pipe is an error like any write's: rich's own answer ends the
    process with exit code 1 (a failed check, for the commands); this raises
    BrokenPipeError, which ``cgrt`` turns into a quiet exit (cudagraph_rt.cli)."""

    def on_broken_pipe(self) -> None:  # noqa: D102 - rich's hook
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of the output closed it")


def make_console(stderr: bool = False, markup: bool = True) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return CommandConsole(stderr=stderr, width=None if stream.isatty() else 150, highlight=False, markup=markup)


def fit(table: Table) -> Table:
    """``table`` with every column folding what does not fit (rich's default cuts it to
    ``27…``); the table itself is returned."""
    for col in table.columns:
        col.overflow = "fold"
    return table


def _plain(cell: Any) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def _min_width(texts: Sequence[str]) -> int:
    """The narrowest a column can be without cutting a word: its longest word."""
    return max((len(w) for t in texts for w in t.split()), default=1)


class SplitTable:
    """A table of ``columns`` and ``rows`` (str or Text cells) that renders as one rich
    Table when the console is wide enough and, when not, as several, each holding the first
    ``keep`` columns and as many of the others as fit; title on the first, caption on the
    last. Headers and text wrap at spaces; no cell is cut."""

    def __init__(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str | None = None,
                 keep: int = 1, justify: Sequence[str] | None = None):
        self.title, self.columns, self.rows, self.caption = title, list(columns), [list(r) for r in rows], caption
        self.keep = keep
        self.justify = list(justify) if justify else ["left"] * keep + ["right"] * (len(self.columns) - keep)
        self.widths = [_min_width([c, *(_plain(r[i]) for r in self.rows)]) for i, c in enumerate(self.columns)]

    @property
    def row_count(self) -> int:
        return len(self.rows)

    def groups(self, width: int) -> list[list[int]]:
        """Column indices per part: the kept columns first in each."""
        kept = list(range(self.keep))
        base = 1 + sum(self.widths[i] + 3 for i in kept)  # a column costs its width, 2 pads, 1 rule
        out, cur, used = [], [], base
        for i in range(self.keep, len(self.columns)):
            cost = self.widths[i] + 3
            if cur and used + cost > width:
                out.append(kept + cur)
                cur, used = [], base
            cur.append(i)
            used += cost
        out.append(kept + cur)
        return out

    def table(self, cols: list[int], first: bool = True, last: bool = True, width: int | None = None) -> Table:
        """One part: ``cols``. Split (``width`` given), each column is as wide as its longest
        word, so the part fits the width it was cut for (a long title wraps); whole, the
        title keeps one line up to 80 columns."""
        title = self.title if first else f"{self.title} (continued)"
        t = Table(title=Text(title), title_justify="left", min_width=None if width else min(len(title), 80),
                  caption=Text(self.caption) if self.caption and last else None, caption_justify="left")
        for i in cols:
            t.add_column(self.columns[i], justify=self.justify[i], overflow="fold",
                         width=self.widths[i] if width is not None else None)
        for r in self.rows:
            t.add_row(*(r[i] if isinstance(r[i], Text) else Text(str(r[i])) for i in cols))
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        parts = self.groups(options.max_width)
        split = options.max_width if len(parts) > 1 else None
        for n, cols in enumerate(parts):
            yield self.table(cols, first=n == 0, last=n == len(parts) - 1, width=split)
