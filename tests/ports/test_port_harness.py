"""The ports harness itself: a port picked free but taken before a party binds it."""

from __future__ import annotations

import socket

from port_harness import assert_all_ok
from port_harness import run_parties

_BIND = (
    "import os, socket\n"
    "port = int(os.environ['PORTS_PARTY_PORT'])\n"
    "socket.socket().bind(('127.0.0.1', port))\n"
    "print('bound', port)\n"
)


def test_a_port_taken_meanwhile_runs_the_parties_again_on_fresh_ports() -> None:
    # Python words the failure "[Errno 98] Address already in use", not "EADDRINUSE"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        results = run_parties({"party": ["-c", _BIND]}, {"PORTS_PARTY_PORT": str(port)}, 20)
    assert_all_ok(results)
    out = results["party"].output
    assert out.startswith("bound ") and int(out.split()[1]) != port
