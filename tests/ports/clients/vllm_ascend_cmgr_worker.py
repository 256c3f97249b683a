"""vLLM-Ascend's ``LLMDataDistCMgrConnectorWorker`` on aiokv, through ``aiokv.sync``.

The worker half of vLLM-Ascend's prefill→decode connector
(``vllm_ascend/distributed/llmdatadist_c_mgr_connector.py``), re-written for this test
from its published behaviour. What is kept as the connector does it:

* ``init_llm_datadist``: ``LLMConfig()`` + setters (``device_id``, ``sync_kv_timeout``,
  ``enable_switch_role``, ``enable_cache_manager``, ``enable_remote_cache_accessible``),
  ``generate_options()``, ``LLMDataDist(role, cluster_id).init(options)``; no
  ``listen_ip_info``;
* ``register_kv_caches``: one ``register_blocks_cache`` of every layer's K and V
  addresses (MHA), or one per MLA component keyed by ``model_id``; then a metadata
  listener thread;
* ``add_remote_agent``: the HCCL rank table built from both agents' metadata (no ports),
  ``link(comm_name, {prefill: 0, decode: 1}, table)``, then
  ``query_register_mem_status(comm_id=...)`` polled with ``time.sleep(1)``, and
  ``linked_cluster``; it runs on the prefill's listener thread and on the decoder's
  executor thread at the same time;
* ``_read_blocks`` on a ``ThreadPoolExecutor(1)`` calling ``pull_blocks``, then the
  finished message to the prefill; ``get_finished`` under ``thread_lock``.

The only changes: ``import aiokv.sync as llm_datadist`` (and the names from it); CPU
tensors; 127.0.0.1 and ports handed in by the harness (``VLLM_ASCEND_LLMDD_RPC_PORT``,
``AIOKV_DEVICE_PORT``: the port every party's rank-table entry stands for, as HCCL's
device port); vLLM's framework objects replaced by small stand-ins (tp=1, no dp, no
pcp/dcp); zmq (not installed here) replaced by one TCP connection per request carrying
the same msgpack messages (``REQ`` → connect/send/recv, ``ROUTER`` → accept/recv/send).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import os
import socket
import struct
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from enum import Enum
from typing import Any

import msgspec
import torch

import aiokv.sync as llm_datadist  # port: was `import llm_datadist`
from aiokv.sync import BlocksCacheKey  # port: was `from llm_datadist import (`
from aiokv.sync import CacheDesc  # port: was `from llm_datadist import (`
from aiokv.sync import LLMConfig  # port: was `from llm_datadist import (`
from aiokv.sync import LLMDataDist  # port: was `from llm_datadist import (`
from aiokv.sync import LLMException  # port: was `from llm_datadist import (`
from aiokv.sync import LLMRole  # port: was `from llm_datadist import (`

logging.basicConfig(format="%(asctime)s %(threadName)s %(message)s", level=logging.INFO)
logger = logging.getLogger("vllm_ascend_cmgr")

TORCH_DTYPE_TO_NPU_DTYPE = {
    torch.half: llm_datadist.DataType.DT_FLOAT16,
    torch.float16: llm_datadist.DataType.DT_FLOAT16,
    torch.bfloat16: llm_datadist.DataType.DT_BF16,
    torch.float: llm_datadist.DataType.DT_FLOAT,
    torch.float32: llm_datadist.DataType.DT_FLOAT,
    torch.int8: llm_datadist.DataType.DT_INT8,
    torch.int64: llm_datadist.DataType.DT_INT64,
    torch.int32: llm_datadist.DataType.DT_INT32,
}


# ---- stand-ins for vLLM / vllm_ascend framework pieces ------------------------------------
class envs_ascend:  # the module name it stands for
    VLLM_ASCEND_LLMDD_RPC_IP = os.environ.get("VLLM_ASCEND_LLMDD_RPC_IP", "127.0.0.1")
    VLLM_ASCEND_LLMDD_RPC_PORT = int(os.environ["VLLM_ASCEND_LLMDD_RPC_PORT"])
    DISAGGREGATED_PREFILL_RANK_TABLE_PATH = os.environ["DISAGGREGATED_PREFILL_RANK_TABLE_PATH"]


VLLM_NIXL_ABORT_REQUEST_TIMEOUT = 120


def get_ip() -> str:
    return "127.0.0.1"  # port: one host


def get_transfer_timeout_value() -> int:
    return 10000  # ms


@dataclass
class KVTransferConfig:
    kv_role: str
    engine_id: str = "engine-0"


@dataclass
class VllmConfig:
    """What the worker reads of vLLM's config: tp=1, one local dp rank, no pcp/dcp."""

    kv_transfer_config: KVTransferConfig
    tensor_parallel_size: int = 1
    data_parallel_rank_local: int | None = None


# ---- the connector's own types --------------------------------------------------------
class LLMDataDistCMgrEvent(Enum):
    ReqForMetadata = 0
    ReqForFinished = 1


class LLMDataDistCMgrAgentMetadata(msgspec.Struct):
    super_pod_id: str | None
    server_id: str
    device_id: str
    device_ip: str
    super_device_id: str | None
    cluster_id: int


@dataclass
class ReqMeta:
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_host: str
    remote_port: str
    engine_id: str
    remote_tp_size: str


@dataclass
class LLMDataDistCMgrConnectorMetadata:
    requests: dict[str, ReqMeta] = field(default_factory=dict)
    reqs_to_send: dict[str, float] = field(default_factory=dict)

    def add_new_req(self, request_id: str, local_block_ids: list[int], params: dict[str, Any]):
        self.requests[request_id] = ReqMeta(
            local_block_ids=local_block_ids,
            remote_block_ids=params["remote_block_ids"],
            engine_id=params["remote_engine_id"],
            remote_host=params["remote_host"],
            remote_port=params["remote_port"],
            remote_tp_size=params["remote_tp_size"],
        )


# ---- zmq stand-in: one request and its reply per TCP connection -------------------------
def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("peer closed")
            buf += chunk
        return buf

    (n,) = struct.unpack("!I", exactly(4))
    return exactly(n)


@contextlib.contextmanager
def req_socket(host: str, port: int, timeout: float = 20.0) -> Iterator[socket.socket]:
    """zmq.REQ: connects (waiting for the peer to bind, as zmq does), then send/recv."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with sock:
        yield sock


# ---- the worker ---------------------------------------------------------------------
class LLMDataDistCMgrConnectorWorker:
    def __init__(self, vllm_config: VllmConfig):
        self.local_rank = 0
        self.local_dp_rank = vllm_config.data_parallel_rank_local
        self.tp_size = vllm_config.tensor_parallel_size
        self.tp_rank = 0
        self.rank = 0
        self.pcp_size = 1
        self.pcp_rank = 0
        self.dcp_size = 1
        self.local_ip = get_ip()
        self.kv_transfer_config = vllm_config.kv_transfer_config
        self.vllm_config = vllm_config
        self.executor = ThreadPoolExecutor(1)
        self.thread_lock = threading.Lock()
        if self.kv_transfer_config.kv_role == "kv_producer":
            self.llm_datadist_role = LLMRole.PROMPT
            self.llm_datadist_remote_role = LLMRole.DECODER
        elif self.kv_transfer_config.kv_role == "kv_consumer":
            self.llm_datadist_role = LLMRole.DECODER
            self.llm_datadist_remote_role = LLMRole.PROMPT
        else:
            raise RuntimeError(f"unexpected kv role {self.kv_transfer_config.kv_role}")
        # {remote cluster_id: comm_id} of the links already built
        self.linked_cluster: dict[Any, Any] = {}
        self.prefill_device_list: list[tuple[str, str]] = []
        self.decode_device_list: list[tuple[str, str]] = []
        global_rank_table = self.read_offline_rank_table()
        self.local_agent_metadata = self.read_agent_metadata(global_rank_table)
        self.llm_datadist = LLMDataDist(
            self.llm_datadist_role, self.local_agent_metadata.cluster_id
        )
        self.init_llm_datadist()
        self.finished_reqs: set[str] = set()
        self.done_receiving_counts: defaultdict[str, set[int]] = defaultdict(set)
        self.reqs_to_send: dict[str, float] = {}

    def listen_for_agent_metadata_req(self, event: threading.Event) -> None:
        port = envs_ascend.VLLM_ASCEND_LLMDD_RPC_PORT + self.tp_size + self.tp_rank
        encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
        msg_to_send = encoder.encode(self.local_agent_metadata)
        logger.info(
            "cluster %s listens for peers at %s:%d",
            self.local_agent_metadata.cluster_id,
            envs_ascend.VLLM_ASCEND_LLMDD_RPC_IP,
            port,
        )
        with socket.create_server((envs_ascend.VLLM_ASCEND_LLMDD_RPC_IP, port)) as server:
            event.set()
            while True:
                conn, _ = server.accept()
                with conn:
                    event_msg, decode_msg = decoder.decode(_recv_frame(conn))
                    event_msg = LLMDataDistCMgrEvent(event_msg)
                    if event_msg == LLMDataDistCMgrEvent.ReqForMetadata:
                        if "cluster_id" in decode_msg:
                            decode_msg = LLMDataDistCMgrAgentMetadata(**decode_msg)
                            logger.info("metadata request from cluster %s", decode_msg.cluster_id)
                            _send_frame(conn, msg_to_send)
                            self.add_remote_agent(decode_msg)
                        else:
                            logger.warning("unrecognized data %s", decode_msg)
                    elif event_msg == LLMDataDistCMgrEvent.ReqForFinished:
                        finished_req_id = decode_msg[0]
                        with self.thread_lock:
                            logger.info("request %s finished by the decoder", finished_req_id)
                            if finished_req_id in self.reqs_to_send:
                                self.finished_reqs.add(finished_req_id)
                                del self.reqs_to_send[finished_req_id]
                        _send_frame(conn, b"receiving decode finished")
                    else:
                        raise RuntimeError(f"unexpected request event {event_msg}")

    def init_llm_datadist(self) -> None:
        llm_config = LLMConfig()
        llm_config.device_id = self.local_rank
        llm_config.sync_kv_timeout = get_transfer_timeout_value()
        llm_config.enable_switch_role = True
        llm_config.enable_cache_manager = True
        llm_config.enable_remote_cache_accessible = True
        llm_config_options = llm_config.generate_options()
        self.llm_datadist.init(llm_config_options)
        self.cache_manager = self.llm_datadist.cache_manager
        logger.info("llm_datadist up, cluster id %s", self.local_agent_metadata.cluster_id)

    def read_offline_rank_table(self) -> dict[str, Any]:
        with open(envs_ascend.DISAGGREGATED_PREFILL_RANK_TABLE_PATH, encoding="utf-8") as f:
            global_rank_table = json.load(f)
        for d in global_rank_table["decode_device_list"]:
            self.decode_device_list.append((d["server_id"], d["device_id"]))
        for d in global_rank_table["prefill_device_list"]:
            self.prefill_device_list.append((d["server_id"], d["device_id"]))
        return global_rank_table

    def read_agent_metadata(
        self, global_rank_table: dict[str, Any]
    ) -> LLMDataDistCMgrAgentMetadata:
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "")
        visible_list = visible.split(",") if visible else None
        kinds = {
            LLMRole.PROMPT: ["prefill_device_list"],
            LLMRole.DECODER: ["decode_device_list"],
        }.get(self.llm_datadist_role, ["prefill_device_list", "decode_device_list"])
        agent_metadata = None
        for kind in kinds:
            devices = [
                d
                for d in global_rank_table[kind]
                if d.get("server_id") == self.local_ip
                and (visible_list is None or d.get("device_id", "") in visible_list)
            ]
            index = self.pcp_rank * self.tp_size + self.tp_rank
            if len(devices) <= index:
                continue
            info = devices[index]
            agent_metadata = LLMDataDistCMgrAgentMetadata(
                super_pod_id=info.get("super_pod_id"),
                server_id=info["server_id"],
                device_id=info["device_id"],
                device_ip=info["device_ip"],
                super_device_id=info.get("super_device_id"),
                cluster_id=int(info["cluster_id"]),
            )
        assert agent_metadata is not None, f"{self.local_ip} is not in the rank table"
        return agent_metadata

    def register_kv_caches(self, kv_caches: dict[str, tuple[torch.Tensor, ...]]) -> None:
        first_kv_cache_tuple = next(iter(kv_caches.values()))
        first_kv_cache = first_kv_cache_tuple[0]
        assert len(first_kv_cache_tuple) > 1
        kv_cache_dtype = first_kv_cache.dtype
        self.use_mla = (
            first_kv_cache_tuple[0].size(-1) != first_kv_cache_tuple[1].size(-1)
            and len(first_kv_cache_tuple) == 2
        )
        self.num_blocks = first_kv_cache.shape[0]
        self.block_len = math.prod(first_kv_cache.shape[-3:])
        cluster_id = int(self.local_agent_metadata.cluster_id)
        alignment = 2 * 1024 * 1024
        if self.use_mla:
            k_normed_addrs = [c[0].data_ptr() for c in kv_caches.values()]
            k_pe_addrs = [c[1].data_ptr() for c in kv_caches.values()]
            k_normed, k_pe = first_kv_cache_tuple[0], first_kv_cache_tuple[1]
            self.cache_addr = (k_normed_addrs, k_pe_addrs)
            self.cache_desc = (
                CacheDesc(
                    len(k_normed_addrs), [*k_normed.shape], TORCH_DTYPE_TO_NPU_DTYPE[kv_cache_dtype]
                ),
                CacheDesc(len(k_pe_addrs), [*k_pe.shape], TORCH_DTYPE_TO_NPU_DTYPE[kv_cache_dtype]),
            )
            self.cache_key = (
                BlocksCacheKey(cluster_id=cluster_id, model_id=0),
                BlocksCacheKey(cluster_id=cluster_id, model_id=1),
            )
            try:
                self.cache = tuple(
                    self.cache_manager.register_blocks_cache(desc, addrs, key)
                    for desc, addrs, key in zip(
                        self.cache_desc, self.cache_addr, self.cache_key, strict=True
                    )
                )
            except (TypeError, ValueError):
                raise RuntimeError("unexpected parameter to register_blocks_cache") from None
        else:
            self.cache_addr = []
            for cache_or_caches in kv_caches.values():
                for cache in cache_or_caches:
                    base_addr = cache.data_ptr()
                    assert base_addr % alignment == 0, "kv cache must be 2M aligned"
                    self.cache_addr.append(base_addr)
            self.cache_desc = CacheDesc(
                len(self.cache_addr), [*cache.shape], TORCH_DTYPE_TO_NPU_DTYPE[kv_cache_dtype]
            )
            self.cache_key = BlocksCacheKey(cluster_id=cluster_id)
            try:
                self.cache = self.cache_manager.register_blocks_cache(
                    self.cache_desc, self.cache_addr, self.cache_key
                )
            except (TypeError, ValueError):
                raise RuntimeError("unexpected parameter to register_blocks_cache") from None
        logger.info("registered the paged KV cache")
        self.ready_event = threading.Event()
        self.metadata_agent_listener_t = threading.Thread(
            target=self.listen_for_agent_metadata_req,
            args=(self.ready_event,),
            daemon=True,
            name="metadata_agent_listener",
        )
        self.metadata_agent_listener_t.start()
        self.ready_event.wait()

    def start_load_kv(self, metadata: LLMDataDistCMgrConnectorMetadata) -> None:
        futures = []
        for req_id, meta in metadata.requests.items():
            futures.append(
                self.executor.submit(
                    self._read_blocks,
                    local_block_ids=meta.local_block_ids,
                    remote_block_ids=meta.remote_block_ids,
                    remote_ip=meta.remote_host,
                    remote_port=int(meta.remote_port),
                    remote_engine_id=meta.engine_id,
                    request_id=req_id,
                    remote_tp_size=meta.remote_tp_size,
                )
            )

        def handle_exception(future: Any) -> None:
            if future.exception():
                logger.error("KV transfer task failed: %r", future.exception())

        for future in futures:
            future.add_done_callback(handle_exception)
        self.reqs_to_send.update(metadata.reqs_to_send)

    def add_remote_agent(self, metadata: LLMDataDistCMgrAgentMetadata) -> int:
        remote_cluster_id = metadata.cluster_id
        if remote_cluster_id in self.linked_cluster:
            return remote_cluster_id
        is_same_server = metadata.server_id == self.local_agent_metadata.server_id
        if self.llm_datadist_role == LLMRole.PROMPT:
            prefill, decode = self.local_agent_metadata, metadata
        else:
            prefill, decode = metadata, self.local_agent_metadata
        comm_name = f"pd_comm_{prefill.device_ip}_{decode.device_ip}"
        cluster_rank_info = {prefill.cluster_id: 0, decode.cluster_id: 1}

        def device(m: LLMDataDistCMgrAgentMetadata, rank: str) -> dict[str, str]:
            pairs = [
                ("device_id", m.device_id),
                ("device_ip", m.device_ip),
                ("super_device_id", m.super_device_id),
                ("rank_id", rank),
            ]
            return {k: v for k, v in pairs if v is not None}

        rank_table: dict[str, Any] = {
            "version": "1.2",
            "server_count": "1" if is_same_server else "2",
            "status": "completed",
            "server_list": [{"device": [device(prefill, "0")], "server_id": prefill.server_id}],
        }
        if is_same_server:
            rank_table["server_list"][0]["device"].append(device(decode, "1"))
        else:
            rank_table["server_list"].append(
                {"device": [device(decode, "1")], "server_id": decode.server_id}
            )
        logger.info("link %s %s rank table %s", comm_name, cluster_rank_info, rank_table)
        comm_id = self.llm_datadist.link(comm_name, cluster_rank_info, json.dumps(rank_table))
        while True:
            ret = self.llm_datadist.query_register_mem_status(comm_id=comm_id)
            if ret == llm_datadist.RegisterMemStatus.OK:
                logger.info("linking succeeded, comm id %s", comm_id)
                break
            elif ret == llm_datadist.RegisterMemStatus.FAILED:
                raise RuntimeError(f"linking failed, comm id {comm_id}")
            time.sleep(1)
            logger.info("checking query_register_mem_status again")
        self.linked_cluster.update({remote_cluster_id: comm_id})
        return remote_cluster_id

    def remove_remote_agent(self, cluster_id: int) -> None:
        comm_id = self.linked_cluster[cluster_id]
        try:
            self.llm_datadist.unlink(comm_id)
            self.linked_cluster.pop(cluster_id)
        except LLMException:
            logger.error("removing cluster %s failed", cluster_id)

    def connect_to_remote_agent(self, host: str, port: int) -> int:
        msg_send = msgspec.msgpack.Encoder().encode(
            [LLMDataDistCMgrEvent.ReqForMetadata, self.local_agent_metadata]
        )
        with req_socket(host, port) as sock:
            _send_frame(sock, msg_send)
            metadata = msgspec.msgpack.Decoder().decode(_recv_frame(sock))
        metadata = LLMDataDistCMgrAgentMetadata(**metadata)
        logger.info("received metadata %s", metadata)
        return self.add_remote_agent(metadata)

    def send_finish_to_remote(self, host: str, ports: list[int], request_id: str) -> None:
        for port in ports:
            msg_send = msgspec.msgpack.Encoder().encode(
                [LLMDataDistCMgrEvent.ReqForFinished, [request_id]]
            )
            with req_socket(host, port) as sock:
                try:
                    _send_frame(sock, msg_send)
                    _recv_frame(sock)
                except Exception as e:
                    logger.error("failed to send request %s to prefill: %r", request_id, e)

    def _read_blocks(
        self,
        local_block_ids: list[int],
        remote_block_ids: list[int],
        remote_ip: str,
        remote_port: int,
        remote_engine_id: str,
        request_id: str,
        remote_tp_size: str,
    ) -> None:
        # the point-to-point case (local and remote pcp/dcp equal): one remote per tp rank
        remote_ports = [
            remote_port + self.pcp_rank * self.tp_size + tp_offset
            for tp_offset in range(self.tp_rank, int(remote_tp_size), self.tp_size)
        ]
        remote_cluster_id = self.connect_to_remote_agent(remote_ip, remote_ports[0])
        num_local_blocks = len(local_block_ids)
        if num_local_blocks == 0:
            return
        num_remote_blocks = len(remote_block_ids)
        assert num_local_blocks <= num_remote_blocks
        if num_local_blocks < num_remote_blocks:
            remote_block_ids = remote_block_ids[-num_local_blocks:]
        try:
            if self.use_mla:
                for model_id, cache in enumerate(self.cache):
                    self.cache_manager.pull_blocks(
                        BlocksCacheKey(cluster_id=remote_cluster_id, model_id=model_id),
                        cache,
                        remote_block_ids,
                        local_block_ids,
                    )
            else:
                self.cache_manager.pull_blocks(
                    BlocksCacheKey(cluster_id=remote_cluster_id),
                    self.cache,
                    remote_block_ids,
                    local_block_ids,
                )
        except (TypeError, ValueError):
            raise RuntimeError("unexpected parameter to pull_blocks") from None
        except LLMException:
            raise RuntimeError("timeout during pull_blocks") from None
        self.send_finish_to_remote(remote_ip, remote_ports, request_id)
        with self.thread_lock:
            self.finished_reqs.add(request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        now = time.perf_counter()
        with self.thread_lock:
            while self.reqs_to_send:
                req_id, expires = next(iter(self.reqs_to_send.items()))
                if now < expires:
                    break
                logger.warning("request %s: no transfer-done signal in time", req_id)
                self.finished_reqs.add(req_id)
                del self.reqs_to_send[req_id]
            req_ids_to_ret = copy.deepcopy(self.finished_reqs)
            self.finished_reqs.clear()
        if self.llm_datadist_role == LLMRole.PROMPT:
            return req_ids_to_ret, None
        return None, req_ids_to_ret


# ---- the framework stand-in: one request, prefill → decode ---------------------------------
LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 8, 16, 2, 32
REMOTE_BLOCKS, LOCAL_BLOCKS = [1, 3, 4], [0, 2, 5]
REQUEST_ID = "req-0"


def aligned_empty(
    shape: list[int], dtype: torch.dtype, align: int = 2 * 1024 * 1024
) -> torch.Tensor:
    """vLLM-Ascend allocates its KV cache 2 MiB aligned; so does this stand-in."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off : off + nbytes].view(dtype).view(shape)


def make_kv_caches(mla: bool, fill: bool) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per layer (K, V), or MLA's (k_normed, k_pe); block b of tensor t of layer l holds
    ``l*100 + t*10 + b`` on the prefill, zeros on the decoder."""
    dims = (HEAD_DIM, HEAD_DIM // 2) if mla else (HEAD_DIM, HEAD_DIM)
    heads = 1 if mla else HEADS
    caches = {}
    for layer in range(LAYERS):
        tensors = []
        for t, dim in enumerate(dims):
            x = aligned_empty([NUM_BLOCKS, BLOCK_SIZE, heads, dim], torch.float16)
            x.zero_()
            if fill:
                for b in range(NUM_BLOCKS):
                    x[b].fill_(layer * 100 + t * 10 + b)
            tensors.append(x)
        caches[f"model.layers.{layer}.self_attn.attn"] = tuple(tensors)
    return caches


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv_role", choices=["kv_producer", "kv_consumer"], required=True)
    parser.add_argument("--mla", action="store_true")
    parser.add_argument("--remote_port", type=int, help="the prefill's metadata port (decoder)")
    args = parser.parse_args()
    worker = LLMDataDistCMgrConnectorWorker(VllmConfig(KVTransferConfig(args.kv_role)))
    kv_caches = make_kv_caches(args.mla, fill=args.kv_role == "kv_producer")
    worker.register_kv_caches(kv_caches)
    meta = LLMDataDistCMgrConnectorMetadata()
    if args.kv_role == "kv_producer":
        # the scheduler finished the prefill: hold the blocks until the decoder says done
        meta.reqs_to_send[REQUEST_ID] = time.perf_counter() + VLLM_NIXL_ABORT_REQUEST_TIMEOUT
    else:
        meta.add_new_req(
            REQUEST_ID,
            LOCAL_BLOCKS,
            {
                "remote_block_ids": REMOTE_BLOCKS,
                "remote_engine_id": "engine-0",
                "remote_host": "127.0.0.1",
                "remote_port": str(args.remote_port),
                "remote_tp_size": "1",
            },
        )
    worker.start_load_kv(meta)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # vLLM's engine loop, one step per 10 ms
        sending, recving = worker.get_finished(set())
        if REQUEST_ID in (sending or set()) | (recving or set()):
            break
        time.sleep(0.01)
    else:
        logger.error("request %s did not finish", REQUEST_ID)
        return 1
    if args.kv_role == "kv_consumer":  # port: check the bytes that landed
        for layer, tensors in enumerate(kv_caches.values()):
            for t, x in enumerate(tensors):
                for src, dst in zip(REMOTE_BLOCKS, LOCAL_BLOCKS, strict=True):
                    assert torch.all(x[dst] == layer * 100 + t * 10 + src), (layer, t, dst)
                untouched = [b for b in range(NUM_BLOCKS) if b not in LOCAL_BLOCKS]
                assert torch.all(x[untouched] == 0)
    logger.info("%s finished request %s", args.kv_role, REQUEST_ID)
    return 0


if __name__ == "__main__":
    sys.exit(main())
