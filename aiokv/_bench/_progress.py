"""Progress of a benchmark, shown by the command that runs it.

A benchmark marks its long parts with :func:`steps`, each with its total number of
steps known before it starts (the bar reads ``3/8``, never ``0/?``); a part made of
named sub-parts runs each under :meth:`Steps.step`. Nothing is shown unless the caller
wraps the run in :func:`shown` (``aiokv bench`` does: rich progress bars on stderr, so
that ``--json`` keeps stdout to itself; they vanish when done). The bar in effect is a
context variable: tasks and worker threads of the run see it, other runs do not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from rich.console import Console
from rich.progress import BarColumn
from rich.progress import MofNCompleteColumn
from rich.progress import Progress
from rich.progress import SpinnerColumn
from rich.progress import TaskID
from rich.progress import TextColumn
from rich.progress import TimeElapsedColumn

__all__ = ["Steps", "shown", "steps"]

_BAR: ContextVar[Progress | None] = ContextVar("aiokv_bench_progress", default=None)


class Steps:
    """One bar: :meth:`advance` it as steps complete (a no-op when nothing is shown)."""

    def __init__(self, bar: Progress | None = None, task: TaskID | None = None) -> None:
        self._bar, self._task = bar, task

    def advance(self, n: float = 1) -> None:
        """``n`` more steps done."""
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, n)

    @contextlib.contextmanager
    def step(self, description: str) -> Iterator[None]:
        """One step of the bar, shown as ``description`` while it runs, counted done
        when the block ends (also when it raises: the bar is then removed anyway)."""
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=description)
        try:
            yield
        finally:
            self.advance()


@contextlib.contextmanager
def steps(description: str, total: int) -> Iterator[Steps]:
    """A bar of ``total`` steps (known before the part starts) for the block, removed
    after it."""
    bar = _BAR.get()
    if bar is None:
        yield Steps()
        return
    task = bar.add_task(description, total=total)
    try:
        yield Steps(bar, task)
    finally:
        bar.remove_task(task)


@contextlib.contextmanager
def shown(console: Console | None = None) -> Iterator[None]:
    """Show the :func:`steps` of the block as progress bars on ``console`` (default:
    stderr, and then nothing at all, not even the blank line rich's live display leaves
    behind, when stderr is not a terminal: it keeps only the command's own lines)."""
    if console is None:
        console = Console(stderr=True)
        if not console.is_terminal:
            yield
            return
    bar = Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with bar:
        token = _BAR.set(bar)
        try:
            yield
        finally:
            _BAR.reset(token)
