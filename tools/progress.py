"""What a ``cgrt`` command shows on stderr while it works, and the library's log messages.

On a terminal: a live display (rich's Progress), one spinner line per phase under way
(building a model, capturing, serving), its text followed by the latest message the
library logs (``capturing width 32 (3 of 7)``, ``compiling ...``), and a bar for counted
work (a sweep's steps). In a pipe or a log a live display is a stream of redraws: each
phase is one line there instead, and no bar. ``--quiet``: nothing. ``--verbose``: every
message of the library's loggers (``cudagraph_rt.*``, DEBUG and up) printed as a line, on a
terminal above the live display.

The library only logs (a logger per module, no handler of its own). An :class:`Activity`
attaches one handler to the ``cudagraph_rt`` logger for the command's duration and takes
it off again, with the logger's level put back (the commands also run in-process, from
tests). Nothing here imports torch.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

from .console import make_console

LOGGER = "cudagraph_rt"


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _Count(ProgressColumn):
    """``done/total`` for counted work; nothing for a phase (no total)."""

    def render(self, task: Task) -> Text:
        return Text("" if task.total is None else f"{int(task.completed)}/{int(task.total)}")


class _ToDisplay(logging.Handler):
    """The library's records: printed as lines (``verbose``), and on a terminal the text
    of the innermost phase's line."""

    def __init__(self, activity: "Activity", verbose: bool):
        super().__init__(logging.DEBUG if verbose else logging.INFO)
        self.activity, self.verbose = activity, verbose

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if self.verbose:
                self.activity.console.print(f"{record.name}: {text}", markup=False, highlight=False, soft_wrap=True)
            if record.levelno >= logging.INFO:
                self.activity.status(text)
        except Exception:  # noqa: BLE001 - logging's contract: a handler never raises
            self.handleError(record)


class Activity:
    """The progress display and log handler of one command run (a context manager).

    ``quiet``: no display and no phase lines. ``verbose``: the library's log messages as
    lines. ``console``: where it all goes (default: stderr). Lifetime: the ``with`` block;
    the handler and the logger's level are restored on exit, also on an exception."""

    def __init__(self, command: str, *, quiet: bool = False, verbose: bool = False, console: Console | None = None):
        self.command, self.quiet, self.verbose = command, quiet and not verbose, verbose
        self.console = console or make_console(stderr=True)
        self.live = self.console.is_terminal and not self.quiet
        # stdout is taken over (printed above the display) only when it is the terminal too:
        # a pipe's stdout (``--json | jq``) must get its bytes, not the display's console.
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), _Count(),
                                 TimeElapsedColumn(), console=self.console, transient=True, disable=not self.live,
                                 redirect_stdout=_is_terminal(sys.stdout))
        self._phases: list[tuple[int, str]] = []  # (task id, phase text), innermost last
        self._handler: _ToDisplay | None = None
        self._level = logging.NOTSET

    @classmethod
    def of(cls, command: str, args: argparse.Namespace, console: Console | None = None) -> "Activity":
        """The Activity that ``--quiet`` / ``--verbose`` of ``args`` ask for."""
        return cls(command, quiet=bool(getattr(args, "quiet", False)), verbose=bool(getattr(args, "verbose", False)),
                   console=console)

    def __enter__(self) -> "Activity":
        if self.live or self.verbose:
            logger = logging.getLogger(LOGGER)
            self._level = logger.level
            self._handler = _ToDisplay(self, self.verbose)
            logger.addHandler(self._handler)
            logger.setLevel(self._handler.level)
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()
        if self._handler is not None:
            logger = logging.getLogger(LOGGER)
            logger.removeHandler(self._handler)
            logger.setLevel(self._level)
            self._handler = None

    @contextlib.contextmanager
    def phase(self, text: str) -> Iterator[None]:
        """A phase of the run: a spinner line on a terminal, one line on stderr elsewhere
        (``cgrt sweep: building hf:llama tiny on cpu ...``), nothing with ``--quiet``."""
        if not self.live:
            if not self.quiet:
                print(f"{self.command}: {text} ...", file=sys.stderr, flush=True)
            yield
            return
        task = self.progress.add_task(text, total=None)
        self._phases.append((task, text))
        try:
            yield
        finally:
            self._phases.remove((task, text))
            self.progress.remove_task(task)

    def status(self, text: str) -> None:
        """``text`` after the innermost phase's own (a terminal only)."""
        if self.live and self._phases:
            task, base = self._phases[-1]
            self.progress.update(task, description=f"{base}: {text}")

    def note(self, text: str) -> None:
        """A milestone: the phase's text on a terminal, one line on stderr elsewhere."""
        if self.live:
            self.status(text)
        elif not self.quiet:
            print(f"{self.command}: {text}", file=sys.stderr, flush=True)

    def counter(self, text: str, total: int) -> Callable[[int], None]:
        """A bar of ``total`` on a terminal; returns ``update(done)`` (a no-op elsewhere)."""
        if not self.live:
            return lambda done: None
        task = self.progress.add_task(text, total=total)
        return lambda done: self.progress.update(task, completed=done)
