"""A NIXL transfer that ends early (timed out, cancelled) writes nothing after its
operation returned or raised: NIXL frees a transfer in flight without stopping its bytes
(UCX over TCP moves them on), so the plane waits for its end before releasing it. Over
UCX's TCP (docs/nixl.md: ``UCX_TLS=tcp,self``), where a 256 MiB transfer is still moving
when it is cut short; in a subprocess, as UCX reads ``UCX_TLS`` when it loads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from aiokv.testing import requires_transport

needs_nixl = requires_transport("nixl")

_READ_PROGRAM = textwrap.dedent(
    """
    import asyncio, os, sys
    import numpy as np
    from aiokv._enums import LLMStatusCode as Code
    from aiokv._errors import LLMException
    from aiokv.transport import Grant, get_transport
    from aiokv.transport.nixl._descs import address_of

    N = 256 << 20

    class Regions:
        def __init__(self, buf):
            self.buf = buf
        async def grant_read(self, peer, meta):
            return Grant(Code.LLM_SUCCESS, [memoryview(self.buf)[: int(meta)]], lambda ok: None)
        async def grant_write(self, peer, meta, nbytes):
            return Grant(Code.LLM_SUCCESS, [memoryview(self.buf)[: int(meta)]], lambda ok: None)

    async def main():
        cls = get_transport("nixl")
        owner_buf = bytearray(b"\\xab") * N
        mine, small = bytearray(N), bytearray(4096)
        owner, me = cls(2, Regions(owner_buf)), cls(1, Regions(bytearray(1)))
        owner.register_memory(address_of(memoryview(owner_buf)), N)
        me.register_memory(address_of(memoryview(mine)), N)
        me.register_memory(address_of(memoryview(small)), 4096)
        link = await me.connect(*await owner.listen("127.0.0.1", 0), timeout=10)
        code = None
        try:
            await link.read(str(N).encode(), [memoryview(mine)], timeout=0.15)
        except LLMException as exc:
            code = exc.status_code
        view = np.frombuffer(mine, dtype=np.uint8)
        at_return = int(np.count_nonzero(view))
        # later, unrelated transfers on the same link (they progress the UCX worker)
        for _ in range(50):
            await link.read(b"4096", [memoryview(small)], timeout=5)
            await asyncio.sleep(0.01)
        later = int(np.count_nonzero(view))
        print(f"RESULT code={code} at_return={at_return} later={later} of={N}", flush=True)
        await me.aclose(); await owner.aclose()

    asyncio.run(main())
    sys.stdout.flush(); os._exit(0)
    """
)


def _run(program: str) -> str:
    env = dict(os.environ, UCX_TLS="tcp,self", UCX_NET_DEVICES="lo")
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=240
    )
    out = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert out, f"rc={done.returncode} {done.stdout[-2000:]} {done.stderr[-3000:]}"
    return out[0]


@needs_nixl
def test_a_timed_out_nixl_read_writes_nothing_after_it_raised() -> None:
    line = _run(_READ_PROGRAM)
    print(line)
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert fields["code"] != "None", "the read did not time out: make it bigger"
    # the read raised LLM_TIMEOUT: its destination must not change afterwards
    assert fields["later"] == fields["at_return"], line


_LEASE_PROGRAM = textwrap.dedent(
    """
    import asyncio, os, sys, time
    import torch
    from aiokv import BlocksCacheKey, CacheDesc, DataType, LLMException
    from aiokv.testing import linked_pair, make_config

    DESC = CacheDesc(2, [64, 1024, 512], DataType.DT_FLOAT16)  # 1 MiB blocks, 128 MiB

    def holding(d):
        return d.cache_manager._client.leases.holding()

    async def main():
        pc = make_config("nixl", pool=160 << 20, page_shift=16, sync_kv_timeout=10000)
        dc = make_config("nixl", pool=160 << 20, page_shift=16, sync_kv_timeout=100)
        async with linked_pair(pc, dc) as (p, d):
            key = BlocksCacheKey(1, 0)
            src = await p.cache_manager.allocate_blocks_cache(DESC, key)
            dst = await d.cache_manager.allocate_blocks_cache(DESC)
            for t in dst.tensors:
                t.fill_(7.0)
            await d.cache_manager.push_blocks(key, dst, [0], [0])  # by request: asks a lease
            for _ in range(500):
                if holding(d):
                    break
                await asyncio.sleep(0.01)
            assert holding(d) == 1, "no lease"
            addr = src.tensors[0].data_ptr()
            code = None
            # a leased WRITE of every block, cancelled while it moves (over TCP)
            t0 = time.monotonic()
            asked = p.statistics().links[2].served.granted
            task = asyncio.ensure_future(
                d.cache_manager.push_blocks(key, dst, list(range(64)), list(range(64))))
            await asyncio.sleep(0.02)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                code = "cancelled"
            except LLMException as exc:
                code = exc.status_code
            print("push ended after", time.monotonic() - t0, "requests served meanwhile:",
                  p.statistics().links[2].served.granted - asked, flush=True)
            # the granter takes the memory back: revocation returns, memory in the pool
            await p.cache_manager.deallocate_blocks_cache(src)
            again = await p.cache_manager.allocate_blocks_cache(DESC, key)
            same = again.tensors[0].data_ptr() == addr
            for t in again.tensors:
                t.zero_()
            at_return = sum(int(torch.count_nonzero(t)) for t in again.tensors)
            # later transfers of the holder's (they progress its UCX worker); block 63 only
            for _ in range(30):
                await d.cache_manager.pull_blocks(key, dst, [63], [63])
                await asyncio.sleep(0.01)
            later = sum(int(torch.count_nonzero(t[:63])) for t in again.tensors)
            print(f"RESULT code={code} same_memory={same} at_return={at_return} later={later}",
                  flush=True)

    asyncio.run(main())
    sys.stdout.flush(); os._exit(0)
    """
)


@needs_nixl
def test_a_new_cache_is_never_written_by_a_revoked_leases_push() -> None:
    line = _run(_LEASE_PROGRAM)
    print(line)
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert fields["code"] != "None", "the leased push was not cut short"
    assert fields["same_memory"] == "True"
    # the new cache's blocks 0..62 were zeroed after the revocation and never written since
    assert fields["later"] == "0", line


_UNSTOPPED_PROGRAM = textwrap.dedent(
    """
    import asyncio, os, sys
    from aiokv import BlocksCacheKey, CacheDesc, DataType, LLMException
    from aiokv.testing import linked_pair, make_config
    import aiokv.transport.nixl._plane as plane

    plane.SETTLE_S = 0.01  # a transfer still moving 10 ms after it was cut short: unstopped
    DESC = CacheDesc(2, [128, 1024, 512], DataType.DT_FLOAT16)  # 1 MiB blocks, 256 MiB

    async def main():
        pc = make_config("nixl", pool=300 << 20, page_shift=16, sync_kv_timeout=10000)
        dc = make_config("nixl", pool=600 << 20, page_shift=16, sync_kv_timeout=100)
        async with linked_pair(pc, dc) as (p, d):
            key = BlocksCacheKey(1, 0)
            await p.cache_manager.allocate_blocks_cache(DESC, key)
            dst = await d.cache_manager.allocate_blocks_cache(DESC)
            lo = dst.tensors[0].data_ptr()
            code = None
            try:  # cut short by its 100 ms timeout while it moves (over TCP)
                await d.cache_manager.pull_blocks(key, dst, list(range(128)), list(range(128)))
            except LLMException as exc:
                code = exc.status_code.name
            await d.cache_manager.deallocate_blocks_cache(dst)
            again = await d.cache_manager.allocate_blocks_cache(DESC)
            at = again.tensors[0].data_ptr()
            overlap = at < lo + DESC.size and lo < at + DESC.size
            kept = getattr(d.statistics().caches, "quarantined_bytes", None)
            print(f"RESULT code={code} overlap={overlap} kept={kept}", flush=True)
        sys.stdout.flush(); os._exit(0)

    asyncio.run(main())
    """
)


@needs_nixl
def test_memory_of_a_transfer_that_could_not_be_stopped_is_never_handed_out_again() -> None:
    """A NIXL transfer cut short (its timeout) that still does not end when released:
    NIXL cannot stop its bytes, so they may land in the destination after the pull
    raised. That destination's pool memory must never go to another cache: before, a
    ``deallocate_blocks_cache`` then an allocation of the same size got the same memory,
    for bytes of the old pull to land in later (docs/design.md, "Ending an operation").
    It stays allocated for good and is counted in ``statistics().caches``."""
    line = _run(_UNSTOPPED_PROGRAM)
    print(line)
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert fields["code"] != "None", "the pull was not cut short: make it bigger"
    assert fields["overlap"] == "False", line
    assert int(fields["kept"]) >= 256 << 20, line


_UNHEARD_GRANT_PROGRAM = textwrap.dedent(
    """
    import asyncio, os, sys
    from aiokv import BlocksCacheKey, CacheDesc, DataType, LLMException
    from aiokv.testing import linked_pair, make_config
    import aiokv.transport.nixl._plane as plane

    plane.SETTLE_S = 0.01  # a transfer still moving 10 ms after it was cut short: unstopped
    DESC = CacheDesc(2, [128, 1024, 512], DataType.DT_FLOAT16)  # 1 MiB blocks, 256 MiB

    async def main():
        pc = make_config("nixl", pool=600 << 20, page_shift=16, sync_kv_timeout=10000)
        dc = make_config("nixl", pool=300 << 20, page_shift=16, sync_kv_timeout=100)
        async with linked_pair(pc, dc) as (p, d):
            key = BlocksCacheKey(1, 0)
            dst = await p.cache_manager.allocate_blocks_cache(DESC, key)
            src = await d.cache_manager.allocate_blocks_cache(DESC)
            lo = dst.tensors[0].data_ptr()
            code = None
            try:  # a NIXL WRITE into p's cache, cut short by d's 100 ms timeout
                await d.cache_manager.push_blocks(key, src, list(range(128)), list(range(128)))
            except LLMException as exc:
                code = exc.status_code.name
            for _ in range(1000):  # p notices the link's end: the grant is released
                if p.statistics().caches.pins == 0:
                    break
                await asyncio.sleep(0.01)
            await p.cache_manager.deallocate_blocks_cache(dst)
            again = await p.cache_manager.allocate_blocks_cache(DESC)
            at = again.tensors[0].data_ptr()
            overlap = at < lo + DESC.size and lo < at + DESC.size
            kept = p.statistics().caches.quarantined_bytes
            pool = p.statistics().host_pool or p.statistics().device_pool
            pool_kept = getattr(pool, "quarantined", None)
            print(f"RESULT code={code} overlap={overlap} kept={kept} pool_kept={pool_kept}",
                  flush=True)
        sys.stdout.flush(); os._exit(0)

    asyncio.run(main())
    """
)


@needs_nixl
def test_granted_memory_of_a_write_that_could_not_be_stopped_is_never_handed_out_again() -> None:
    """A granter relies on a cache it deallocates never taking bytes of an old transfer
    into the next cache. A peer's NIXL WRITE into its cache that the peer could not stop
    (the peer broke the link; its bytes may still land) ended the grant unheard: the
    granter's memory must stay out of the pool, counted in ``statistics().caches`` and
    the pool's stats. Before, the next allocation got the same memory."""
    line = _run(_UNHEARD_GRANT_PROGRAM)
    print(line)
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert fields["code"] != "None", "the push was not cut short: make it bigger"
    assert fields["overlap"] == "False", line
    assert int(fields["kept"]) >= 256 << 20, line
    assert fields["pool_kept"] not in ("None", "0"), line
