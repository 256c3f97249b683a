"""The notifications the connector's workers exchange over aiokv (``send_notification``):
JSON objects, untrusted on arrival (decoded by ``msgspec`` against these types).

Pull mode: the decode side's :class:`DoneNotice`. Push mode (tagged ``"push"``):
:class:`ReserveNotice` and :class:`CancelNotice` (decode → prefill) and
:class:`PushedNotice` (prefill → decode).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = [
    "CancelNotice",
    "DoneNotice",
    "PushMessage",
    "PushedNotice",
    "ReserveNotice",
    "notice_decoder",
    "notice_encoder",
    "push_decoder",
]


#: A request id or token a done notice may carry: what params may (``_params``: at most
#: 1024 characters). A prefill keeps notices that came before their hold (untrusted,
#: up to 65536 of them): bounded so, they cannot hold much memory.
_Text = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]


class DoneNotice(msgspec.Struct, frozen=True):
    """The decode side's notification: it has the blocks of ``request``, the prefill may
    free them (``token``: the one in the params, so that no other peer can)."""

    request: _Text
    token: _Text


class ReserveNotice(msgspec.Struct, frozen=True, tag_field="push", tag="reserve"):
    """Push mode, decode → prefill: push the blocks of the prompt from the prefill's
    block ``first`` on into this side's ``blocks`` (``num_tokens``: the prompt's tokens
    this side expects), under ``transfer``. ``lease_s``: the decode side's
    ``lease_timeout_s`` (it gives the blocks up that long after it sent this; absent
    from older senders), which bounds the push as the prefill's own does."""

    transfer: str
    blocks: list[int]
    first: int
    num_tokens: int
    lease_s: Annotated[float, msgspec.Meta(gt=0, lt=1e9)] | None = None


class PushedNotice(msgspec.Struct, frozen=True, tag_field="push", tag="pushed"):
    """Push mode, prefill → decode: the push under ``transfer`` ended (``ok``), or will
    never come (``error`` says why)."""

    transfer: str
    ok: bool
    error: str = ""


class CancelNotice(msgspec.Struct, frozen=True, tag_field="push", tag="cancel"):
    """Push mode, decode → prefill: the reservation ``transfer`` is withdrawn."""

    transfer: str


PushMessage = ReserveNotice | PushedNotice | CancelNotice
notice_decoder = msgspec.json.Decoder(DoneNotice)
push_decoder = msgspec.json.Decoder(PushMessage)
notice_encoder = msgspec.json.Encoder()
