"""The ``aiokv`` command: ``aiokv demo`` and ``aiokv bench local|transfer``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks with ratios against raw baselines.")
app.add_typer(bench_app, name="bench")


def _run_loop(coro_factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro_factory())
    else:
        uvloop.run(coro_factory())


@app.command()
def demo() -> None:
    """Allocate, swap and copy KV blocks, and move them between two linked participants."""
    from ._demo import run_demo

    _run_loop(run_demo)


@bench_app.command("local")
def bench_local(
    quick: Annotated[bool, typer.Option(help="Fewer sizes, fewer repeats.")] = False,
) -> None:
    """Swap/copy of N paged blocks vs the best plain-torch method; small-op latency."""
    from ._bench.local import main as local_main

    local_main(["--repeat", "2", "--layers", "8"] if quick else [])


@bench_app.command("transfer")
def bench_transfer(
    quick: Annotated[bool, typer.Option(help="Fewer sizes, fewer transfers.")] = False,
) -> None:
    """pull/push over loopback vs a raw socket stream; layer-wise overlap; 1,000 in flight."""
    from ._bench.transfer import run

    _run_loop(lambda: run(quick=quick))


def main() -> None:
    """Entry point of the ``aiokv`` console script."""
    app()


if __name__ == "__main__":
    main()
