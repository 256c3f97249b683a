"""vLLM-Ascend's older ``LLMDataDistConnector`` (legacy mode), on ``aiokv.sync``.

Written for this test after ``vllm_ascend/distributed/llmdatadist_connector.py``
(repository vllm-project/vllm-ascend; not copied here), keeping its llm_datadist calls,
arguments and order; only what touches vLLM, NPUs or torchair is replaced:

* both: ``LLMDataDist(role, cluster_id=local_rank)``; ``init`` with an options dict:
  ``llm.SyncKvCacheWaitTime``, ``ge.exec.deviceId`` and, on the prefill side,
  ``llm.listenIpInfo``: legacy mode (no ``enable_cache_manager``), ``kv_cache_manager``;
* prefill (``send_kv_caches_and_hidden_states``): four ``allocate_cache`` calls — key,
  value, input and hidden buffers — each bound to ``CacheKey(cluster_id, 0, model_id)``
  with model ids 1..4, written through tensors over ``per_device_tensor_addrs[0]``
  (torchair's ``create_npu_tensors`` there);
* decode: ``link_clusters`` (remote cluster id = its own local rank, local ip info
  ``(ip, 0)``, timeout 20000; the codes are only logged, as the connector does), four
  ``allocate_cache`` calls without keys, then ``pull_cache(CacheKeyByIdAndIndex(cid,
  i, 0), buffer, 0)`` for i = 1..4 — literal cache ids, which llm_datadist hands out
  from 1 per process in allocation order, readable by id in legacy mode with no opt-in;
  ``unlink_clusters`` at ``close()``.

Mechanical changes, each marked ``# port:``: the import; CPU tensors over the cache
addresses; environment and model shapes as constants; the prompt's listener on a free
port (was 26000); gloo barriers where vLLM's own flow orders the two sides; asserts on
the bytes received.
"""

import argparse
import ctypes
import datetime
import logging
import os

import torch
import torch.distributed as dist

import aiokv.sync as llm_datadist  # port: was `import llm_datadist`

LOCAL_RANK = 0
IP = "127.0.0.1"  # port: the device ip hccn_tool reports
COMM_PORT = int(os.environ["PORTS_PROMPT_PORT"])  # port: envs.LLMDATADIST_COMM_PORT
SYNC_WAIT = "5000"  # port: envs.LLMDATADIST_SYNC_CACHE_WAIT_TIME
LAYERS, TOKENS, HEADS, HEAD_SIZE, HIDDEN = 2, 5, 2, 4, 8  # port: a tiny model

log = logging.getLogger("llmdatadist_connector")


def cpu_tensors(shape: list[int], dtype: torch.dtype, addrs: list[int]) -> list[torch.Tensor]:
    """torchair.llm_datadist.create_npu_tensors on host memory."""  # port
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return [
        torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(a), dtype=dtype).view(shape)
        for a in addrs
    ]


class KVTransferEngine:
    def __init__(self, role: llm_datadist.LLMRole, local_rank: int) -> None:
        self.role = role
        self.local_rank = local_rank
        self.cluster_id = local_rank
        self.data_dist = llm_datadist.LLMDataDist(self.role, self.cluster_id)

    def prepare_data_dist(self) -> None:
        options = {"llm.SyncKvCacheWaitTime": SYNC_WAIT}
        if self.role == llm_datadist.LLMRole.PROMPT:
            options["ge.exec.deviceId"] = str(self.local_rank)
            options["llm.listenIpInfo"] = f"{IP}:{COMM_PORT}"
        else:
            options["ge.exec.deviceId"] = str(self.local_rank)
        self.data_dist.init(options)
        self.kv_transfer = self.data_dist.kv_cache_manager
        log.info("%d rank data dist is ready", self.local_rank)

    def make_cluster(self, prefill_ip: str, cluster_id: int = -1) -> llm_datadist.LLMClusterInfo:
        cluster = llm_datadist.LLMClusterInfo()
        cluster.remote_cluster_id = cluster_id
        cluster.append_local_ip_info(IP, 0)
        cluster.append_remote_ip_info(prefill_ip, COMM_PORT)  # port: was 26000
        return cluster


def descs(dtype: llm_datadist.DataType, seq_dim: int) -> list[llm_datadist.CacheDesc]:
    kv_shape = [1, TOKENS, HEADS, HEAD_SIZE]
    return [
        llm_datadist.CacheDesc(LAYERS, kv_shape, dtype, seq_len_dim_index=seq_dim),  # key
        llm_datadist.CacheDesc(LAYERS, kv_shape, dtype, seq_len_dim_index=seq_dim),  # value
        llm_datadist.CacheDesc(
            1, [1, TOKENS, 1, 1], llm_datadist.DataType.DT_INT32, seq_len_dim_index=-1
        ),  # input
        llm_datadist.CacheDesc(1, [1, TOKENS, 1, HIDDEN], dtype, seq_len_dim_index=-1),  # hidden
    ]


TORCH = [torch.float16, torch.float16, torch.int32, torch.float16]


def expected(buffer: int, layer: int) -> float:
    return float(buffer * 10 + layer + 1)


def prefill(engine: KVTransferEngine) -> None:
    engine.prepare_data_dist()
    dist.barrier()  # port: both initialised
    buffers = []
    for model_id, desc in enumerate(descs(llm_datadist.DataType.DT_FLOAT16, 1), start=1):
        keys = [llm_datadist.CacheKey(engine.cluster_id, 0, model_id)]
        buffers.append(engine.kv_transfer.allocate_cache(desc, keys))
    for i, buf in enumerate(buffers):  # the connector's scatter_update_ into each buffer
        for layer, t in enumerate(
            cpu_tensors(buf.cache_desc.shape, TORCH[i], buf.per_device_tensor_addrs[0])
        ):
            t.fill_(expected(i, layer))
    log.info("[P]: KV send DONE.")
    dist.barrier()  # port: the request reaches the decode side
    dist.barrier()  # port: the decode side pulled
    engine.data_dist.finalize()


def decode(engine: KVTransferEngine) -> None:
    engine.prepare_data_dist()
    dist.barrier()  # port: both initialised
    cluster = engine.make_cluster(IP, engine.cluster_id)
    _, ret = engine.data_dist.link_clusters([cluster], 20000)
    log.info("local_rank %d link, ret=%s", engine.local_rank, ret)
    dist.barrier()  # port: the request reaches the decode side
    buffers = [
        engine.kv_transfer.allocate_cache(desc)
        for desc in descs(llm_datadist.DataType.DT_FLOAT16, -1)
    ]
    for cache_id, buf in enumerate(buffers, start=1):
        key = llm_datadist.CacheKeyByIdAndIndex(cluster.remote_cluster_id, cache_id, 0)
        engine.kv_transfer.pull_cache(key, buf, 0)
    for i, buf in enumerate(buffers):  # port: check the bytes received
        for layer, t in enumerate(
            cpu_tensors(buf.cache_desc.shape, TORCH[i], buf.per_device_tensor_addrs[0])
        ):
            assert torch.all(t == expected(i, layer)), (i, layer, t)
    log.info("[D]: Successfully received all KVs and hidden states, skip model forwarding.")
    engine.data_dist.unlink_clusters([cluster], 5000)  # close()
    dist.barrier()  # port: the decode side pulled
    engine.data_dist.finalize()


def main() -> None:
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv_role", choices=["kv_producer", "kv_consumer"], required=True)
    args = parser.parse_args()
    producer = args.kv_role == "kv_producer"
    os.environ["MASTER_ADDR"] = IP
    os.environ["MASTER_PORT"] = os.environ["PORTS_MASTER_PORT"]
    dist.init_process_group(
        backend="gloo", rank=0 if producer else 1, world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    role = llm_datadist.LLMRole.PROMPT if producer else llm_datadist.LLMRole.DECODER
    engine = KVTransferEngine(role, LOCAL_RANK)
    prefill(engine) if producer else decode(engine)
    log.info("Sample end")


if __name__ == "__main__":
    main()
