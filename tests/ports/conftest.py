"""The ``ports_env`` fixture of the ported-client tests (helpers: ``port_harness``)."""

from __future__ import annotations

import pytest
from port_harness import free_ports


@pytest.fixture
def ports_env() -> dict[str, str]:
    """Free ports for a two-party client: gloo's master and each party's listener."""
    master, prompt, decoder = free_ports(3)
    return {
        "PORTS_MASTER_PORT": str(master),
        "PORTS_PROMPT_PORT": str(prompt),
        "PORTS_DECODER_PORT": str(decoder),
    }
