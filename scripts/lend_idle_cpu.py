"""The CPU an idle owner spends while it lends memory over NIXL (a lease held).

``PYTHONPATH=<checkout> python scripts/lend_idle_cpu.py [SECONDS]`` (default 10): this
process is a decoder linked to a spawned prompt peer over NIXL with shared memory (the
bench's ``shm`` UCX setting). Prints the CPU seconds (user + system, from
``/proc/PID/stat``) the peer spends idle for ``SECONDS``, first linked with nothing
lent, then after 20 pulls of one 4 KiB block (the second asks for a lease, which the
peer then lends until the end), and this process's own in the second span. An owner
that lends memory progresses UCX the whole time (UCX's TCP transport moves one-sided
transfers only while the target progresses); this is what that costs. Run it with
``PYTHONPATH`` set to two checkouts in turn to compare them.
"""

from __future__ import annotations

import asyncio
import os
import sys

import uvloop

from aiokv import BlocksCacheKey
from aiokv import LLMClusterInfo
from aiokv import LLMDataDist
from aiokv import LLMRole
from aiokv._bench._harness import DECODER_ID
from aiokv._bench._harness import PEER_ID
from aiokv._bench._harness import PromptPeer
from aiokv._bench._harness import apply_env
from aiokv._bench._harness import participant_config
from aiokv._bench._harness import spawned
from aiokv._bench.nixl import SETTINGS
from aiokv._bench.nixl import _desc


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main(seconds: float) -> None:
    """Print the peer's idle CPU seconds without and with memory lent."""
    env = SETTINGS["shm"]
    async with spawned(lambda: PromptPeer(64 << 20, backend="nixl", env=env)) as peer:
        pid = peer.proc.pid
        assert pid is not None  # started
        config = participant_config(64 << 20, backend="nixl")
        async with LLMDataDist(LLMRole.DECODER, DECODER_ID, config) as dd:
            where = [("127.0.0.1", peer.port)]
            info = LLMClusterInfo(PEER_ID, local_ip_info=[("127.0.0.1", 0)], remote_ip_info=where)
            await dd.link_clusters([info])
            await asyncio.sleep(1)
            start = cpu_s(pid)
            await asyncio.sleep(seconds)
            idle = cpu_s(pid) - start
            print(f"peer idle, linked, nothing lent: {idle:.3f} s CPU in {seconds:g} s")
            cm, key = dd.cache_manager, BlocksCacheKey(PEER_ID, 0)
            await peer.cache(_desc(4096, 2))
            dst = await cm.allocate_blocks_cache(_desc(4096, 2))
            for _ in range(20):
                await cm.pull_blocks(key, dst, [1], [0])
            await asyncio.sleep(1)
            start, mine = cpu_s(pid), cpu_s(os.getpid())
            await asyncio.sleep(seconds)
            print(
                f"peer idle, a lease lent: {cpu_s(pid) - start:.3f} s CPU in {seconds:g} s "
                f"(this process: {cpu_s(os.getpid()) - mine:.3f} s)",
                flush=True,
            )
            await cm.deallocate_blocks_cache(dst)


if __name__ == "__main__":
    apply_env(SETTINGS["shm"])
    uvloop.run(main(float(sys.argv[1]) if len(sys.argv) > 1 else 10.0))
