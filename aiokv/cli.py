"""The ``aiokv`` command: ``aiokv demo`` and ``aiokv bench ...`` (local, transfer,
layerwise, latency, raw)."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from ._bench._harness import Report

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks with ratios against raw baselines.")
app.add_typer(bench_app, name="bench")

Quick = Annotated[bool, typer.Option(help="Fewer sizes or rounds: checks that it works.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


def _emit(report: Report, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.as_dict()))
    else:
        report.render()


@app.command()
def demo() -> None:
    """Allocate, swap and copy KV blocks, and move them between two linked participants."""
    from ._bench._harness import run_loop
    from ._demo import run_demo

    run_loop(run_demo)


@bench_app.command("local")
def bench_local(quick: Quick = False, as_json: Json = False) -> None:
    """swap_blocks of N paged blocks vs the best plain-torch method; small-op latency."""
    from ._bench.local import run_local_bench

    _emit(
        run_local_bench(repeat=2, layers=8, small_rounds=300) if quick else run_local_bench(),
        as_json,
    )


Tls = Annotated[
    bool,
    typer.Option(
        "--tls", help="Also pull/push over TLS (throwaway certificates) in the same rounds."
    ),
]


class BenchBackend(StrEnum):
    """What ``aiokv bench transfer --backend`` adds to the throughput rounds."""

    tcp = "tcp"
    nixl = "nixl"


BackendOpt = Annotated[
    BenchBackend,
    typer.Option(
        "--backend",
        help="nixl: also aiokv over NIXL and raw NIXL (UCX shm/CMA and UCX over TCP) "
        "and memcpy, same blocks, same rounds (needs aiokv[nixl]).",
    ),
]


@bench_app.command("transfer")
def bench_transfer(
    quick: Quick = False,
    as_json: Json = False,
    tls: Tls = False,
    backend: BackendOpt = BenchBackend.tcp,
) -> None:
    """pull/push vs a raw socket stream (and over TLS, or NIXL); layer-wise overlap
    (+ overhead); 1,000 in flight."""
    from ._bench.transfer import run_transfer_bench
    from ._errors import LLMException

    try:
        report = run_transfer_bench(quick=quick, tls=tls, backend=backend.value)
    except LLMException as exc:  # NIXL missing: the install hint, no traceback
        typer.echo(f"aiokv bench transfer: {exc}", err=True)
        raise typer.Exit(1) from None
    _emit(report, as_json)


@bench_app.command("layerwise")
def bench_layerwise(quick: Quick = False, as_json: Json = False) -> None:
    """transfer_cache_async (by key, by raw addresses) vs one push_blocks of the same bytes."""
    from ._bench.layerwise import run_layerwise_bench

    _emit(run_layerwise_bench(quick=quick), as_json)


@bench_app.command("latency")
def bench_latency(quick: Quick = False, as_json: Json = False) -> None:
    """One-block pull_blocks (async and aiokv.sync) vs a raw socket request/response."""
    from ._bench.latency import run_latency_bench

    _emit(run_latency_bench(quick=quick), as_json)


@bench_app.command("raw")
def bench_raw(quick: Quick = False, as_json: Json = False) -> None:
    """Transport level: Link.read / Link.write of scattered blocks vs a raw socket stream."""
    from ._bench.raw import run_raw_bench

    _emit(run_raw_bench(quick=quick), as_json)


def main() -> None:
    """Entry point of the ``aiokv`` console script: ``app`` with Ctrl-C handled
    (:mod:`aiokv._bench._interrupt`): exit status 130 within a second, children reaped."""
    from ._bench._interrupt import EXIT_INTERRUPTED, interruptible

    with interruptible() as interrupt:
        try:
            app()
        except SystemExit:
            if interrupt.interrupted:
                typer.echo("aiokv: interrupted", err=True)
                raise SystemExit(EXIT_INTERRUPTED) from None
            raise


if __name__ == "__main__":
    main()
