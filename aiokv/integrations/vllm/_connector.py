"""``AiokvConnector``: vLLM's ``KVConnectorBase_V1`` over aiokv (needs vLLM).

A thin facade: it reads what it needs from vLLM's objects and forwards to
:class:`~._scheduler.SchedulerSide` (in the scheduler process) or
:class:`~._worker.WorkerSide` (in each worker process), which hold all the logic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ._options import ConnectorOptions
from ._params import Endpoint
from ._plan import StepPlan
from ._scheduler import SchedulerSide
from ._worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["AiokvConnector", "AiokvHandshake", "AiokvMetadata", "AiokvWorkerMetadata"]

log = logging.getLogger("aiokv.vllm")


def _log_like_vllm() -> None:
    """Show the connector's records (logger ``aiokv.vllm``) where vLLM shows its own,
    unless the application configured that logger."""
    ours, theirs = logging.getLogger("aiokv.vllm"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


@dataclass
class AiokvHandshake(KVConnectorHandshakeMetadata):
    """Where one worker rank listens (worker → scheduler, at start-up)."""

    host: str
    port: int
    cluster_id: int


@dataclass
class AiokvMetadata(KVConnectorMetadata):
    """One step's plan (scheduler → workers); ``idle``: the step runs no model."""

    plan: StepPlan
    idle: bool = False


@dataclass
class AiokvWorkerMetadata(KVConnectorWorkerMetadata):
    """Push mode (worker → scheduler, per step): reservations received, by transfer id,
    counted once per worker rank that received one."""

    reserved: dict[str, int]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, AiokvWorkerMetadata)
        merged = dict(self.reserved)
        for transfer, count in other.reserved.items():
            merged[transfer] = merged.get(transfer, 0) + count
        return AiokvWorkerMetadata(merged)


class AiokvConnector(KVConnectorBase_V1):
    """A vLLM V1 KV connector that moves KV blocks with aiokv (pull or layer-wise push).

    Load with ``KVTransferConfig(kv_connector="AiokvConnector",
    kv_connector_module_path="aiokv.integrations.vllm", kv_role=...)``; options in
    ``kv_connector_extra_config`` (:class:`~._options.ConnectorOptions`). Both sides
    need the same tensor-parallel size and block size.
    """

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None and transfer.engine_id is not None
        self._options = ConnectorOptions.parse(
            transfer.kv_connector_extra_config, kv_port=transfer.kv_port
        )
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(
                "AiokvConnector supports models with one KV cache group "
                f"(this one has {len(kv_cache_config.kv_cache_groups)})"
            )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("AiokvConnector does not support pipeline parallelism")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                engine_id=transfer.engine_id,
                block_size=vllm_config.cache_config.block_size,
                tp_size=parallel.tensor_parallel_size,
                lease_s=self._options.lease_timeout_s,
                push=self._options.mode == "push",
            )
            self._push_requests: dict[str, Request] = {}
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(
                self._options,
                engine_id=transfer.engine_id,
                rank=get_tensor_model_parallel_rank(),
            )

    # ---- scheduler side ---------------------------------------------------------------------
    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker connector"
        return self._scheduler

    def on_new_request(self, request: Request) -> None:
        self._sched().arrived(request.request_id, request.kv_transfer_params)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().matched_tokens(
            request.kv_transfer_params, request.num_prompt_tokens, num_computed_tokens
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        group = blocks.blocks[0] if blocks.blocks else ()
        cached = sum(1 for b in group if b.block_hash is not None and not b.is_null)
        new = [b.block_id for b in group if b.block_hash is None and not b.is_null]
        sched = self._sched()
        sched.after_alloc(
            request.request_id,
            request.kv_transfer_params,
            cached_blocks=cached,
            new_blocks=new,
            num_external_tokens=num_external_tokens,
        )
        if request.request_id in sched.push_requests():
            self._push_requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        sched = self._sched()
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id in sched.push_requests():
            request = self._push_requests.get(request_id)
            count = scheduled.get(request_id, 0)
            if request is None or not count:
                continue
            # the request's num_computed_tokens does not count this step's tokens yet
            completes = request.num_computed_tokens + count >= request.num_prompt_tokens
            sched.scheduled(
                request_id,
                completes=completes,
                block_ids=list(self._kv_cache_manager.get_block_ids(request_id)[0]),
                num_tokens=request.num_prompt_tokens,
            )
        idle = scheduler_output.total_num_scheduled_tokens == 0
        return AiokvMetadata(sched.take_plan(), idle=idle)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, AiokvWorkerMetadata) and meta.reserved:
            self._sched().reserved(meta.reserved)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        completed = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        self._push_requests.pop(request.request_id, None)
        return self._sched().finished(
            request.request_id,
            request.kv_transfer_params,
            completed=completed,
            block_ids=list(block_ids),
            num_computed_tokens=request.num_computed_tokens,
        )

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        ranks: dict[int, Endpoint] = {}
        for rank, meta in metadata.items():
            if not isinstance(meta, AiokvHandshake):
                raise ValueError(f"AiokvConnector: unexpected handshake metadata {meta!r}")
            ranks[rank] = Endpoint(meta.host, meta.port, meta.cluster_id)
        self._sched().set_ranks(ranks)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # ---- worker side ------------------------------------------------------------------------
    def _work(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().start(kv_caches, self._kv_cache_config.num_blocks)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        endpoint = self._work().endpoint
        if endpoint is None:
            return None
        return AiokvHandshake(endpoint.host, endpoint.port, endpoint.cluster_id)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AiokvMetadata)
        self._work().step(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AiokvMetadata)
        if meta.plan.pushes:
            self._work().save_layer(layer_name, meta.plan.pushes, kv_layer)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AiokvMetadata)
        if meta.plan.pushes:
            self._work().saved(meta.plan.pushes)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        reserved = self._work().take_reserved()
        return AiokvWorkerMetadata(reserved) if reserved else None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._get_connector_metadata()
        idle = isinstance(meta, AiokvMetadata) and meta.idle
        done = self._work().results(idle=idle)
        return KVConnectorTransferResults(
            finished_sending=done.finished_sending,
            finished_recving=done.finished_recving,
            failed_recving=done.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self.get_transfer_results(finished_req_ids)
        return done.finished_sending or None, done.finished_recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
