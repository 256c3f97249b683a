"""What every fuzz test shares: the seed.

CI runs a fixed seed (reproducible); ``AIOKV_FUZZ_SEED=random`` explores, and any
integer replays a failure (every assertion of a fuzz test names its seed).
"""

from __future__ import annotations

import os
import random

DEFAULT_SEED = 20261123


def fuzz_seed() -> int:
    """The seed of this run: ``AIOKV_FUZZ_SEED`` (an integer, or ``random``), else the
    fixed CI seed."""
    raw = os.environ.get("AIOKV_FUZZ_SEED", str(DEFAULT_SEED))
    return random.randrange(2**32) if raw == "random" else int(raw)
