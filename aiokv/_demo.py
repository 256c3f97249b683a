"""``aiokv demo``: runs the repository's examples with a readable transcript.

The examples live in ``examples/`` beside the package (they are the documentation a
newcomer reads); the demo loads them from there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from rich.console import Console

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMOS = (
    ("local_blocks", "local KV blocks: allocate, swap out/in, fork"),
    ("disaggregated", "prefill → decode over TCP: link, pull, layer-wise push"),
)


def _load(name: str) -> ModuleType | None:
    path = EXAMPLES / f"{name}.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"aiokv_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def run_demo() -> None:
    """Run each example in ``examples/`` that exists, printing what it did."""
    console = Console()
    ran = 0
    for name, title in DEMOS:
        module = _load(name)
        if module is None:
            continue
        console.rule(f"[bold]aiokv demo: {title}")
        await module.main(say=console.print)
        ran += 1
    if not ran:
        raise SystemExit(f"no examples found in {EXAMPLES} (run from a checkout of aiokv)")
    console.rule("[bold green]done")
