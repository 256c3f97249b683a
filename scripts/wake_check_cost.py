"""What the socket-error check at each read wake-up costs a one-block pull.

``PYTHONPATH=. python scripts/wake_check_cost.py [ROUNDS]`` (repository root): a prompt
and a decoder in this process, both engines inline on one uvloop loop, linked over TCP;
rounds of 1,000 one-block pulls (4 KiB), the check (``SockIO._errors_end_watch``: read
``SO_ERROR`` when uvloop wakes a reader) on and off in turn on both ends of the link;
prints the process CPU time per pull of each round and the median of each setting.

docs/benchmarks.md ("A socket error under uvloop") reads these figures.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import uvloop

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv.testing import linked_pair
from aiokv.testing import make_config
from aiokv.transport.tcp._io import SockIO


async def _rounds(rounds: int) -> None:
    config = make_config("tcp", engine_thread=False)
    async with linked_pair(config) as (prompt, decoder):
        desc = CacheDesc(1, [4, 4096], DataType.DT_UINT8)
        key = BlocksCacheKey(1, 0)
        await prompt.cache_manager.allocate_blocks_cache(desc, key)
        dst = await decoder.cache_manager.allocate_blocks_cache(desc)
        ends = [o for o in gc.get_objects() if isinstance(o, SockIO)]
        assert len(ends) == 2, ends  # the link's two sockets
        for _ in range(300):
            await decoder.cache_manager.pull_blocks(key, dst, [1], [2])
        cpu: dict[bool, list[float]] = {True: [], False: []}
        for r in range(2 * rounds):
            check = r % 2 == 0
            for end in ends:
                end._errors_end_watch = check
            t = time.process_time()
            for _ in range(1000):
                await decoder.cache_manager.pull_blocks(key, dst, [1], [2])
            cpu[check].append((time.process_time() - t) * 1e3)  # ms per 1,000 = µs per pull
        for check, us in cpu.items():
            print(
                f"check {'on ' if check else 'off'}: µs per pull {[round(x) for x in us]}, "
                f"median {statistics.median(us):.0f}"
            )


if __name__ == "__main__":
    uvloop.run(_rounds(int(sys.argv[1]) if len(sys.argv) > 1 else 6))
