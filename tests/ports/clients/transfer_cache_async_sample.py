"""Layer-wise ``transfer_cache_async`` from prompt to decoder, on ``aiokv.sync``.

Re-expresses llm_datadist's official sample ``transfer_cache_async_sample.py``
(repository hicann/hixl, ``examples/python/llm_datadist/transfer_cache_async_sample.py``)
as a clean-room rewrite: none of its text is copied, but every llm_datadist call is
kept with the same arguments, in the same order and under the same conditions:

* both: ``LLMDataDist(role, cluster_id)``; ``LLMConfig()`` with ``device_id``,
  ``transfer_backend`` (only for ``--transfer_backend hixl``), ``listen_ip_info``,
  ``enable_cache_manager``, ``enable_remote_cache_accessible``, ``local_comm_res`` (only
  when given); ``generate_options()``; ``init``; then ``register_blocks_cache`` of two
  3-block tensors under ``BlocksCacheKey(own cluster, 0)``;
* prompt: ``link_clusters`` to the decoder, ``transfer_cache_async`` of layer 0 into the
  decoder's blocks cache with a synchronizer that always answers ``True``,
  ``get_results()``;
* both: forced ``unlink_clusters``, ``unregister_cache``, ``finalize``; the two
  processes meet at gloo ``dist.barrier()`` where the sample does.

Mechanical changes, each marked ``# port:``: the import; CPU tensors instead of
``.npu()`` (no ``torch.npu.set_device``); the ports (gloo's ``MASTER_PORT`` and both
listeners) handed in by the test harness instead of 29500/26000/26001; an assert on the
bytes the decoder received, where the sample only logs them.
"""

import argparse
import logging

import torch
import torch.distributed as dist
from by_role import DECODER  # port: set-up
from by_role import LISTEN_PORT  # port: set-up
from by_role import PROMPT  # port: set-up
from by_role import join_group  # port: set-up
from by_role import run_by_role  # port: set-up

from aiokv.sync import BlocksCacheKey  # port: was `from llm_datadist import (`
from aiokv.sync import Cache  # port: was `from llm_datadist import (`
from aiokv.sync import CacheDesc  # port: was `from llm_datadist import (`
from aiokv.sync import DataType  # port: was `from llm_datadist import (`
from aiokv.sync import LayerSynchronizer  # port: was `from llm_datadist import (`
from aiokv.sync import LLMClusterInfo  # port: was `from llm_datadist import (`
from aiokv.sync import LLMConfig  # port: was `from llm_datadist import (`
from aiokv.sync import LLMDataDist  # port: was `from llm_datadist import (`
from aiokv.sync import LLMRole  # port: was `from llm_datadist import (`
from aiokv.sync import LLMStatusCode  # port: was `from llm_datadist import (`
from aiokv.sync import Placement  # port: was `from llm_datadist import (`
from aiokv.sync import TransferWithCacheKeyConfig  # port: was `from llm_datadist import (`

BLOCKS, WIDTH = 3, 10  # each registered tensor: BLOCKS blocks of WIDTH floats

log = logging.getLogger("transfer_cache_async")


class AlwaysReady(LayerSynchronizer):
    """Every layer is complete at once (there is no model producing it here)."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def start(role: LLMRole, me: int, args: argparse.Namespace) -> LLMDataDist:
    join_group(me, args)
    datadist = LLMDataDist(role, me)
    config = LLMConfig()
    config.device_id = args.device_id
    if args.transfer_backend == "hixl":
        config.transfer_backend = "hixl"
    elif args.transfer_backend:
        raise RuntimeError(f"transfer backend {args.transfer_backend!r} is not supported")
    config.listen_ip_info = f"{args.local_host_ip}:{LISTEN_PORT[me]}"  # port: harness port
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    if args.local_comm_res:
        config.local_comm_res = args.local_comm_res
    datadist.init(config.generate_options())
    log.info("%s initialised as cluster %d", role, me)
    return datadist


def register(datadist: LLMDataDist, me: int, kv: list[torch.Tensor]) -> Cache:
    """``kv`` as this cluster's blocks cache; the caller keeps ``kv`` alive."""
    desc = CacheDesc(
        num_tensors=2,
        shape=[BLOCKS, WIDTH],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    cache = datadist.cache_manager.register_blocks_cache(
        desc, [t.data_ptr() for t in kv], BlocksCacheKey(me, 0)
    )
    return cache


def unlink_from(datadist: LLMDataDist, peer: int) -> None:
    peer_info = LLMClusterInfo()
    peer_info.remote_cluster_id = peer
    code, _ = datadist.unlink_clusters([peer_info], 5000, force=True)
    if code != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink from cluster {peer} failed: {code}")


def prompt(datadist: LLMDataDist, args: argparse.Namespace) -> None:
    kv = [torch.full((BLOCKS, WIDTH), 1.0) for _ in range(2)]  # port: CPU, was .npu()
    cache = register(datadist, PROMPT, kv)
    dist.barrier()  # both registered

    peer_info = LLMClusterInfo()
    peer_info.remote_cluster_id = DECODER
    peer_info.append_local_ip_info(args.local_host_ip, LISTEN_PORT[PROMPT])  # port: harness
    peer_info.append_remote_ip_info(args.remote_host_ip, LISTEN_PORT[DECODER])  # port: harness
    code, _ = datadist.link_clusters([peer_info], 5000)
    if code != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link to the decoder failed: {code}")

    target = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0), range(0, 1), range(0, 1))
    task = datadist.cache_manager.transfer_cache_async(cache, AlwaysReady(), [target])
    task.get_results()
    dist.barrier()  # transfer done

    unlink_from(datadist, DECODER)
    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def decoder(datadist: LLMDataDist, args: argparse.Namespace) -> None:
    kv = [torch.full((BLOCKS, WIDTH), 0.0) for _ in range(2)]  # port: CPU, was .npu()
    cache = register(datadist, DECODER, kv)
    dist.barrier()  # both registered
    dist.barrier()  # transfer done
    log.info("received: %s", kv)
    for t in kv:  # port: check
        assert torch.equal(t, torch.ones(BLOCKS, WIDTH)), t

    unlink_from(datadist, PROMPT)
    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def main() -> None:
    run_by_role(
        lambda args: prompt(start(LLMRole.PROMPT, PROMPT, args), args),
        lambda args: decoder(start(LLMRole.DECODER, DECODER, args), args),
    )


if __name__ == "__main__":
    main()
