"""The ``aiokv`` command: ``aiokv demo``, ``aiokv info`` and ``aiokv bench ...`` (local,
transfer, layerwise, latency, raw, device, vllm). Ctrl-C ends any of them within a second.

Every argument is checked before any work starts; an error is one line on stderr that
names the fix (exit status 2 for a bad argument, 1 for a failure while running), with a
traceback only under ``aiokv --debug``. Help texts are rich markup to typer: a ``[`` in
one is escaped (:func:`_text`), or rich would take ``[nixl]`` for a style and drop it.
"""

from __future__ import annotations

import errno
import inspect
import ipaddress
import json
import os
import socket
import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Annotated
from typing import NoReturn
from typing import TypeVar

import typer

if TYPE_CHECKING:
    from ._bench._harness import Report


def _text(help_text: str) -> str:
    """``help_text`` shown as written under typer's rich markup (``[`` escaped)."""
    return help_text.replace("[", "\\[")


HELP = _text(
    "aiokv: asyncio-first KV-cache transfer (llm_datadist's API). Commands: aiokv demo "
    "(a model served prefill → decode), aiokv info (devices, transports, versions), "
    "aiokv bench [local|transfer|device|layerwise|latency|raw|vllm]. Ctrl-C ends any of "
    "them within a second."
)

Command = TypeVar("Command", bound=Callable[..., None])


def _command(group: typer.Typer, name: str | None = None) -> Callable[[Command], Command]:
    """``group.command(name)``, its help the function's docstring with each paragraph on
    one line, ``[`` escaped: rich keeps a help text's single line breaks in a group's list
    of commands (``aiokv bench --help``), which would then break where the source does."""

    def register(command: Command) -> Command:
        paragraphs = (inspect.getdoc(command) or "").split("\n\n")
        group.command(name, help=_text("\n\n".join(" ".join(p.split()) for p in paragraphs)))(
            command
        )
        return command

    return register


app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich", help=HELP)
bench_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="Benchmarks with ratios against raw baselines.",
)
app.add_typer(bench_app, name="bench")

#: ``aiokv --debug``: let an unexpected error's traceback through (:func:`main`)
_debug = False
#: a command said it was interrupted: :func:`main` does not say it again
_told_interrupted = False

#: what ``--plot`` can write (matplotlib picks the format by the suffix)
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _fail(command: str, message: str, code: int = 2) -> NoReturn:
    """Print ``aiokv COMMAND: MESSAGE`` (one line, on stderr: the message's line breaks
    folded) and exit with ``code``."""
    typer.echo(f"aiokv {command}: {' '.join(message.split())}", err=True)
    raise typer.Exit(code)


def _check_plot(command: str, path: Path | None) -> None:
    """Exit (one line) unless ``path`` can take the chart: matplotlib installed, a file
    name with a known suffix, in a folder that exists and is writable."""
    from ._bench._plot import check_plotting

    if path is None:
        return
    if (hint := check_plotting()) is not None:
        _fail(command, hint, 1)
    folder = path.parent
    if path.is_dir():
        _fail(command, f"--plot {path} is a folder: name a file in it, e.g. {path / 'bench.png'}")
    if path.suffix.lower() not in PLOT_SUFFIXES:
        _fail(command, f"--plot {path}: name a {', '.join(PLOT_SUFFIXES)} file")
    if not folder.is_dir():
        _fail(command, f"--plot {path}: the folder {folder} does not exist: create it first")
    if not os.access(folder, os.W_OK):
        _fail(command, f"--plot {path}: cannot write into {folder}: pick a writable folder")


def _check_bindable(command: str, option: str, host: str, port: int) -> None:
    """Exit (one line) unless ``host:port`` can be listened on now (port 0 always can)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        socket.create_server((host, port), family=family).close()
    except socket.gaierror:
        _fail(command, f"{option} {host}:{port}: unknown host {host!r}: give an IP address")
    except OSError as exc:
        why = {
            errno.EADDRINUSE: "the port is in use: pick another, or 0 for any free port",
            errno.EADDRNOTAVAIL: f"{host} is no address of this machine: use one of its "
            "addresses, 0.0.0.0 or 127.0.0.1",
            errno.EACCES: "that port needs privileges: use one above 1023, or 0",
        }.get(exc.errno or 0, f"{exc.strerror or exc}")
        _fail(command, f"{option} {host}:{port}: {why}")


Quick = Annotated[bool, typer.Option(help="Fewer sizes or rounds: checks that it works.")]
Json = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout, nothing else there.")
]
Plot = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        metavar="FILE.png",
        help=_text("Also draw the charts into FILE.png (needs matplotlib: aiokv[plot])."),
    ),
]


def _run_bench(name: str, run: Callable[[], Report], as_json: bool, plot: Path | None) -> None:
    """Run a benchmark with progress bars on stderr; print its report (tables, or one
    JSON object on stdout); draw it into ``plot``. ``plot`` is checked first (nothing
    runs if it cannot be written). Errors a user can act on (NIXL missing, a listener
    unreachable) print one line and exit 1."""
    _check_plot(f"bench {name}", plot)
    from ._bench._plot import plot_report
    from ._bench._progress import shown
    from ._errors import LLMException

    try:
        with shown():
            report = run()
    except (LLMException, OSError) as exc:
        _fail(f"bench {name}", str(exc), 1)
    if as_json:
        print(json.dumps(report.as_dict()), flush=True)
    else:
        report.render()
    if plot is not None:
        charts = plot_report(report.as_dict(), plot)
        typer.echo(f"aiokv bench {name}: {charts} chart(s) drawn into {plot}", err=True)


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


@_command(app)
def demo(
    prompts: Annotated[int, typer.Option(help="Requests in the batch.")] = 4,
    prompt_len: Annotated[int, typer.Option(help="Longest prompt (others down to half).")] = 96,
    layers: Annotated[int, typer.Option(help="Transformer layers.")] = 4,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    steps: Annotated[int, typer.Option(help="Tokens each decoder generates per request.")] = 16,
    backend: Annotated[
        DemoBackend,
        typer.Option(help=_text("nixl needs aiokv[nixl].")),
    ] = DemoBackend.tcp,
    decoders: Annotated[int, typer.Option(help="Decode processes fed by the one prefill.")] = 1,
    device: Annotated[DemoDevice, typer.Option(help="Model and cache device.")] = DemoDevice.auto,
    rounds: Annotated[
        int, typer.Option(help="Timed rounds of each kind; every time shown is their median.")
    ] = 3,
) -> None:
    """Serve a tiny transformer disaggregated: a prefill process sends each layer's KV
    blocks (transfer_cache_async) to decode processes, whose tokens must be identical to
    a colocated run. Exits 1 if they are not."""
    from ._demo import DemoError
    from ._demo import DemoOptions
    from ._demo import reap_tracker
    from ._demo import run_demo

    opts = DemoOptions(
        prompts=prompts,
        prompt_len=prompt_len,
        layers=layers,
        block_size=block_size,
        steps=steps,
        backend=backend.value,
        decoders=decoders,
        device=device.value,
        rounds=rounds,
    )
    try:
        run_demo(opts)
    except ValueError as exc:  # an option out of range, a --device this machine lacks
        _fail("demo", str(exc))
    except DemoError as exc:
        _fail("demo", str(exc), 1)
    except KeyboardInterrupt:
        global _told_interrupted
        _told_interrupted = True
        typer.echo("aiokv demo: interrupted", err=True)
        raise typer.Exit(130) from None
    finally:
        reap_tracker()


def _set_debug(value: bool) -> None:
    global _debug
    _debug = value


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"aiokv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print aiokv's version and exit."
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            envvar="AIOKV_DEBUG",
            callback=_set_debug,
            is_eager=True,
            help="Show the traceback of an unexpected error (else one line).",
        ),
    ] = False,
) -> None:
    """The options before the command (``--version``, ``--debug``)."""


@_command(app)
def info(as_json: Json = False) -> None:
    """Devices (cpu, cuda, npu), transports (tcp, tls, nixl: available or why not,
    NIXL/UCX versions), versions and the event loop."""
    from ._info import collect
    from ._info import render

    found = collect()
    if as_json:
        print(json.dumps(found), flush=True)
    else:
        render(found)


@_command(bench_app, "local")
def bench_local(quick: Quick = False, as_json: Json = False, plot: Plot = None) -> None:
    """swap_blocks of N paged blocks vs the best plain-torch method; small-op latency."""
    from ._bench.local import run_local_bench

    _run_bench(
        "local",
        lambda: (
            run_local_bench(repeat=2, layers=8, small_rounds=300) if quick else run_local_bench()
        ),
        as_json,
        plot,
    )


Tls = Annotated[
    bool,
    typer.Option(
        "--tls", help="Also pull/push over TLS (throwaway certificates) in the same rounds."
    ),
]


Peers = Annotated[
    bool,
    typer.Option(
        "--peers",
        help="Also run the other engines that are installed: Mooncake TE over TCP "
        "(same blocks, same rounds).",
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
        help=_text(
            "nixl: also aiokv over NIXL and raw NIXL agents (UCX shm/CMA and UCX over "
            "TCP; transfer: and memcpy), same blocks, same rounds (needs aiokv[nixl])."
        ),
    ),
]


Listen = Annotated[
    str | None,
    typer.Option(
        "--listen",
        metavar="HOST:PORT",
        help="Serve as the peer of a --connect run on another host (port 0: any; the "
        "bound port is printed) until Ctrl-C. Trusted networks only: no authentication.",
    ),
]
Connect = Annotated[
    str | None,
    typer.Option(
        "--connect",
        metavar="HOST:PORT",
        help="Run against `aiokv bench transfer --listen` at HOST:PORT instead of a "
        "loopback peer, and report (plain TCP: no --tls, no --backend nixl).",
    ),
]
DataPort = Annotated[
    int,
    typer.Option(
        "--data-port",
        min=0,
        max=65535,
        help="With --listen: the port of the aiokv participant (0: any; sent to the driver).",
    ),
]
Once = Annotated[
    bool, typer.Option("--once", help="With --listen: exit when the first driver is done.")
]


def _address(option: str, text: str) -> tuple[str, int]:
    from ._bench.remote import parse_address

    try:
        host, port = parse_address(text)
    except ValueError as exc:
        _fail("bench transfer", f"{option}: {exc}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        _fail("bench transfer", f"{option} {text}: {host!r} is no IP address: give an IP address")
    return host, port


def _transfer_target(
    command: str, connect: str | None, tls: bool, backend: BenchBackend, peers: bool
) -> tuple[str, int] | None:
    """``--connect``'s address (``None``: the peer runs here); exit (one line) if it is
    given with an option that needs the peer here, or ``--peers`` without Mooncake."""
    from ._bench.mooncake import missing

    if connect is not None and (tls or backend != BenchBackend.tcp or peers):
        _fail(command, "--connect runs plain TCP: no --tls, --backend nixl or --peers")
    if peers and (why := missing()) is not None:
        _fail(command, why, 1)
    if connect is None:
        return None
    host, port = _address("--connect", connect)
    if not port:
        _fail(command, f"--connect {connect}: port 0 names no listener: give its port")
    return host, port


@_command(bench_app, "transfer")
def bench_transfer(
    quick: Quick = False,
    as_json: Json = False,
    tls: Tls = False,
    backend: BackendOpt = BenchBackend.tcp,
    peers: Peers = False,
    listen: Listen = None,
    connect: Connect = None,
    data_port: DataPort = 0,
    once: Once = False,
    plot: Plot = None,
) -> None:
    """pull/push vs a raw socket stream (and over TLS, NIXL, vs Mooncake); layer-wise
    overlap (+ overhead); 1,000 in flight. Across two hosts: --listen on one, --connect on the
    other."""
    command = "bench transfer"
    if listen is not None:
        if (
            connect is not None
            or tls
            or backend != BenchBackend.tcp
            or peers
            or plot is not None
            or quick
            or as_json
        ):
            _fail(
                command,
                "--listen takes no --connect, --tls, --backend nixl, --peers, --plot, "
                "--quick or --json (the --connect side chooses the run and its output)",
            )
        host, port = _address("--listen", listen)
        if data_port and data_port == port:
            _fail(command, f"--data-port {data_port} is the --listen port: pick another, or 0")
        _check_bindable(command, "--listen", host, port)
        if data_port:
            _check_bindable(command, "--data-port", host, data_port)
        from ._bench._harness import run_loop
        from ._bench.remote import serve_peer
        from ._errors import LLMException

        try:
            run_loop(lambda: serve_peer(host, port, data_port=data_port, once=once))
        except (LLMException, OSError) as exc:
            _fail(command, str(exc), 1)
        return
    if once or data_port:
        _fail(command, "--once and --data-port go with --listen only")
    target = _transfer_target(command, connect, tls, backend, peers)
    from ._bench.transfer import run_transfer_bench

    _run_bench(
        "transfer",
        lambda: run_transfer_bench(
            quick=quick, tls=tls, backend=backend.value, connect=target, peers=peers
        ),
        as_json,
        plot,
    )


DeviceBackendOpt = Annotated[
    BenchBackend,
    typer.Option(
        "--backend",
        help=_text(
            "tcp: host staging vs raw socket + cudaMemcpy; nixl: CUDA pools registered "
            "with NIXL (VRAM) vs raw NIXL agents over the same blocks (needs aiokv[nixl])."
        ),
    ),
]


@_command(bench_app, "device")
def bench_device(
    quick: Quick = False,
    as_json: Json = False,
    backend: DeviceBackendOpt = BenchBackend.tcp,
    plot: Plot = None,
) -> None:
    """Device (CUDA) caches over TCP through host staging vs raw socket + cudaMemcpy,
    or (--backend nixl) over NIXL from VRAM vs raw NIXL."""
    from ._bench.device import run_device_bench

    _run_bench(
        "device", lambda: run_device_bench(quick=quick, backend=backend.value), as_json, plot
    )


@_command(bench_app, "layerwise")
def bench_layerwise(quick: Quick = False, as_json: Json = False, plot: Plot = None) -> None:
    """transfer_cache_async (by key, by raw addresses) vs one push_blocks of the same bytes."""
    from ._bench.layerwise import run_layerwise_bench

    _run_bench("layerwise", lambda: run_layerwise_bench(quick=quick), as_json, plot)


@_command(bench_app, "latency")
def bench_latency(
    quick: Quick = False,
    as_json: Json = False,
    backend: BackendOpt = BenchBackend.tcp,
    plot: Plot = None,
) -> None:
    """One-block pull_blocks (async and aiokv.sync) vs a raw socket request/response;
    with --backend nixl also one leased block over NIXL vs raw NIXL."""
    from ._bench.latency import run_latency_bench

    _run_bench(
        "latency", lambda: run_latency_bench(quick=quick, backend=backend.value), as_json, plot
    )


@_command(bench_app, "raw")
def bench_raw(quick: Quick = False, as_json: Json = False, plot: Plot = None) -> None:
    """Transport level: Link.read / Link.write of scattered blocks vs a raw socket stream."""
    from ._bench.raw import run_raw_bench

    _run_bench("raw", lambda: run_raw_bench(quick=quick), as_json, plot)


@_command(bench_app, "vllm")
def bench_vllm(
    quick: Quick = False,
    as_json: Json = False,
    plot: Plot = None,
    model: Annotated[
        str | None,
        typer.Option(help="A local model directory (default: a random 4-layer Llama)."),
    ] = None,
) -> None:
    """Under real vLLM: AiokvConnector vs vLLM's NixlConnector vs a colocated engine
    (run it with the Python that has vLLM: .venv-vllm/bin/aiokv)."""
    from ._bench.vllm import run_vllm_bench

    if model is not None and not Path(model).is_dir():
        _fail("bench vllm", f"--model {model}: no such directory: give a local model directory")
    _run_bench("vllm", lambda: run_vllm_bench(quick=quick, model=model), as_json, plot)


def main() -> None:
    """Entry point of the ``aiokv`` console script: ``app`` with Ctrl-C handled
    (:mod:`aiokv._bench._interrupt`): exit status 130 within a second, children reaped."""
    from ._bench._interrupt import EXIT_INTERRUPTED
    from ._bench._interrupt import interruptible

    with interruptible() as interrupt:
        try:
            app()
        except SystemExit:
            if not interrupt.interrupted:
                raise
        except Exception as exc:  # a bug, or a failure no command turned into a line
            if _debug or interrupt.interrupted:
                raise
            what = " ".join(str(exc).split()) or "(no message)"
            typer.echo(
                f"aiokv: {type(exc).__name__}: {what} (aiokv --debug shows the traceback)",
                err=True,
            )
            sys.exit(1)
    if not interrupt.interrupted:
        return
    # Interrupted: the command's own cleanup has run and its children are reaped; the
    # interpreter's teardown (torch's included) can take a second on a busy machine
    # and serves nothing now.
    if not _told_interrupted:  # once: a command may have said it (aiokv demo)
        typer.echo("aiokv: interrupted", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
