"""Pull, switch roles both ways, push back: on the async ``aiokv`` API.

Re-expresses llm_datadist's official sample ``switch_role_sample.py`` (repository
hicann/hixl, ``examples/python/llm_datadist/switch_role_sample.py``) as a clean-room
rewrite: none of its text is copied, but every llm_datadist call is kept with the same
arguments, in the same order and under the same conditions:

* both: ``LLMDataDist(role, cluster_id)``; ``LLMConfig()`` with ``device_id``,
  ``local_comm_res = ""`` (which turns on the cache manager and remote access) and, on
  the prompt only, ``listen_ip_info``; ``generate_options()``; ``init``; then
  ``register_blocks_cache`` of two 3-block tensors under ``BlocksCacheKey(own cluster, 0)``
  (prompt: ones, decoder: zeros);
* decoder: ``link_clusters`` to the prompt, ``pull_blocks`` of the prompt's blocks 0 and 1
  into its blocks 0 and 2, ``unlink_clusters`` (not forced, remote address given); then
  ``switch_role(PROMPT, options)`` with a fresh ``LLMConfig`` carrying only
  ``listen_ip_info``;
* prompt: ``switch_role(DECODER)``, then ``link_clusters`` to the former decoder;
* former decoder: ``push_blocks`` of its blocks 0..2 into the same blocks of the former
  prompt, with ``src_layer_range``/``dst_layer_range`` ``range(0, 2)`` and
  ``tensor_num_per_layer=1``;
* both: forced ``unlink_clusters``, ``unregister_cache``, ``finalize``; the two
  processes meet at gloo ``dist.barrier()`` where the sample does.

Mechanical changes, each marked ``# port:``: ``from aiokv import`` instead of
``from llm_datadist import``, ``await`` before each llm_datadist call that the async API
makes a coroutine (``async def`` on the functions holding them, ``asyncio.run`` at the
``__main__`` call sites); CPU tensors instead of ``.npu()`` (no ``torch.npu.set_device``);
the ports handed in by the test harness (gloo's ``MASTER_PORT`` instead of 29500; the
sample's two hosts both listen at 26000, here one host has a port per party); asserts on
the bytes received, where the sample only logs them.
"""

import argparse
import asyncio  # port: async API
import logging

import torch
import torch.distributed as dist
from by_role import DECODER  # port: set-up
from by_role import LISTEN_PORT  # port: set-up
from by_role import PROMPT  # port: set-up
from by_role import join_group  # port: set-up
from by_role import run_by_role  # port: set-up

from aiokv import BlocksCacheKey  # port: was `from llm_datadist import (`
from aiokv import Cache  # port: was `from llm_datadist import (`
from aiokv import CacheDesc  # port: was `from llm_datadist import (`
from aiokv import DataType  # port: was `from llm_datadist import (`
from aiokv import LLMClusterInfo  # port: was `from llm_datadist import (`
from aiokv import LLMConfig  # port: was `from llm_datadist import (`
from aiokv import LLMDataDist  # port: was `from llm_datadist import (`
from aiokv import LLMRole  # port: was `from llm_datadist import (`
from aiokv import LLMStatusCode  # port: was `from llm_datadist import (`
from aiokv import Placement  # port: was `from llm_datadist import (`

BLOCKS, WIDTH = 3, 10  # each registered tensor: BLOCKS blocks of WIDTH floats

log = logging.getLogger("switch_role")


def blocks_of(*values: float) -> torch.Tensor:
    """A tensor whose block ``i`` is filled with ``values[i]``."""
    return torch.tensor([[v] * WIDTH for v in values])


async def start(role: LLMRole, me: int, args: argparse.Namespace) -> LLMDataDist:  # port: async
    join_group(me, args)
    datadist = LLMDataDist(role, me)
    config = LLMConfig()
    config.device_id = args.device_id
    config.local_comm_res = ""
    if role == LLMRole.PROMPT:
        config.listen_ip_info = f"{args.local_host_ip}:{LISTEN_PORT[me]}"  # port: harness port
    await datadist.init(config.generate_options())  # port: await
    log.info("%s initialised as cluster %d", role, me)
    return datadist


async def register(datadist: LLMDataDist, me: int, kv: list[torch.Tensor]) -> Cache:  # port: async
    """``kv`` as this cluster's blocks cache; the caller keeps ``kv`` alive."""
    desc = CacheDesc(
        num_tensors=2,
        shape=[BLOCKS, WIDTH],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    cache = await datadist.cache_manager.register_blocks_cache(  # port: await
        desc, [t.data_ptr() for t in kv], BlocksCacheKey(me, 0)
    )
    return cache


async def link_to(  # port: async
    datadist: LLMDataDist, me: int, peer: int, args: argparse.Namespace
) -> None:
    peer_info = LLMClusterInfo()
    peer_info.remote_cluster_id = peer
    peer_info.append_local_ip_info(args.local_host_ip, LISTEN_PORT[me])  # port: harness port
    peer_info.append_remote_ip_info(args.remote_host_ip, LISTEN_PORT[peer])  # port: harness
    code, _ = await datadist.link_clusters([peer_info], 5000)  # port: await
    if code != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link to cluster {peer} failed: {code}")


async def close(datadist: LLMDataDist, cache: Cache, peer: int) -> None:  # port: async
    """Forced unlink from ``peer``, then unregister ``cache`` and finalize."""
    peer_info = LLMClusterInfo()
    peer_info.remote_cluster_id = peer
    code, _ = await datadist.unlink_clusters([peer_info], 5000, force=True)  # port: await
    if code != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink from cluster {peer} failed: {code}")
    await datadist.cache_manager.unregister_cache(cache.cache_id)  # port: await
    await datadist.finalize()  # port: await


async def prompt(datadist: LLMDataDist, args: argparse.Namespace) -> None:  # port: async
    kv = [torch.full((BLOCKS, WIDTH), 1.0) for _ in range(2)]  # port: CPU, was .npu()
    cache = await register(datadist, PROMPT, kv)  # port: await
    dist.barrier()  # both registered
    dist.barrier()  # the decoder has pulled and unlinked

    await datadist.switch_role(LLMRole.DECODER)  # port: await
    dist.barrier()  # this side no longer listens
    dist.barrier()  # the other side listens now

    await link_to(datadist, PROMPT, DECODER, args)  # port: await
    dist.barrier()  # linked back
    dist.barrier()  # the other side has pushed
    log.info("after the push back: %s", kv)
    for t in kv:  # port: check: the decoder's blocks 0..2 are now here
        assert torch.equal(t, blocks_of(1.0, 0.0, 1.0)), t

    await close(datadist, cache, DECODER)  # port: await


async def decoder(datadist: LLMDataDist, args: argparse.Namespace) -> None:  # port: async
    kv = [torch.full((BLOCKS, WIDTH), 0.0) for _ in range(2)]  # port: CPU, was .npu()
    cache = await register(datadist, DECODER, kv)  # port: await
    dist.barrier()  # both registered

    await link_to(datadist, DECODER, PROMPT, args)  # port: await
    await datadist.cache_manager.pull_blocks(  # port: await
        BlocksCacheKey(PROMPT, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2]
    )
    log.info("after the pull: %s", kv)
    for t in kv:  # port: check: the prompt's ones landed in blocks 0 and 2
        assert torch.equal(t, blocks_of(1.0, 0.0, 1.0)), t

    peer_info = LLMClusterInfo()
    peer_info.remote_cluster_id = PROMPT
    peer_info.append_remote_ip_info(args.remote_host_ip, LISTEN_PORT[PROMPT])  # port: harness
    code, _ = await datadist.unlink_clusters([peer_info], 5000)  # port: await
    if code != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink from the prompt failed: {code}")
    dist.barrier()  # the decoder has pulled and unlinked
    dist.barrier()  # the other side no longer listens

    config = LLMConfig()
    config.listen_ip_info = f"{args.local_host_ip}:{LISTEN_PORT[DECODER]}"  # port: harness
    await datadist.switch_role(LLMRole.PROMPT, config.generate_options())  # port: await
    dist.barrier()  # this side listens now
    dist.barrier()  # linked back

    await datadist.cache_manager.push_blocks(  # port: await
        BlocksCacheKey(PROMPT, 0),
        cache,
        src_blocks=[0, 1, 2],
        dst_blocks=[0, 1, 2],
        src_layer_range=range(0, 2),
        dst_layer_range=range(0, 2),
        tensor_num_per_layer=1,
    )
    dist.barrier()  # the other side has pushed

    await close(datadist, cache, PROMPT)  # port: await


def run_prompt(args: argparse.Namespace) -> None:
    datadist = asyncio.run(start(LLMRole.PROMPT, PROMPT, args))  # port: asyncio.run
    asyncio.run(prompt(datadist, args))  # port: asyncio.run


def run_decoder(args: argparse.Namespace) -> None:
    datadist = asyncio.run(start(LLMRole.DECODER, DECODER, args))  # port: asyncio.run
    asyncio.run(decoder(datadist, args))  # port: asyncio.run


def main() -> None:
    run_by_role(run_prompt, run_decoder, backend_options=False)


if __name__ == "__main__":
    main()
