"""Request tails on the remote tier: their records on the server, read and written off
the scheduler thread.

A tail's value is stored like a chunk's (``RemoteIO``: one host slot per rank, under
the tail key). Once every rank wrote it, its *record* goes to a hash per parent
(``values.tails_name``, inside the namespace): field = the tail key, value = when it was
written and the tail's token ids (``values.encode_tail_record``). ``TailWriter`` writes
records on a thread of its own (the scheduler thread never waits on the network);
``RemoteTails.tails_many`` answers a lookup thread's batch of "which tails do these
parents have" (``RemoteLookups`` with ``fetch=tails_many``; a question may name several
parents: ``RemoteIndex.expect_tails``).

Bounded like the CPU tier's ``TailIndex``: a new record supersedes the records of its
parent whose tokens it extends (the next turn of a conversation), and a parent keeps
at most ``MAX_TAILS_PER_PARENT``, the oldest (by its stamp) dropped past that. Several
engines may write one parent at once: their read-then-write may leave a record or two
past the cap for a while, never a wrong one. The hash gets the values' TTL
(``remote_ttl_s``) at each write, and the server's LRU may evict it apart from the
values: either way a tail is found only while its record and every rank's value are
there.

What a lookup trusts: a record whose token ids and parent make its key
(``tails.tail_key``; invariant 9) and whose value exists for every rank; anything else
is left out (one bad record costs one miss).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kv_offload.remote.values import decode_tail_record, encode_tail_record, tails_name
from kv_offload.scheduler.tails import MAX_TAILS_PER_PARENT, tail_key

logger = logging.getLogger(__name__)

Tail = tuple[bytes, tuple[int, ...]]  # (tail key, token ids)
TailRecord = tuple[bytes, bytes, tuple[int, ...]]  # (parent, tail key, token ids)
TailsByParent = dict[bytes, list[Tail]]  # one question's answer: parent -> its tails
_STOP = None


class CommandTier(Protocol):
    """What the tail records need of a ``RemoteTier``."""

    key_prefix: str
    namespace: str
    num_ranks: int
    ttl_s: int | None
    health: Any

    def name(self, chunk_key: bytes, rank: int) -> bytes: ...

    def pipeline(self, commands: Sequence[Sequence[Any]]) -> list[Any] | None: ...


class RemoteTails:
    """Reads and writes the tail records of one namespace. Thread-safe (each call is
    one or two ``RemoteTier.pipeline`` round trips); blocks: never on the scheduler
    thread."""

    def __init__(self, tier: CommandTier, *, max_per_parent: int = MAX_TAILS_PER_PARENT
                 ) -> None:
        self.tier = tier
        self.max_per_parent = max_per_parent

    def _name(self, parent: bytes) -> bytes:
        return tails_name(self.tier.key_prefix, self.tier.namespace, parent)

    def tails_many(self, questions: Sequence[Sequence[bytes]]) -> list[TailsByParent]:
        """For each question (parent keys), each parent's tails that are loadable now: a
        record that makes its key and a value for every rank; oldest first. Every parent
        of the batch in the same two round trips (the records, then the values'
        ``EXISTS``); {} (no tails for any parent) for every question on a failure."""
        asked = [[bytes(p) for p in q] for q in questions]
        parents = list(dict.fromkeys(p for q in asked for p in q))
        replies = self.tier.pipeline([(b"HGETALL", self._name(p)) for p in parents])
        if replies is None:
            return [{} for _ in asked]
        found = {parent: _trusted(parent, reply) for parent, reply in zip(parents, replies)}
        per = self.tier.num_ranks
        checks = [(b"EXISTS", *[self.tier.name(key, r) for r in range(per)])
                  for parent in parents for key, _ in found[parent]]
        counts = self.tier.pipeline(checks)
        if counts is None:
            return [{} for _ in asked]
        present = iter(int(c) == per for c in counts)
        loadable = {parent: [tail for tail in found[parent] if next(present)]
                    for parent in parents}
        return [{parent: loadable[parent] for parent in q} for q in asked]

    def write(self, records: Sequence[TailRecord], *, stamp: int) -> bool:
        """Record tails whose values every rank wrote: per parent, the new records
        written, those they supersede and the oldest past the cap deleted, the TTL
        renewed. Two round trips; False on a failure (the tails are not found: a miss)."""
        by_parent: dict[bytes, dict[bytes, tuple[int, ...]]] = {}
        for parent, key, tokens in records:
            by_parent.setdefault(parent, {})[key] = tuple(tokens)
        parents = list(by_parent)
        names = [self._name(p) for p in parents]
        replies = self.tier.pipeline([(b"HGETALL", n) for n in names])
        if replies is None:
            return False
        commands: list[tuple[Any, ...]] = []
        for name, parent, reply in zip(names, parents, replies):
            new = by_parent[parent]
            old = _records(reply)
            gone = self._superseded(old, new)
            if gone:
                commands.append((b"HDEL", name, *gone))
            fields: list[bytes] = []
            for key, tokens in new.items():
                fields += [key, encode_tail_record(stamp, tokens)]
            commands.append((b"HSET", name, *fields))
            if self.tier.ttl_s:
                commands.append((b"EXPIRE", name, b"%d" % self.tier.ttl_s))
        return self.tier.pipeline(commands) is not None

    def _superseded(self, old: dict[bytes, tuple[int, tuple[int, ...]]],
                    new: dict[bytes, tuple[int, ...]]) -> list[bytes]:
        """The fields of ``old`` to delete for ``new``: those a new tail extends, then the
        oldest past ``max_per_parent``."""
        gone = [key for key, (_, tokens) in old.items() if key not in new
                and any(t[:len(tokens)] == tokens for t in new.values())]
        kept = sorted((stamp, key) for key, (stamp, _) in old.items()
                      if key not in new and key not in gone)
        excess = len(kept) + len(new) - self.max_per_parent
        return gone + [key for _, key in kept[:max(0, excess)]]


def _records(reply: Any) -> dict[bytes, tuple[int, tuple[int, ...]]]:
    """An ``HGETALL`` reply (RESP2: field, value, ...) as tail key -> (stamp, tokens),
    leaving out what does not decode."""
    out = {}
    items = list(reply or ())
    for key, value in zip(items[::2], items[1::2]):
        record = decode_tail_record(bytes(value))
        if record is not None:
            out[bytes(key)] = record
    return out


def _trusted(parent: bytes, reply: Any) -> list[Tail]:
    """The records of ``reply`` whose parent and tokens make their key, oldest first."""
    records = _records(reply)
    ordered = sorted(records.items(), key=lambda item: (item[1][0], item[0]))
    return [(key, tokens) for key, (_, tokens) in ordered if tail_key(parent, tokens) == key]


class TailWriter:
    """Writes tail records on a thread of its own (started with the first ``put``).

    ``put`` belongs to the scheduler thread and never blocks (a ``SimpleQueue``); the
    thread writes everything queued meanwhile in one ``RemoteTails.write``. ``clock``
    stamps the records (ns since the epoch: comparable across engines)."""

    def __init__(self, tails: RemoteTails, *,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.tails = tails
        self._clock = clock
        self._queue: queue.SimpleQueue[TailRecord | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._done = threading.Condition()
        self.num_queued = 0  # scheduler thread
        self.num_written = 0  # records handled (written or failed), writer thread
        self.num_failed = 0  # records a failed write lost, writer thread

    def put(self, records: Sequence[TailRecord]) -> None:
        if not records:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="kv-offload-tail-writer")
            self._thread.start()
        self.num_queued += len(records)
        for record in records:
            self._queue.put(record)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while not self._queue.empty() and len(batch) < 256:
                batch.append(self._queue.get_nowait())
            stop = _STOP in batch
            records = [r for r in batch if r is not None]
            ok = True
            if records:
                try:
                    ok = self.tails.write(records, stamp=self._clock())
                except Exception:  # a bug, not a server problem: those tails are misses
                    logger.exception("kv-offload: writing remote tail records raised")
                    ok = False
            with self._done:
                self.num_written += len(records)
                self.num_failed += 0 if ok else len(records)
                self._done.notify_all()
            if stop:
                return

    def wait(self, timeout_s: float) -> bool:
        """Block until every queued record was handled, up to ``timeout_s``; whether it
        was (tests, ``close``)."""
        with self._done:
            return self._done.wait_for(lambda: self.num_written >= self.num_queued,
                                       timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (up to ``timeout_s``), then stop the thread."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
