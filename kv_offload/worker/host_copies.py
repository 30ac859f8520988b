"""HostCopies: a worker's engine -> host copies in flight, per request (invariant 3).

The step never waits for its stores: a copy runs behind the forward (on a CUDA stream,
or on a store thread of its own on vLLM's CPU backend) and its engine blocks stay safe
because they are never freed under it:

- a request that finishes while copies of its blocks run is *held* by the scheduler
  (vLLM keeps its blocks); ``hold`` names it here, and ``take_sent`` reports it once
  this rank's copies of its blocks are done (vLLM's ``finished_sending``);
- a preempted request's blocks are freed at once and may be rewritten by this step's
  forward: ``fence`` orders that forward after its copies (GPU-side on CUDA).

Blocks of running requests are never rewritten, so nothing else waits. vLLM's worker
thread only (the store thread only runs copies).

What must follow a copy (the tier writes of its host slots) is started by ``when_done``
once the copy has ended, so that no I/O thread ever waits for a device copy: at once for
a copy that is done, on the store thread that ends it, else on one waiter thread that
sleeps on the copies' completion events in issue order (a copy stream completes in order).

While vLLM has taken the KV cache away (``pause``, from ``unregister_kv_caches``) no copy
runs: ``pause`` waits for every copy issued before it, and a copy issued during the
pause fails at once with ``KVCacheReleasedError`` (its job is reported failed, its slots
come back) until ``resume``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from kv_offload.copy.base import CopyEngine, CopyHandle

logger = logging.getLogger(__name__)


class KVCacheReleasedError(RuntimeError):
    """A store copy issued while vLLM has taken the KV cache away (``HostCopies.pause``):
    nothing was copied."""


class ComputedOnFailedLoadError(RuntimeError):
    """A store job of a step whose forward read a same-step load that failed: its blocks
    may hold KV computed on wrong KV (vLLM recomputes them), so nothing is copied."""


class StoreThread(Protocol):
    """Where background store copies, or waits for copies, run: a one-thread pool (or a
    test's executor)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future: ...

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None: ...


class CopyCheck(Protocol):
    """What else must end before a copy counts as done, and may fail it: the runtime
    audit's re-read of the copied blocks (``worker/audit.py``, ``StoreCheck``)."""

    def done(self) -> bool: ...

    def failed(self) -> bool: ...

    def wait(self) -> None: ...

    def fence(self) -> None: ...


class StoreAuditor(Protocol):
    """Starts a ``CopyCheck`` for some store copies (``worker/audit.py``, ``CopyAudit``)."""

    def check_store(self, wait_copy: Callable[[], None], block_ids: np.ndarray,
                    slots: np.ndarray) -> CopyCheck | None: ...


class HostCopy:
    """One engine -> host copy: the future of an engine handle (done at once when the
    engine's ``store`` ran on the calling thread), and its ``check`` if it is audited
    (done, failed, waited for and fenced with it). ``wait`` raises what the copy, or its
    check, raised."""

    __slots__ = ("_check", "_engine", "_future")

    def __init__(self, engine: CopyEngine, future: Future[CopyHandle],
                 check: CopyCheck | None = None) -> None:
        self._engine, self._future, self._check = engine, future, check

    def done(self) -> bool:
        """Finished, successfully or not (never blocks)."""
        if not self._future.done():
            return False
        if self._future.exception() is None and not self._engine.is_done(self._future.result()):
            return False
        return self._check is None or self._check.done()

    def failed(self) -> bool:
        """Done with an error (the host slots hold no chunk, or not the right one). Never
        blocks."""
        if self._future.done() and self._future.exception() is not None:
            return True
        return self._check is not None and self._check.failed()

    def when_issued(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the copy is issued (or failed to be): at once on the calling
        thread, or on the store thread that issues it."""
        self._future.add_done_callback(lambda _: fn())

    def wait(self) -> None:
        """Block until the bytes are in the host slots; raises if the copy failed."""
        self._engine.wait(self._future.result())
        if self._check is not None:
            self._check.wait()

    def fence(self) -> None:
        """Make later compute on the calling thread's stream start after this copy
        (GPU-side with streams; a host wait otherwise), and stop its check. Never raises."""
        if self._check is not None:
            self._check.fence()
        if self._future.exception() is not None:  # waits for a background copy
            return  # a failed copy reads no block any more
        self._engine.fence(self._future.result())


class HostCopies:
    """Issues store copies and tracks them per request (see the module docstring).

    ``background``: run each copy on a store thread of its own (engines whose copies
    complete inside ``store``, i.e. vLLM's CPU backend), so ``issue`` returns at once;
    ``initializer`` runs on that thread, and on the waiter thread, first
    (``ThreadPlacement.background``). ``audit``: checks a sample of the copies, each
    part of its copy (a held request waits for it, ``fence`` stops it). ``waiter``:
    where ``when_done`` waits for copies that run on after ``store`` returned (CUDA
    streams); default a thread of its own, started on first use.
    """

    def __init__(self, engine: CopyEngine, *, background: bool,
                 initializer: Callable[[], None] | None = None,
                 waiter: StoreThread | None = None, audit: StoreAuditor | None = None) -> None:
        self.engine = engine
        self._audit = audit
        self._thread: StoreThread | None = (
            ThreadPoolExecutor(1, thread_name_prefix="kv-offload-store", initializer=initializer)
            if background else None)
        self._waiter: StoreThread = waiter or ThreadPoolExecutor(
            1, thread_name_prefix="kv-offload-store-wait", initializer=initializer)
        self._by_req: dict[str, list[HostCopy]] = {}
        self._held: set[str] = set()
        self._issued: list[HostCopy] = []  # every copy not yet seen done, in issue order
        self._paused = False

    def issue(self, block_ids: np.ndarray, slots: np.ndarray, req_ids: Iterable[str], *,
              audited: bool = True) -> HostCopy:
        """Start copying ``block_ids`` into ``slots`` (the engine's ``store``), ordered
        after the compute issued so far; the blocks belong to ``req_ids``. While paused,
        a copy that failed with ``KVCacheReleasedError`` (no block is read).
        ``audited``: False keeps the runtime audit off this copy (``StoreJob.audited``)."""
        if self._paused:
            return self.refused(KVCacheReleasedError(
                "vLLM released the KV cache (unregister_kv_caches): nothing was copied"))
        if self._thread is None:
            future: Future[CopyHandle] = Future()
            try:
                future.set_result(self.engine.store(block_ids, slots))
            except Exception as exc:  # reported as a failed copy, never raised into vLLM
                future.set_exception(exc)
        else:
            future = self._thread.submit(self.engine.store, block_ids, slots)
        check = None
        if self._audit is not None and audited:  # it re-reads blocks the requests hold
            check = self._audit.check_store(lambda: self.engine.wait(future.result()),
                                            block_ids, slots)
        copy = HostCopy(self.engine, future, check)
        for req in set(req_ids):
            self._by_req.setdefault(req, []).append(copy)
        self._issued = [c for c in self._issued if not c.done()]
        self._issued.append(copy)
        return copy

    def refused(self, reason: Exception) -> HostCopy:
        """A copy that failed with ``reason`` before reading any block."""
        failed: Future[CopyHandle] = Future()
        failed.set_exception(reason)
        return HostCopy(self.engine, failed)

    def when_done(self, copy: HostCopy, fn: Callable[[bool], None]) -> None:
        """Call ``fn(ok)`` once ``copy`` has ended, ``ok`` whether its bytes are in the host
        slots: at once when it has, else on the store thread that ends it or the waiter
        thread (never an I/O thread). ``fn`` must be quick and never raise (it is logged)."""
        def issued() -> None:
            try:
                done, failed = copy.done(), copy.failed()
            except Exception as exc:  # the engine's query failed (a device error)
                logger.warning("kv-offload: cannot tell whether a store copy ended (%s); "
                               "its chunks are not written", exc)
                _call(fn, False)  # settled: the job is reported, its slots released
                return
            if done:
                _call(fn, not failed)
                return
            try:
                self._waiter.submit(_wait_then, copy, fn)
            except RuntimeError:  # closed (a copy issued during close): wait here
                _wait_then(copy, fn)

        copy.when_issued(issued)

    def fence(self, req_ids: Iterable[str]) -> None:
        """Order the next forward after every copy of these requests' blocks."""
        for req in req_ids:
            for copy in self._by_req.pop(req, ()):
                copy.fence()

    def hold(self, req_ids: Iterable[str]) -> None:
        """The scheduler held these finished requests: report each in ``take_sent``
        once this rank's copies of its blocks are done."""
        self._held.update(req_ids)

    def take_sent(self) -> set[str]:
        """Held requests whose copies are all done (each returned once); forgets done
        copies."""
        for req in list(self._by_req):
            pending = [c for c in self._by_req[req] if not c.done()]
            if pending:
                self._by_req[req] = pending
            else:
                del self._by_req[req]
        sent = {req for req in self._held if req not in self._by_req}
        self._held -= sent
        return sent

    def num_pending(self) -> int:
        """Requests with copies in flight or held."""
        return len(self._by_req.keys() | self._held)

    def pause(self) -> None:
        """vLLM takes the KV cache away: block until every copy issued so far (and its
        audit check) has ended, well or not; until ``resume``, ``issue`` copies nothing.
        Held requests are then reported by ``take_sent``. Idempotent."""
        self._paused = True
        issued, self._issued = self._issued, []
        for copy in issued:
            try:
                copy.wait()
            except Exception:  # a failed copy reads no block any more (reported by its job)
                continue

    def resume(self, engine: CopyEngine | None = None,
               audit: StoreAuditor | None = None) -> None:
        """Copy again after ``pause``: with ``engine`` (and its ``audit``) over the restored
        tensors when vLLM gave them back elsewhere, else with the same ones."""
        if engine is not None:
            self.engine, self._audit = engine, audit
        self._paused = False

    def close(self) -> None:
        """Let copies already issued finish, and what ``when_done`` queued behind them
        start; no new ones."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self._waiter.shutdown(wait=True)


def _wait_then(copy: HostCopy, fn: Callable[[bool], None]) -> None:
    """Wait for ``copy`` to end, then ``fn(ok)`` (the waiter thread)."""
    try:
        copy.wait()
    except Exception as exc:
        logger.warning("kv-offload: an engine copy of stored chunks failed: %s", exc)
        _call(fn, False)
    else:
        _call(fn, True)


def _call(fn: Callable[[bool], None], ok: bool) -> None:
    try:
        fn(ok)
    except Exception:  # a bug: the chunks are not written, nothing else is affected
        logger.exception("kv-offload: queueing the writes of stored chunks failed")
