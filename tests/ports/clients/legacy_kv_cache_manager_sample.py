"""A legacy-mode (``kv_cache_manager``) client in the shape of llm_datadist's basic
prompt.py / decoder.py samples, on ``aiokv.sync``.

Written for this test after those samples (which are not copied here): the same calls,
arguments and order. ``LLMConfig`` carries only ``listen_ip_info`` (prompt) and
``device_id``; no memory pool, no ``enable_cache_manager``: llm_datadist's legacy mode.
The prompt allocates a 2-batch cache bound to two ``CacheKey``s and writes it through
tensors built over ``per_device_tensor_addrs`` (torchair's ``create_npu_tensors`` there,
CPU tensors over the same addresses here); the decoder links with ``link_clusters``
(cluster id 0 on both sides, as the samples have it), pulls each key into a 1-batch and
a 4-batch cache (one by ``(batch_index, size)``), ``copy_cache``s one into the other,
reads them with ``get_cache_tensors``, frees both, unlinks. Instead of the samples'
``time.sleep(30)`` the two sides meet at gloo barriers, as the newer samples do.
"""

import argparse
import ctypes
import datetime
import logging
import os

import torch
import torch.distributed as dist

from aiokv.sync import CacheDesc  # llm_datadist's samples: `from llm_datadist import ...`
from aiokv.sync import CacheKey  # llm_datadist's samples: `from llm_datadist import ...`
from aiokv.sync import DataType  # llm_datadist's samples: `from llm_datadist import ...`
from aiokv.sync import KvCache  # llm_datadist's samples: `from llm_datadist import ...`
from aiokv.sync import LLMClusterInfo  # llm_datadist's samples: `from llm_datadist import ...`
from aiokv.sync import LLMConfig  # llm_datadist's samples: `from llm_datadist import ...`
from aiokv.sync import LLMDataDist  # llm_datadist's samples: `from llm_datadist import ...`
from aiokv.sync import LLMRole  # llm_datadist's samples: `from llm_datadist import ...`
from aiokv.sync import LLMStatusCode  # llm_datadist's samples: `from llm_datadist import ...`

PROMPT_CLUSTER_ID_TO_DEVICE_IP_LIST = {0: ["127.0.0.1"] * 8}  # port: one host
PROMPT_DEVICE_LISTEN_PORT = int(os.environ["PORTS_PROMPT_PORT"])  # port: free, was 26000
DECODER_DEVICE_IP_LIST = ["127.0.0.1"] * 8
DEVICE_ID_LIST = [0, 1, 2, 3, 4, 5, 6, 7]
NUM_TENSORS = 4

logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)


def init_process_group(rank: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = os.environ["PORTS_MASTER_PORT"]
    dist.init_process_group(
        backend="gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )


def create_cpu_tensors(
    shape: list[int], dtype: torch.dtype, addrs: list[int]
) -> list[torch.Tensor]:
    """torchair.llm_datadist.create_npu_tensors, on host memory: tensors over ``addrs``."""
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return [
        torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(a), dtype=dtype).view(shape)
        for a in addrs
    ]


def value(tensor: int, req_id: int) -> float:
    return float(tensor * 10 + req_id + 1)


# ---- prompt.py -------------------------------------------------------------------------
def init_prompt_datadist(rank_id: int) -> LLMDataDist:
    datadist = LLMDataDist(LLMRole.PROMPT, 0)
    llm_config = LLMConfig()
    ip = PROMPT_CLUSTER_ID_TO_DEVICE_IP_LIST[0][rank_id]
    llm_config.listen_ip_info = ip + ":" + str(PROMPT_DEVICE_LISTEN_PORT)
    llm_config.device_id = DEVICE_ID_LIST[rank_id]
    llm_options = llm_config.generate_options()
    datadist.init(llm_options)
    return datadist


def run_with_kv_cache(kv_cache: KvCache) -> None:
    kv_tensor_addrs = kv_cache.per_device_tensor_addrs[0]
    logging.info(f"cache_id={kv_cache.cache_id}, kv_tensor_addrs={kv_tensor_addrs}")
    kv_tensors = create_cpu_tensors(kv_cache.cache_desc.shape, torch.float16, kv_tensor_addrs)
    for i, t in enumerate(kv_tensors):  # "inference": batch b holds request b's KV
        for req_id in range(kv_cache.cache_desc.shape[0]):
            t[req_id].fill_(value(i, req_id))


def run_prompt_sample(rank_id: int) -> None:
    datadist = init_prompt_datadist(rank_id)
    logging.info("[initialize] llm_datadist success")
    kv_cache_manager = datadist.kv_cache_manager
    cache_desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[2, 4, 8], data_type=DataType.DT_FLOAT16)
    cache_keys = [CacheKey(prompt_cluster_id=0, req_id=0), CacheKey(prompt_cluster_id=0, req_id=1)]
    kv_cache = kv_cache_manager.allocate_cache(cache_desc, cache_keys)
    logging.info("[allocate_cache] success")
    run_with_kv_cache(kv_cache)
    kv_host_tensors = kv_cache_manager.get_cache_tensors(kv_cache, 0)
    logging.info(f"[get_cache_tensor] success, kv_tensor_data = {kv_host_tensors[0].numpy()}")
    assert float(kv_host_tensors[0][1, 0, 0]) == value(0, 1)  # port: check
    dist.barrier()  # cache ready
    dist.barrier()  # decoder pulled
    kv_cache_manager.deallocate_cache(kv_cache)
    logging.info("[deallocate_cache] success")
    datadist.finalize()
    logging.info("[finalize] success")


# ---- decoder.py ------------------------------------------------------------------------
def init_decoder_datadist(rank_id: int) -> LLMDataDist:
    datadist = LLMDataDist(LLMRole.DECODER, cluster_id=0)
    llm_config = LLMConfig()
    llm_config.device_id = DEVICE_ID_LIST[rank_id]
    llm_options = llm_config.generate_options()
    datadist.init(llm_options)
    return datadist


def gen_cluster_info(rank_id: int) -> list[LLMClusterInfo]:
    cluster_info_list = []
    for prompt_cluster_id, device_ip_list in PROMPT_CLUSTER_ID_TO_DEVICE_IP_LIST.items():
        cluster_info = LLMClusterInfo()
        cluster_info.remote_cluster_id = prompt_cluster_id
        cluster_info.append_remote_ip_info(device_ip_list[rank_id], PROMPT_DEVICE_LISTEN_PORT)
        cluster_info.append_local_ip_info(DECODER_DEVICE_IP_LIST[rank_id], 0)
        cluster_info_list.append(cluster_info)
    return cluster_info_list


def run_decoder_sample(rank_id: int) -> None:
    datadist = init_decoder_datadist(rank_id=rank_id)
    logging.info("[initialize] llm_datadist success")
    dist.barrier()  # cache ready
    cluster_info_list = gen_cluster_info(rank_id)
    ret, _ = datadist.link_clusters(cluster_info_list, timeout=5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"[link_cluster] failed, ret={ret}")
    logging.info("[link_cluster] success")

    kv_cache_manager = datadist.kv_cache_manager
    cache_desc_1bs = CacheDesc(
        num_tensors=NUM_TENSORS, shape=[1, 4, 8], data_type=DataType.DT_FLOAT16
    )
    cache_desc_4bs = CacheDesc(
        num_tensors=NUM_TENSORS, shape=[4, 4, 8], data_type=DataType.DT_FLOAT16
    )
    kv_cache_1bs = kv_cache_manager.allocate_cache(cache_desc_1bs)
    kv_cache_4bs = kv_cache_manager.allocate_cache(cache_desc_4bs)
    logging.info("[allocate_cache] success")
    cache_key_0 = CacheKey(prompt_cluster_id=0, req_id=0, model_id=0)
    cache_key_1 = CacheKey(prompt_cluster_id=0, req_id=1, model_id=0)
    kv_cache_manager.pull_cache(cache_key_1, kv_cache_4bs, 1, 64)
    kv_cache_manager.pull_cache(cache_key_0, kv_cache_1bs)
    logging.info("[pull_cache] success")
    kv_cache_manager.copy_cache(kv_cache_4bs, kv_cache_1bs, 0, 0)
    logging.info("[copy_cache] success")
    kv_host_tensors = kv_cache_manager.get_cache_tensors(kv_cache_4bs, 0)
    logging.info("[get_cache_tensor] success")
    logging.info(f"batch_index = 0, tensor = {kv_host_tensors[0].numpy()[0, :]}")
    logging.info(f"batch_index = 1, tensor = {kv_host_tensors[0].numpy()[1, :]}")
    for i in range(NUM_TENSORS):  # port: check
        t = kv_cache_manager.get_cache_tensors(kv_cache_4bs, i)[0]
        assert torch.all(t[0] == value(i, 0)) and torch.all(t[1] == value(i, 1)), i
    kv_cache_manager.deallocate_cache(kv_cache_1bs)
    kv_cache_manager.deallocate_cache(kv_cache_4bs)
    logging.info("[deallocate_cache] success")
    ret, _ = datadist.unlink_clusters(cluster_info_list, timeout=5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"[unlink_cluster] failed, ret={ret}")
    logging.info("[unlink_cluster] success")
    dist.barrier()  # decoder pulled
    datadist.finalize()
    logging.info("[finalize] success")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["p", "d"], required=True)
    parser.add_argument("--rank_id", type=int, default=0, help="rank_id")
    args = parser.parse_args()
    logging.info(f"Sample start, rank_id = {args.rank_id}, role = {args.role}")
    init_process_group(0 if args.role == "p" else 1)
    if args.role == "p":
        run_prompt_sample(args.rank_id)
    else:
        run_decoder_sample(args.rank_id)
    logging.info("Sample end")
