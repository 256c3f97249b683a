"""NIXL transport: aiokv's TCP link as the control plane, NIXL (UCX) moving the bytes.

Importing it needs NIXL (``pip install 'aiokv[nixl]'``; install ``torch==2.13.0`` first,
or pip pulls a CUDA torch). Without it the import fails with that instruction, which
:func:`aiokv.transport.get_transport` turns into ``LLM_FEATURE_NOT_ENABLED``.
"""

from __future__ import annotations

from ._transport import NixlTransport

__all__ = ["NixlTransport"]
