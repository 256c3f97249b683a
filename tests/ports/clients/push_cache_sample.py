"""The decoder pushes its cache into the prompt's cache id 1, on ``aiokv.sync``.

Re-expresses llm_datadist's official sample ``push_cache_sample.py`` (repository
hicann/hixl, ``examples/python/llm_datadist/push_cache_sample.py``) as a clean-room
rewrite: none of its text is copied, but every llm_datadist call is kept with the same
arguments, in the same order and under the same conditions:

* both: ``LLMDataDist(role, cluster_id)``; ``LLMConfig()`` with ``device_id``,
  ``local_comm_res = ""`` (cache manager and remote access), ``transfer_backend`` (only
  for ``--transfer_backend hixl``), ``listen_ip_info``, ``local_comm_res`` again when
  given; ``generate_options()``; ``init``; then ``register_cache`` of two 3x10 float
  tensors (prompt: zeros, decoder: ones) with no keys;
* decoder: ``link_clusters`` to the prompt, ``push_cache`` of its batch slot 0 (row 0) to
  ``CacheKeyByIdAndIndex(cluster_id=PROMPT, cache_id=1, batch_index=0)`` — the literal
  id 1: llm_datadist numbers a process's caches from 1, so the prompt's only cache is 1;
  ``unlink_clusters`` (not forced);
* both: ``unregister_cache``, ``finalize``; the two processes meet at gloo
  ``dist.barrier()`` where the sample does.

Mechanical changes, each marked ``# port:``: the import; CPU tensors instead of
``.npu()`` (no ``torch.npu.set_device``); the ports (gloo's ``MASTER_PORT`` and both
listeners) handed in by the test harness instead of 29500/26000/26001; an assert on the
bytes the prompt received, where the sample only logs them.
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

import aiokv.sync as llm_datadist  # port: was `import llm_datadist` (its names below)

LLMDataDist = llm_datadist.LLMDataDist
LLMRole = llm_datadist.LLMRole
LLMConfig = llm_datadist.LLMConfig
CacheDesc = llm_datadist.CacheDesc
DataType = llm_datadist.DataType
CacheKeyByIdAndIndex = llm_datadist.CacheKeyByIdAndIndex
Placement = llm_datadist.Placement
LLMClusterInfo = llm_datadist.LLMClusterInfo
LLMStatusCode = llm_datadist.LLMStatusCode

TENSORS, BLOCKS, WIDTH = 2, 3, 10

log = logging.getLogger("push_cache")


def start(role: LLMRole, me: int, args: argparse.Namespace) -> LLMDataDist:
    join_group(me, args)
    datadist = LLMDataDist(role, me)
    config = LLMConfig()
    config.device_id = args.device_id
    config.local_comm_res = ""
    if args.transfer_backend == "hixl":
        config.transfer_backend = "hixl"
    elif args.transfer_backend:
        raise RuntimeError(f"transfer backend {args.transfer_backend!r} is not supported")
    config.listen_ip_info = f"{args.local_host_ip}:{LISTEN_PORT[me]}"  # port: harness port
    if args.local_comm_res:
        config.local_comm_res = args.local_comm_res
    datadist.init(config.generate_options())
    log.info("%s initialised as cluster %d", role, me)
    return datadist


def register(datadist: LLMDataDist, kv: list[torch.Tensor]) -> llm_datadist.Cache:
    desc = CacheDesc(
        num_tensors=TENSORS,
        shape=[BLOCKS, WIDTH],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    return datadist.cache_manager.register_cache(desc, [t.data_ptr() for t in kv])


def prompt(datadist: LLMDataDist) -> None:
    kv = [torch.full((BLOCKS, WIDTH), 0.0) for _ in range(TENSORS)]  # port: CPU
    cache = register(datadist, kv)
    dist.barrier()  # both registered
    dist.barrier()  # the decoder has pushed
    log.info("after the push: %s", kv)
    want = torch.zeros(BLOCKS, WIDTH)
    want[0] = 1.0  # batch slot 0 (dim 0 is the batch dim of this shape)
    for t in kv:  # port: check: the decoder's ones landed in slot 0 of cache id 1
        assert torch.equal(t, want), t
    dist.barrier()  # the decoder has unlinked
    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def decoder(datadist: LLMDataDist, args: argparse.Namespace) -> None:
    kv = [torch.full((BLOCKS, WIDTH), 1.0) for _ in range(TENSORS)]  # port: CPU
    cache = register(datadist, kv)
    dist.barrier()  # both registered

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT
    cluster.append_local_ip_info(args.local_host_ip, LISTEN_PORT[DECODER])  # port: harness
    cluster.append_remote_ip_info(args.remote_host_ip, LISTEN_PORT[PROMPT])  # port: harness
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError("link failed")

    datadist.cache_manager.push_cache(
        CacheKeyByIdAndIndex(cluster_id=PROMPT, cache_id=1, batch_index=0),
        cache,
        src_batch_index=0,
    )
    dist.barrier()  # the decoder has pushed

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT
    cluster.append_remote_ip_info(args.remote_host_ip, LISTEN_PORT[PROMPT])  # port: harness
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError("unlink failed")
    dist.barrier()  # the decoder has unlinked

    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def main() -> None:
    run_by_role(
        lambda args: prompt(start(LLMRole.PROMPT, PROMPT, args)),
        lambda args: decoder(start(LLMRole.DECODER, DECODER, args), args),
    )


if __name__ == "__main__":
    main()
