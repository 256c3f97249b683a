"""The ``aiokv`` script's entry point: the command line when the ``cli`` extra is installed,
otherwise one line saying how to install it.

typer and rich (the ``aiokv[cli]`` extra) are needed by the command line only; the library
(``import aiokv``, ``aiokv.sync``, ``aiokv.metrics``, ``aiokv.testing``) never imports them.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["CLI_MODULES", "main"]

#: what ``aiokv.cli`` and the demo, info and bench reports import beyond the library
CLI_MODULES = ("typer", "click", "rich")


def main() -> None:
    """Run ``aiokv.cli``; without its dependencies print the install hint, exit 1."""
    missing = [m for m in CLI_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"aiokv: the command line needs {', '.join(missing)}: pip install 'aiokv[cli]'")
    from .cli import main as cli_main

    cli_main()
