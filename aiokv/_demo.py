"""``aiokv demo``: runs the examples shipped in :mod:`aiokv.examples`, with a transcript.

The examples are modules of the package, imported by name, so the demo works wherever
aiokv is installed (a wheel, any working directory), not only from a checkout.
"""

from __future__ import annotations

import importlib

from rich.console import Console

DEMOS = (
    ("local_blocks", "local KV blocks: allocate, swap out/in, fork"),
    ("disaggregated", "prefill → decode over TCP: link, pull, layer-wise push"),
)


async def run_demo() -> None:
    """Run every example in :data:`DEMOS`, in order, printing what each did.

    Raises:
        Exception: whatever an example raised; the demo stops at the first failure.
    """
    console = Console()
    for name, title in DEMOS:
        module = importlib.import_module(f"aiokv.examples.{name}")
        console.rule(f"[bold]aiokv demo: {title}")
        await module.main(say=console.print)
    console.rule("[bold green]done")
