"""The demo's printed report: per request whether the decoder's tokens equal the
colocated run's, then bytes moved, times to first token, what layer-wise sending saved
(or cost), whether the rounds were steady enough to tell, and throughput. Every time is
a median over the rounds; docs/demo.md defines each figure."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ._run import DemoResult

__all__ = ["render"]


def _blocks(table: list[int], limit: int = 6) -> str:
    shown = ", ".join(map(str, table[:limit]))
    return f"[{shown}{', …' if len(table) > limit else ''}]"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def render(result: DemoResult, console: Console) -> None:
    """Print ``result`` as a table of requests and a summary."""
    table = Table(title="prefill → decode, per request", title_justify="left")
    for col in ("req", "prompt", "decoder", "blocks: prefill → decoder", "tokens", ""):
        table.add_column(col, no_wrap=col != "blocks: prefill → decoder")
    for i, ok in sorted(result.identical.items()):
        table.add_row(
            str(i),
            str(result.prompt_lens[i]),
            str(result.decoder_of[i]),
            f"{_blocks(result.src_tables[i], 3)} → {_blocks(result.dst_tables[i], 3)}",
            " ".join(map(str, result.tokens[i][:4])) + " …",
            "[green]tokens identical" if ok else "[bold red]tokens DIFFER",
        )
    console.print(table)
    lw, serial, colo = (result.ttft[k] for k in ("layerwise", "serial", "colocated"))
    mib = result.bytes_moved / 2**20
    n = len(result.ttft_rounds["serial"])
    if result.hidden > 1:  # more than the whole send: the prefills' times differed
        saved = (
            f"{_ms(result.saved)} of time to first token, more than the "
            f"{_ms(result.transfer)} send itself: the layer-wise rounds' prefill ran "
            f"{_ms(result.compute - result.compute_layerwise)} shorter (the rounds' spread, "
            "not the overlap)"
        )
    elif result.saved >= 0:
        saved = (
            f"{_ms(result.saved)} of time to first token = {result.hidden:.0%} of the "
            "transfer time off the critical path"
        )
    else:
        saved = (
            f"none: {_ms(-result.saved)} slower (its prefill ran "
            f"{_ms(result.compute_layerwise - result.compute)} longer: the sends compete "
            "with compute)"
        )
    if (noise := result.noise) is not None:
        verdict = f"[bold yellow]too noisy to say[/]: {noise}; rerun with more --rounds"
    else:
        verdict = f"layer-wise {'faster' if result.faster_rounds else 'slower'} in all {n} rounds"
    rows = [
        ("model on", f"{result.device}; {result.layers} layers; transport {result.backend}"),
        ("rounds", f"{n} of each kind, alternating; every time below is their median"),
        ("bytes moved", f"{mib:.2f} MiB of KV per round (prefill → decoders)"),
        (
            "time to first token (decoder)",
            f"layer-wise {_ms(lw)}  |  without overlap {_ms(serial)}  |  colocated {_ms(colo)}",
        ),
        (
            "without overlap",
            f"prefill {_ms(result.compute)}, then {_ms(result.transfer)} to send "
            f"({result.bytes_moved / max(result.transfer, 1e-9) / 1e9:.2f} GB/s)",
        ),
        (
            "layer-wise",
            f"prefill {_ms(result.compute_layerwise)}, sends done {_ms(result.tail)} after it",
        ),
        ("layer-wise saved", saved),
        ("verdict", verdict),
        ("decode throughput", f"{result.decode_tps:,.0f} tokens/s over all decoders"),
    ]
    summary = Table(show_header=False, box=None)
    for k, v in rows:
        summary.add_row(f"[bold]{k}", v)
    console.print(summary)
    n_requests = len(result.identical)
    same = sum(result.identical.values())
    if same == n_requests:
        console.print(
            f"[bold green]tokens identical[/] for all {n_requests} requests (decoders vs colocated)"
        )
    else:
        console.print(
            f"[bold red]MISMATCH[/]: {n_requests - same} of {n_requests} requests decoded "
            "other tokens"
        )
