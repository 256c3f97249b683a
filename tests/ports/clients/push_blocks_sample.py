"""The decoder pushes blocks into the prompt's blocks cache, on ``aiokv.sync``.

Re-expresses llm_datadist's official sample ``push_blocks_sample.py`` (repository
hicann/hixl, ``examples/python/llm_datadist/push_blocks_sample.py``) as a clean-room
rewrite: none of its text is copied, but every llm_datadist call is kept with the same
arguments, in the same order and under the same conditions:

* both: ``LLMDataDist(role, cluster_id)``; ``LLMConfig()`` with ``device_id``,
  ``local_comm_res = ""`` (which turns on the cache manager and remote access),
  ``transfer_backend`` (only for ``--transfer_backend hixl``), ``listen_ip_info``,
  ``local_comm_res`` again when given; ``generate_options()``; ``init``; then
  ``register_blocks_cache`` of two 3-block tensors under ``BlocksCacheKey(own cluster, 0)``
  (prompt: ones, decoder: zeros);
* decoder: ``link_clusters`` to the prompt, ``push_blocks`` of its blocks 0 and 1 into
  the prompt's blocks 0 and 2;
* both: forced ``unlink_clusters``, ``unregister_cache``, ``finalize``; the two
  processes meet at gloo ``dist.barrier()`` where the sample does.

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

from aiokv.sync import (
    BlocksCacheKey,  # port: was `from llm_datadist import (`
    Cache,  # port: was `from llm_datadist import (`
    CacheDesc,  # port: was `from llm_datadist import (`
    DataType,  # port: was `from llm_datadist import (`
    LLMClusterInfo,  # port: was `from llm_datadist import (`
    LLMConfig,  # port: was `from llm_datadist import (`
    LLMDataDist,  # port: was `from llm_datadist import (`
    LLMRole,  # port: was `from llm_datadist import (`
    LLMStatusCode,  # port: was `from llm_datadist import (`
    Placement,  # port: was `from llm_datadist import (`
)

PROMPT, DECODER = 0, 1  # cluster ids, also the gloo ranks
BLOCKS, WIDTH = 3, 10  # each registered tensor: BLOCKS blocks of WIDTH floats
GLOO_PORT = os.environ["PORTS_MASTER_PORT"]  # port: harness port, was 29500
LISTEN_PORT = {
    PROMPT: int(os.environ["PORTS_PROMPT_PORT"]),  # port: harness port, was 26000
    DECODER: int(os.environ["PORTS_DECODER_PORT"]),  # port: harness port, was 26001
}

log = logging.getLogger("push_blocks")


def join_group(rank: int, args: argparse.Namespace) -> None:
    os.environ["MASTER_ADDR"] = min(args.local_host_ip, args.remote_host_ip)
    os.environ["MASTER_PORT"] = GLOO_PORT  # port: harness port
    dist.init_process_group(
        backend="gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )


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
    dist.barrier()  # the decoder has pushed
    log.info("after the push: %s", kv)
    for t in kv:  # port: check: blocks 0 and 2 now hold the decoder's zeros
        assert torch.equal(t, torch.tensor([[0.0] * WIDTH, [1.0] * WIDTH, [0.0] * WIDTH])), t

    unlink_from(datadist, DECODER)
    datadist.cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def decoder(datadist: LLMDataDist, args: argparse.Namespace) -> None:
    kv = [torch.full((BLOCKS, WIDTH), 0.0) for _ in range(2)]  # port: CPU, was .npu()
    cache = register(datadist, DECODER, kv)
    dist.barrier()  # both registered

    peer_info = LLMClusterInfo()
    peer_info.remote_cluster_id = PROMPT
    peer_info.append_local_ip_info(args.local_host_ip, LISTEN_PORT[DECODER])  # port: harness
    peer_info.append_remote_ip_info(args.remote_host_ip, LISTEN_PORT[PROMPT])  # port: harness
    code, _ = datadist.link_clusters([peer_info], 5000)
    if code != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link to the prompt failed: {code}")

    datadist.cache_manager.push_blocks(
        BlocksCacheKey(PROMPT, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2]
    )
    dist.barrier()  # the decoder has pushed

    unlink_from(datadist, PROMPT)
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
    parser.add_argument("--transfer_backend", default="", help="'hixl', or empty for adxl")
    args = parser.parse_args()
    log.info("Sample start, role %s, device %d", args.role, args.device_id)
    # port: CPU, no torch.npu.set_device(args.device_id)
    if args.role == "p":
        prompt(start(LLMRole.PROMPT, PROMPT, args), args)
    else:
        decoder(start(LLMRole.DECODER, DECODER, args), args)
    log.info("Sample end")


if __name__ == "__main__":
    main()
