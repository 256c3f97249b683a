"""Cancellation that arrived as an operation completed: its result stands, and the
cancellation is delivered again at the caller's next suspension.

The engine (an operation run on the engine loop) and the copy workers (a job that ran
to its end) both use it: "raised or returned, never both" (docs/api.md, "Cancellation").
Standard library only: every layer may import it.
"""

from __future__ import annotations

import asyncio

__all__ = ["redeliver"]


def redeliver(cancelled: asyncio.CancelledError) -> None:
    """The current asyncio task caught ``cancelled`` and goes on (its operation
    completed): deliver that cancellation again at the task's next suspension, unless
    whoever asked for it withdrew the request meanwhile (``Task.uncancel``: an
    ``asyncio.timeout`` block that ended, a task group).

    The pending cancellation count is left as it was, and the message is kept (anyio
    tells its own cancellations by it): a scope or timeout still ends promptly, as if
    the cancellation had arrived just after the operation. On trio, and in anyio's
    scopes, cancellation is level-triggered and comes back by itself."""
    task = asyncio.current_task()
    if task is None:
        return
    pending = task.cancelling()
    if not pending:
        return  # not a cancellation of this task (a future cancelled by someone else)
    message = cancelled.args[0] if cancelled.args else None

    def again() -> None:
        if not task.done() and task.cancelling() >= pending:
            task.cancel(message)  # sets the flag (and cancels what the task waits on) ...
            task.uncancel()  # ... without asking once more

    asyncio.get_running_loop().call_soon(again)
