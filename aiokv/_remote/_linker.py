"""``Linker``: opening and closing the links of one ``LLMDataDist``, on its engine.

Two ways to link, as llm_datadist:

* ``link_clusters`` / ``unlink_clusters`` — this side connects to each named cluster's
  listener. Attempts (``link_retry_count``) are spread evenly over the call's time
  budget, so a peer that starts listening a little later is still found and a refused
  connection never makes the call spin. The budget is the call's ``timeout``, cut to
  ``link_total_time`` when that is set and shorter.
* ``link`` / ``query_register_mem_status`` / ``unlink`` — every party of a communicator
  calls ``link`` at about the same time; each opens one link to every party of lower
  rank and waits for the links of the higher ranks (see :mod:`._ranktable`). ``link``
  returns at once; the status is ``PREPARING`` until every link is up, then ``OK``.
  Until ``OK`` the links of the communicator are held: requests on them fail with
  ``LLM_NOT_YET_LINK``.

A link the peer opened first counts as linked for this side too (no second connection
is made). Unlinking closes every connection to the cluster, whoever opened it, so the
peer sees the link end; unlinking a cluster that is not (or no longer) linked succeeds.

Threads: every method runs on the engine loop (``LLMDataDist`` hops there).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass

from .._config import LLMConfig
from .._engine import completing
from .._enums import LLMStatusCode
from .._enums import RegisterMemStatus
from .._errors import LLMException
from .._models import LLMClusterInfo
from ..transport import Link
from ..transport import Transport
from ._links import LinkTable
from ._ranktable import Party

__all__ = ["Linker"]

log = logging.getLogger("aiokv.links")

Code = LLMStatusCode
#: ``link`` waits this long for its parties when ``link_total_time`` is 0 (HCCL's default
#: connect timeout)
COMM_TIMEOUT_S = 120.0
#: ``link`` retries a refused connection this often
COMM_RETRY_S = 0.25


@dataclass(slots=True)
class _Comm:
    parties: list[Party]
    status: RegisterMemStatus = RegisterMemStatus.PREPARING
    task: asyncio.Task[None] | None = None


def _overall(codes: list[LLMStatusCode]) -> LLMStatusCode:
    """``LLM_SUCCESS``, or the code of the first cluster that failed."""
    return next((c for c in codes if c != Code.LLM_SUCCESS), Code.LLM_SUCCESS)


class Linker:
    """Links and unlinks for one ``LLMDataDist``; see the module docstring.

    Args:
        links: the link table it files links in.
        transport: connects, and lists the connections to close.
        config: ``link_retry_count`` and ``link_total_time``.
        before_close: awaited with each link this side is about to close (unlink), while
            it still works: the leases on it end there (:meth:`Leases.end_link`).
    """

    def __init__(
        self,
        links: LinkTable,
        transport: Transport,
        config: LLMConfig,
        before_close: Callable[[Link], Awaitable[None]] | None = None,
    ) -> None:
        self._links = links
        self._transport = transport
        self._config = config
        self._before_close = before_close
        self._comms: dict[int, _Comm] = {}
        self._ids = itertools.count(1)

    # ---- link_clusters / unlink_clusters ------------------------------------------------
    def budget(self, timeout_ms: int) -> float:
        """Seconds a ``link_clusters`` call may take: its timeout, or less."""
        total = self._config.link_total_time
        return min(timeout_ms / 1000, total) if total > 0 else timeout_ms / 1000

    async def link_all(
        self, infos: list[LLMClusterInfo], timeout_ms: int
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link each cluster concurrently within the budget: ``(overall, per_cluster)``.

        A cluster named more than once is linked once: its later entries get
        ``LLM_ALREADY_LINK`` when the first linked it, else the first one's code.
        Cancelled, it did not happen (docs/cancellation.md): the links it opened are
        closed and its claims of the peers' links taken back before the cancellation
        is raised, also those of clusters whose linking had completed."""
        deadline = time.monotonic() + self.budget(timeout_ms)
        made: list[tuple[int, Link | None]] = []
        cids = [c.remote_cluster_id for c in infos]
        first = {cid: i for i, cid in reversed(list(enumerate(cids)))}  # cluster -> entry
        try:
            async with asyncio.TaskGroup() as group:
                tasks = {
                    cid: group.create_task(self._link_one(infos[i], deadline, made))
                    for cid, i in first.items()
                }
        except asyncio.CancelledError:
            await completing(self._undo(made))
            raise
        codes = []
        for i, cid in enumerate(cids):
            code = tasks[cid].result()
            if i != first[cid] and code == Code.LLM_SUCCESS:
                code = Code.LLM_ALREADY_LINK
            codes.append(code)
        return _overall(codes), codes

    async def _undo(self, made: list[tuple[int, Link | None]]) -> None:
        """Take back what a cancelled :meth:`link_all` did: ``(cluster, link it opened)``
        closed, ``(cluster, None)`` (it claimed the peer's link) no longer this side's."""
        for cid, link in made:
            self._links.undo(cid, link)
            if link is None:
                continue
            await self._close([link])  # a link of the peer's it replaced is filed again

    async def _link_one(
        self, info: LLMClusterInfo, deadline: float, made: list[tuple[int, Link | None]]
    ) -> LLMStatusCode:
        """Link one cluster; every failure becomes its code (logged), never an exception.
        What it filed or claimed is added to ``made``."""
        cid = info.remote_cluster_id
        assert cid is not None  # LLMDataDist checked it
        if self._links.ours(cid):
            return Code.LLM_ALREADY_LINK
        if not self._links.begin(cid):
            return Code.LLM_PROCESSING_LINK
        try:
            if self._links.get(cid) is not None:  # the peer linked to us first: that is it
                self._links.claim([cid])
                made.append((cid, None))
                return Code.LLM_SUCCESS
            if not info.remote_ip_info:
                self._failed(cid, "no remote_ip_info: call append_remote_ip_info(ip, port)")
                return Code.LLM_LINK_FAILED
            attempts = self._config.link_retry_count
            link = await self._connect(cid, info.remote_ip_info, deadline, attempts)
            if isinstance(link, str):
                self._failed(cid, link)
                return Code.LLM_LINK_FAILED
            self._links.add(link, ours=True)
            made.append((cid, link))
            return Code.LLM_SUCCESS
        finally:
            self._links.end(cid)

    def _failed(self, cid: int, reason: str) -> None:
        """Linking ``cid`` failed for good: one WARNING, and the reason kept for
        :meth:`LLMDataDist.link_failure` and the next operation on that cluster."""
        log.warning("linking cluster %d failed: %s", cid, reason)
        self._links.failed(cid, reason)

    async def _connect(
        self, cid: int, addresses: Sequence[tuple[str, int]], deadline: float, attempts: int
    ) -> Link | str:
        """A link to cluster ``cid``: up to ``attempts`` rounds over ``addresses``, the
        rounds spread evenly until ``deadline``. When every round failed, or an address
        answered as another cluster, why (the last failure), as a sentence.

        Each failed attempt is one DEBUG line (no traceback: an expected failure); the
        caller logs the end once."""
        why = "the time ran out before a first attempt"
        for attempt in range(attempts):
            now = time.monotonic()
            if now >= deadline:
                break
            round_end = now + (deadline - now) / (attempts - attempt)
            for host, port in addresses:
                left = round_end - time.monotonic()
                if left <= 0:
                    break
                try:
                    link = await self._transport.connect(host, port, timeout=left)
                except LLMException as exc:
                    why = str(exc) if f"{host}:{port}" in str(exc) else f"{host}:{port}: {exc}"
                    log.debug("link to cluster %d, try %d: %s", cid, attempt + 1, why)
                    continue
                if link.broken:  # ended before connect returned (the peer closed it):
                    # its end is reported already; filed, it would never be unfiled
                    why = f"{host}:{port}: the link ended as it was made ({link.why_broken})"
                    log.debug("link to cluster %d, try %d: %s", cid, attempt + 1, why)
                    continue
                if link.peer.cluster_id == cid:
                    return link
                await self._close([link])
                return (
                    f"{host}:{port} is cluster {link.peer.cluster_id}, not {cid}: check "
                    "remote_cluster_id and remote_ip_info"
                )
            if attempt + 1 < attempts:
                await asyncio.sleep(max(0.0, round_end - time.monotonic()))
        return f"{attempts} attempt(s) within the timeout failed; the last: {why}"

    async def unlink_all(
        self, infos: list[LLMClusterInfo], timeout_ms: int, force: bool
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink each cluster within ``timeout_ms``: ``(overall, per_cluster)``.

        Without ``force`` this side's requests in flight to a cluster may end first; if
        they do not within the timeout, that cluster stays linked (``LLM_UNLINK_FAILED``).
        With ``force`` they fail at once.
        """
        deadline = time.monotonic() + timeout_ms / 1000
        codes = []
        for info in infos:
            cid = info.remote_cluster_id
            assert cid is not None  # LLMDataDist checked it
            if not force:
                try:
                    async with asyncio.timeout_at(self._loop_time(deadline)):
                        await self._links.drained(cid)
                except TimeoutError:
                    log.warning("unlink %d: requests still in flight after the timeout", cid)
                    codes.append(Code.LLM_UNLINK_FAILED)
                    continue
            await self._unlink_cluster(cid)
            codes.append(Code.LLM_SUCCESS)
        return _overall(codes), codes

    async def _unlink_cluster(self, cid: int) -> None:
        """Close every connection to ``cid``, whoever opened it. Not cancellable once
        begun (the link is unfiled at once): a cancellation is delivered after the last
        connection closed, never leaving one open and the cluster listed as unlinked."""
        filed = self._links.unlinked(cid)
        links = [x for x in self._transport.links() if x.peer.cluster_id == cid]
        if filed is not None and filed not in links:
            links.append(filed)
        await completing(self._close(links))

    async def _close(self, links: list[Link]) -> None:
        for link in links:
            if self._before_close is not None and not link.broken:
                await self._before_close(link)
            await link.aclose()

    @staticmethod
    def _loop_time(deadline: float) -> float:
        """``time.monotonic()`` deadline → the running loop's clock."""
        loop = asyncio.get_running_loop()
        return loop.time() + (deadline - time.monotonic())

    # ---- link / query_register_mem_status / unlink --------------------------------------
    def link(self, parties: list[Party]) -> int:
        """Start linking a communicator with ``parties``; its id.

        Raises:
            LLMException: ``LLM_ALREADY_LINK`` when this side already linked one of the
                parties (or a communicator holds it), ``LLM_PROCESSING_LINK`` while a
                ``link_clusters`` call links one.
        """
        op = "link"
        cids = [p.cluster_id for p in parties]
        for cid in cids:
            if self._links.ours(cid) or any(
                cid in (q.cluster_id for q in c.parties) for c in self._comms.values()
            ):
                raise LLMException(
                    f"{op}: cluster {cid} is already linked", status_code=Code.LLM_ALREADY_LINK
                )
        for i, cid in enumerate(cids):
            if not self._links.begin(cid):
                for done in cids[:i]:
                    self._links.end(done)
                raise LLMException(
                    f"{op}: cluster {cid} is being linked", status_code=Code.LLM_PROCESSING_LINK
                )
        self._links.hold(cids)
        comm_id = next(self._ids)
        comm = self._comms[comm_id] = _Comm(parties)
        comm.task = asyncio.get_running_loop().create_task(
            self._run_comm(comm_id, comm), name=f"aiokv-link-{comm_id}"
        )
        return comm_id

    async def _run_comm(self, comm_id: int, comm: _Comm) -> None:
        total = self._config.link_total_time or COMM_TIMEOUT_S
        deadline = time.monotonic() + total
        cids = [p.cluster_id for p in comm.parties]
        try:
            async with asyncio.timeout(total), asyncio.TaskGroup() as group:
                for party in comm.parties:
                    group.create_task(self._comm_party(party, deadline))
        except* (TimeoutError, LLMException) as failed:
            comm.status = RegisterMemStatus.FAILED
            reasons = "; ".join(
                str(e) or f"not all parties linked within {total:g} s (link_total_time)"
                for e in failed.exceptions
            )
            for cid in cids:
                if self._links.live(cid) is None and self._links.failure(cid) is None:
                    self._links.failed(cid, f"link {comm_id} failed: {reasons}")
            log.warning("link %d with clusters %s failed: %s", comm_id, cids, reasons)
            for cid in cids:
                await self._unlink_cluster(cid)
        else:
            comm.status = RegisterMemStatus.OK
            self._links.claim(cids)
            log.info("link %d with clusters %s is up", comm_id, cids)
        finally:
            self._links.release(cids)
            for cid in cids:
                self._links.end(cid)

    async def _comm_party(self, party: Party, deadline: float) -> None:
        """Up to ``deadline``: connect to a lower rank, or wait for a higher rank's link."""
        cid = party.cluster_id
        if party.address is None or self._links.live(cid) is not None:
            await self._links.wait_live(cid)
            return
        attempts = max(1, round((deadline - time.monotonic()) / COMM_RETRY_S))
        link = await self._connect(cid, [party.address], deadline, attempts)
        if isinstance(link, str):
            self._links.failed(cid, link)
            raise LLMException(
                f"link: cluster {cid} was not reached: {link}", status_code=Code.LLM_LINK_FAILED
            )
        self._links.add(link, ours=True)

    def status(self, comm_id: int) -> RegisterMemStatus:
        """The state of communicator ``comm_id``.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` for an unknown ``comm_id``.
        """
        return self._comm("query_register_mem_status", comm_id).status

    async def unlink(self, comm_id: int) -> None:
        """Stop linking / close the links of communicator ``comm_id`` and forget it.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` for an unknown ``comm_id``.
        """
        comm = self._comm("unlink", comm_id)
        if comm.task is not None and not comm.task.done():
            comm.task.cancel()
            # not cancellable from here on: a communicator stopped is forgotten, never
            # left listed as linking (PREPARING) with nothing linking it any more
            await completing(asyncio.wait([comm.task]))
        del self._comms[comm_id]
        for party in comm.parties:
            await self._unlink_cluster(party.cluster_id)

    def _comm(self, op: str, comm_id: int) -> _Comm:
        comm = self._comms.get(comm_id)
        if comm is None:
            raise LLMException(
                f"{op}: no link with comm_id {comm_id}", status_code=Code.LLM_PARAM_INVALID
            )
        return comm

    async def aclose(self) -> None:
        """Stop every communicator still linking (``finalize``)."""
        tasks = [c.task for c in self._comms.values() if c.task is not None and not c.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._comms.clear()

    def linking(self) -> bool:
        """Whether a communicator is still linking."""
        return any(c.status is RegisterMemStatus.PREPARING for c in self._comms.values())
