"""``aiokv demo``: a tiny transformer served disaggregated, prefill → decode.

A prefill process and one or more decode processes (``spawn``), each an
``LLMDataDist`` linked over ``tcp`` (or ``nixl``). The prefill runs the batch through
the model of :mod:`aiokv.examples.tiny_model`, and ``transfer_cache_async`` sends each
layer's KV blocks to the decoders as soon as that layer is written; the decoders
receive into blocks of their own and decode greedily. The tokens must be identical to a
colocated run (one process, no transfer), else the demo fails.

Everything lives in the package: it runs from an installed wheel, in any directory.
"""

from __future__ import annotations

from rich.console import Console

from ._plan import DemoOptions
from ._report import render
from ._run import DemoError
from ._run import DemoMismatch
from ._run import DemoResult
from ._run import collect
from ._run import reap_tracker

__all__ = [
    "DemoError",
    "DemoMismatch",
    "DemoOptions",
    "DemoResult",
    "reap_tracker",
    "run_demo",
]


def run_demo(opts: DemoOptions, console: Console | None = None) -> DemoResult:
    """Run the demo, print its report on ``console`` and return what it measured.

    Raises:
        ValueError: an option out of range, or a ``--device`` this machine lacks.
        DemoError: NIXL missing for ``--backend nixl``, or a process failed or stopped
            answering.
        DemoMismatch: a decoder's tokens differ from the colocated run's (after the
            report, which shows which).
    """
    console = console or Console()
    with console.status(f"prefill + {opts.decoders} decoder process(es) running …"):
        result = collect(opts)
    render(result, console)
    if not result.all_identical:
        bad = sorted(i for i, ok in result.identical.items() if not ok)
        raise DemoMismatch(f"requests {bad}: the decoders' tokens differ from the colocated run")
    return result
