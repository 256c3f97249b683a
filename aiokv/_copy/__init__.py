"""The copy engine: block-pair planning, copy kernels, worker pools and devices.

Modules, one concept each: ``_plan`` (coalescing and the block-pair planner),
``_inline`` (small host copies on the caller's thread, below a measured size),
``_kernels`` (copy job bodies and the pinned staging ring), ``_workers`` (worker thread
pools, jobs resolved on the loop), ``_staging`` (device bytes of a transfer through
host buffers), ``_scheduler`` (:class:`CopyScheduler`, the façade
the rest of the package awaits), ``_device`` (device resolution, pinning, streams).
"""

from ._device import DeviceContext
from ._device import device_empty
from ._device import host_empty
from ._device import is_accelerator
from ._device import npu_device_count
from ._device import pre_touch
from ._device import resolve_device
from ._device import supports_pinning
from ._inline import INLINE_MAX_BYTES
from ._inline import copy_rows
from ._inline import fits_inline
from ._plan import Run
from ._plan import coalesce
from ._scheduler import CopyScheduler
from ._scheduler import SchedulerConfig
from ._staging import MAX_STAGED_BYTES
from ._staging import PART_BYTES
from ._staging import STAGE_LIMIT
from ._staging import Staged
from ._staging import Stager
from ._staging import is_staged

__all__ = [
    "INLINE_MAX_BYTES",
    "MAX_STAGED_BYTES",
    "PART_BYTES",
    "STAGE_LIMIT",
    "CopyScheduler",
    "DeviceContext",
    "Run",
    "SchedulerConfig",
    "Staged",
    "Stager",
    "coalesce",
    "copy_rows",
    "device_empty",
    "fits_inline",
    "host_empty",
    "is_accelerator",
    "is_staged",
    "npu_device_count",
    "pre_touch",
    "resolve_device",
    "supports_pinning",
]
