"""The system calls of one-block pulls: run under ``strace -c`` to count them.

``strace -f -c -e trace=recvfrom,recvmsg,readv,sendmsg,epoll_pwait -o OUT \\
PYTHONPATH=. python scripts/pull_syscalls.py PULLS [BLOCK]`` (repository root): a
prompt and a decoder in this process, both engines inline on one uvloop loop, linked
over TCP; ``PULLS`` one-block pulls of a ``BLOCK``-byte block (default 4096) of a
one-tensor blocks cache, one after another. The same with ``PULLS`` 0 counts what
starting and stopping cost; the difference over ``PULLS`` is what one pull costs
both sides together (``errors`` of ``recvfrom``: reads that met ``EAGAIN``).

docs/benchmarks.md ("Reading ahead") reads these counts.
"""

from __future__ import annotations

import sys

import uvloop

from aiokv import BlocksCacheKey
from aiokv import CacheDesc
from aiokv import DataType
from aiokv.testing import linked_pair
from aiokv.testing import make_config


async def _pulls(n: int, block: int) -> None:
    config = make_config("tcp", engine_thread=False)
    async with linked_pair(config) as (prompt, decoder):
        desc = CacheDesc(1, [4, block], DataType.DT_UINT8)
        key = BlocksCacheKey(1, 0)
        await prompt.cache_manager.allocate_blocks_cache(desc, key)
        dst = await decoder.cache_manager.allocate_blocks_cache(desc)
        for _ in range(n):
            await decoder.cache_manager.pull_blocks(key, dst, [1], [2])


if __name__ == "__main__":
    uvloop.run(_pulls(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4096))
