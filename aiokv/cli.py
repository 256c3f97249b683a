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


class DemoBackend(StrEnum):
    """The transport between the demo's processes."""

    tcp = "tcp"
    nixl = "nixl"


class DemoDevice(StrEnum):
    """Where the demo's model and KV caches live (``auto``: npu, cuda, else cpu)."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"


@app.command()
def demo(
    prompts: Annotated[int, typer.Option(help="Requests in the batch.")] = 4,
    prompt_len: Annotated[int, typer.Option(help="Longest prompt (others down to half).")] = 96,
    layers: Annotated[int, typer.Option(help="Transformer layers.")] = 4,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    steps: Annotated[int, typer.Option(help="Tokens each decoder generates per request.")] = 16,
    backend: Annotated[DemoBackend, typer.Option(help="nixl needs aiokv[nixl].")] = DemoBackend.tcp,
    decoders: Annotated[int, typer.Option(help="Decode processes fed by the one prefill.")] = 1,
    device: Annotated[DemoDevice, typer.Option(help="Model and cache device.")] = DemoDevice.auto,
) -> None:
    """Serve a tiny transformer disaggregated: a prefill process sends each layer's KV
    blocks (transfer_cache_async) to decode processes, whose tokens must be identical to
    a colocated run. Exits 1 if they are not."""
    from ._demo import DemoError, DemoOptions, reap_tracker, run_demo

    opts = DemoOptions(
        prompts=prompts,
        prompt_len=prompt_len,
        layers=layers,
        block_size=block_size,
        steps=steps,
        backend=backend.value,
        decoders=decoders,
        device=device.value,
    )
    try:
        run_demo(opts)
    except (ValueError, DemoError) as exc:
        typer.echo(f"aiokv demo: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("aiokv demo: interrupted", err=True)
        raise typer.Exit(130) from None
    finally:
        reap_tracker()


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
    """Entry point of the ``aiokv`` console script."""
    app()


if __name__ == "__main__":
    main()
