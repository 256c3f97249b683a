"""Two-sided ``link`` over a rank table, ``pull_blocks``, swap out and in: on ``aiokv.sync``.

Re-expresses llm_datadist's official sample ``pull_blocks_sample.py`` (repository
hicann/hixl, ``examples/python/llm_datadist/pull_blocks_sample.py``) as a clean-room
rewrite: none of its text is copied, but every llm_datadist call is kept with the same
arguments, in the same order and under the same conditions:

* both: ``LLMDataDist(role, cluster_id)`` (cluster 1 is the prompt, 2 the decoder);
  ``LLMConfig()`` with ``device_id``, ``enable_cache_manager = True`` and, only when the
  memory pool is enabled (the sample runs without it), ``mem_pool_cfg``;
  ``generate_options()``; ``init``; then ``register_blocks_cache`` of one 2-block tensor
  (the prompt under ``BlocksCacheKey(1, 0)``, the decoder without a key);
* both: ``link("link", {1: 0, 2: 1}, rank_table_json)`` over a two-server HCCL rank
  table, then ``query_register_mem_status(comm_id)`` once a second until ``OK`` (a
  ``FAILED`` ends the run);
* decoder: ``pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks=[0, 1],
  dst_blocks=[0, 1])``; a host ``Cache.create_cpu_cache`` of the same shape;
  ``swap_blocks(cache, cpu_cache, {0: 0, 1: 1})`` and back;
* both: ``unlink(comm_id)``, ``finalize``; the two processes meet at gloo
  ``dist.barrier()`` where the sample does.

Mechanical changes, each marked ``# port:``: the import; CPU tensors instead of
``.npu()`` (no ``torch.npu.set_device``); addresses and ports: one host (127.0.0.1 for
the sample's host and device IPs), gloo's ``MASTER_PORT`` handed in by the test harness
instead of 29500, and a ``device_port`` in each rank-table entry, the harness's port for
that party's listener (an HCCL rank table carries none). The sample's other rank table,
for both parties on one server, is read from Ascend's ``hccn_tool`` and ``/dev/davinci*``
and has no counterpart here (no ``--is_single``/``--host_ip``). Checks added: the prompt's
blocks hold values the decoder's do not, so the pull is seen in the received bytes, and
each swap is checked.
"""

import argparse
import datetime
import json
import logging
import os
import time

import torch
import torch.distributed as dist

from aiokv.sync import BlocksCacheKey  # port: was `from llm_datadist import (`
from aiokv.sync import Cache  # port: was `from llm_datadist import (`
from aiokv.sync import CacheDesc  # port: was `from llm_datadist import (`
from aiokv.sync import DataType  # port: was `from llm_datadist import (`
from aiokv.sync import LLMConfig  # port: was `from llm_datadist import (`
from aiokv.sync import LLMDataDist  # port: was `from llm_datadist import (`
from aiokv.sync import LLMRole  # port: was `from llm_datadist import (`
from aiokv.sync import Placement  # port: was `from llm_datadist import (`
from aiokv.sync import RegisterMemStatus  # port: was `from llm_datadist import (`

PROMPT, DECODER = 1, 2  # cluster ids; gloo rank and rank-table rank are one less
BLOCK_FLOATS = 1024 * 1024  # one block: 1 Mi floats; each cache has 2 blocks
HOST_IP = "127.0.0.1"  # port: one host, was 10.10.10.0 / 10.10.10.1
DEVICE_IPS = {PROMPT: ["127.0.0.1"] * 8, DECODER: ["127.0.0.1"] * 8}  # port: was 192.168.x.y
GLOO_PORT = os.environ["PORTS_MASTER_PORT"]  # port: harness port, was 29500
DEVICE_PORT = {  # port: where each party's aiokv listener is
    PROMPT: int(os.environ["PORTS_PROMPT_PORT"]),
    DECODER: int(os.environ["PORTS_DECODER_PORT"]),
}
POOL_BYTES = 64 * 1024 * 1024

log = logging.getLogger("pull_blocks")


def join_group(cluster_id: int) -> None:
    os.environ["MASTER_ADDR"] = HOST_IP  # the prompt's host
    os.environ["MASTER_PORT"] = GLOO_PORT  # port: harness port
    dist.init_process_group(
        backend="gloo",
        rank=cluster_id - 1,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )


def start(role: LLMRole, cluster_id: int, device_id: int, with_pool: bool) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    config = LLMConfig()
    config.device_id = device_id
    config.enable_cache_manager = True
    if with_pool:
        config.mem_pool_cfg = json.dumps({"memory_size": POOL_BYTES})
    datadist.init(config.generate_options())
    log.info("%s initialised as cluster %d", role, cluster_id)
    return datadist


def rank_table(device_id: int) -> str:
    """The two-server HCCL rank table: the prompt is rank 0, the decoder rank 1."""
    servers = [
        {
            "server_id": str(cluster_id),
            "host_ip": HOST_IP,
            "device": [
                {
                    "device_id": str(device_id),
                    "device_ip": DEVICE_IPS[cluster_id][device_id],
                    "device_port": str(DEVICE_PORT[cluster_id]),  # port: aiokv listener
                    "rank_id": str(cluster_id - 1),
                }
            ],
        }
        for cluster_id in (PROMPT, DECODER)
    ]
    table = {"version": "1.2", "status": "completed", "server_count": "2"}
    return json.dumps({**table, "server_list": servers})


def link(datadist: LLMDataDist, device_id: int) -> int:
    comm_id = datadist.link("link", {PROMPT: 0, DECODER: 1}, rank_table(device_id))
    while (status := datadist.query_register_mem_status(comm_id)) != RegisterMemStatus.OK:
        if status == RegisterMemStatus.FAILED:
            raise RuntimeError("registering memory on the link failed")
        log.info("memory not registered on the link yet")
        time.sleep(1)
    log.info("query_register_mem_status ok")
    return comm_id


def blocks_cache(datadist: LLMDataDist, tensor: torch.Tensor, key: BlocksCacheKey | None) -> Cache:
    desc = CacheDesc(
        num_tensors=1,
        shape=[2, BLOCK_FLOATS],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    addrs = [int(tensor.data_ptr())]
    if key is None:
        return datadist.cache_manager.register_blocks_cache(desc, addrs)
    return datadist.cache_manager.register_blocks_cache(desc, addrs, key)


def prompt_blocks() -> torch.Tensor:
    """What the prompt holds: a different value in every float."""
    return torch.arange(2 * BLOCK_FLOATS, dtype=torch.float).view(2, BLOCK_FLOATS)


def prompt(datadist: LLMDataDist, device_id: int) -> None:
    tensor = prompt_blocks()  # port: CPU, was .npu(); values the decoder lacks (check)
    blocks_cache(datadist, tensor, BlocksCacheKey(PROMPT, 0))
    comm_id = link(datadist, device_id)
    dist.barrier()  # both registered and linked
    dist.barrier()  # the decoder has pulled and swapped
    datadist.unlink(comm_id)
    dist.barrier()  # both unlinked
    datadist.finalize()


def decoder(datadist: LLMDataDist, device_id: int) -> None:
    tensor = torch.zeros(2, BLOCK_FLOATS)  # port: CPU, was .npu(); zeros (check)
    cache = blocks_cache(datadist, tensor, None)
    comm_id = link(datadist, device_id)
    dist.barrier()  # both registered and linked

    datadist.cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1]
    )
    assert torch.equal(tensor, prompt_blocks())  # port: check

    host = torch.rand(2, BLOCK_FLOATS)
    host_desc = CacheDesc(
        num_tensors=1,
        shape=[2, BLOCK_FLOATS],
        data_type=DataType.DT_FLOAT,
        placement=Placement.HOST,
    )
    host_cache = Cache.create_cpu_cache(host_desc, [host.data_ptr()])
    datadist.cache_manager.swap_blocks(cache, host_cache, {0: 0, 1: 1})
    assert torch.equal(host, prompt_blocks())  # port: check
    host.neg_()  # port: check: make the swap back visible
    datadist.cache_manager.swap_blocks(host_cache, cache, {0: 0, 1: 1})
    assert torch.equal(tensor, -prompt_blocks())  # port: check

    dist.barrier()  # the decoder has pulled and swapped
    datadist.unlink(comm_id)
    dist.barrier()  # both unlinked
    datadist.finalize()


def main() -> None:
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)
    parser = argparse.ArgumentParser()
    parser.add_argument("--device_id", type=int, default=0, choices=range(8))
    parser.add_argument("--cluster_id", type=int, default=PROMPT, choices=[PROMPT, DECODER])
    args = parser.parse_args()
    log.info("Sample start, cluster %d, device %d", args.cluster_id, args.device_id)
    # port: CPU, no torch.npu.set_device(args.device_id)
    role = LLMRole.PROMPT if args.cluster_id == PROMPT else LLMRole.DECODER
    join_group(args.cluster_id)
    datadist = start(role, args.cluster_id, args.device_id, with_pool=False)
    if role == LLMRole.PROMPT:
        prompt(datadist, args.device_id)
    else:
        decoder(datadist, args.device_id)
    log.info("Sample end")


if __name__ == "__main__":
    main()
