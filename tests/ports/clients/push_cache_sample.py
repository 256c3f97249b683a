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
import datetime
import logging
import os

import torch
import torch.distributed as dist

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
PROMPT, DECODER = 0, 1  # cluster ids, also the gloo ranks
GLOO_PORT = os.environ["PORTS_MASTER_PORT"]  # port: harness port, was 29500
LISTEN_PORT = {
    PROMPT: int(os.environ["PORTS_PROMPT_PORT"]),  # port: harness port, was 26000
    DECODER: int(os.environ["PORTS_DECODER_PORT"]),  # port: harness port, was 26001
}

log = logging.getLogger("push_cache")


def start(role: LLMRole, me: int, args: argparse.Namespace) -> LLMDataDist:
    os.environ["MASTER_ADDR"] = min(args.local_host_ip, args.remote_host_ip)
    os.environ["MASTER_PORT"] = GLOO_PORT  # port: harness port
    dist.init_process_group(
        backend="gloo", rank=me, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
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
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)
    parser = argparse.ArgumentParser()
    parser.add_argument("--device_id", type=int, default=0, choices=range(8))
    parser.add_argument("--role", choices=["p", "d"], required=True)
    parser.add_argument("--local_host_ip", required=True)
    parser.add_argument("--remote_host_ip", required=True)
    parser.add_argument("--local_comm_res")
    parser.add_argument("--transfer_backend", default="")
    args = parser.parse_args()
    log.info("Sample start, role %s, device %d", args.role, args.device_id)
    # port: CPU, no torch.npu.set_device(args.device_id)
    if args.role == "p":
        prompt(start(LLMRole.PROMPT, PROMPT, args))
    else:
        decoder(start(LLMRole.DECODER, DECODER, args), args)
    log.info("Sample end")


if __name__ == "__main__":
    main()
