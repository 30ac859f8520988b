"""Which chunks a load can take now, and from which tier (the planner's lookup).

Pure over its collaborators: reads the CPU index and the disk index, asks the remote
tier through a callable, mutates nothing. ``hits_discarded`` says for which requests
vLLM throws the connector's answer away, so that they are not looked up at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kv_offload.keys import ChunkKey
from kv_offload.scheduler.cpu_index import CpuHit, CpuIndex
from kv_offload.scheduler.disk_tier import DiskTier
from kv_offload.scheduler.tails import TailIndex, longest_shared, tail_seed
from kv_offload.scheduler.tiers import DiskEntryLike


class Source(NamedTuple):
    """Where one chunk of a loadable run comes from: a CPU hit, a disk entry, or the
    remote tier (a NamedTuple: built per chunk on every lookup)."""

    key: ChunkKey
    cpu: CpuHit | None = None
    disk: DiskEntryLike | None = None
    remote: bool = False
    tail: bool = False  # a request tail (tails.py), not a chunk


def hits_discarded(request: Any) -> bool:
    """Whether vLLM sets this request's external hits to 0 after asking the connector
    (it still asks): requests that must not read cached KV, such as those asking for
    ``prompt_logprobs``. vLLM 0.34 says so with ``Request.skip_reading_external_kv``
    (also for a ``prompt_logprob_start`` that lets them reuse vLLM's own prefix cache);
    0.32 and 0.33 with ``Request.skip_reading_prefix_cache``. Read by attribute, not by
    version; a request with neither (tests' fakes) reads cached KV."""
    discarded = getattr(request, "skip_reading_external_kv", None)
    if discarded is None:
        discarded = getattr(request, "skip_reading_prefix_cache", False)
    return bool(discarded)


def first_chunk_held(cpu: CpuIndex, block_hashes: Sequence[bytes], num_tokens: int, *,
                     chunk_tokens: int, tokens_per_hash: int) -> bool:
    """Whether a load could start with the first chunk of a request of ``num_tokens``
    tokens with these block hashes: the CPU tier holds it (READY or STAGING) and it ends
    before the request's last token (a load leaves one to compute). O(1), read-only.

    The chunk's key is the block hash that ends it, chained over everything before it
    (tokens, ``cache_salt``, LoRA, multimodal inputs: ``keys.py``), and the CPU index
    holds one namespace, so a salted or other-adapter request never matches another's
    entry. vLLM's own prefix cache may hold the chunk too: then the load, if any, starts
    later in the prompt, and this answer is only a likelihood."""
    hashes_per_chunk = chunk_tokens // tokens_per_hash
    if num_tokens - 1 < chunk_tokens or len(block_hashes) < hashes_per_chunk:
        return False
    return cpu.hit(bytes(block_hashes[hashes_per_chunk - 1])) is not None


def loadable_run(cpu: CpuIndex, disk: DiskTier, keys: Sequence[ChunkKey], first: int,
                 remote_hits: Callable[[int], int]) -> list[Source]:
    """The chunks of ``keys[first:]`` a load can take now, each with its tier: the
    longest run held by the CPU tier (READY or STAGING), the disk or the remote tier,
    cut where no CPU slot is left to stage a disk or remote chunk into, so a hit
    reported to vLLM can always be staged and pinned. ``remote_hits(start)``: how many
    chunks from ``keys[start]`` on the remote tier holds. Read-only."""
    run = _local_run(cpu, disk, keys[first:])
    start = first + len(run)
    if len(run) == len(keys) - first or cpu.state(keys[start]) is not None:
        return within_staging_budget(cpu, run)  # the end, or a STORING chunk: the run ends
    for key in keys[start:start + remote_hits(start)]:
        hit = cpu.hit(key)
        if hit is None and key in cpu:
            break
        run.append(Source(key, hit, None, hit is None))
    return within_staging_budget(cpu, run)


def _local_run(cpu: CpuIndex, disk: DiskTier, keys: Sequence[ChunkKey]) -> list[Source]:
    """Leading chunks of ``keys`` in the CPU tier or, for those the CPU tier lacks, on
    disk (a CPU entry past a CPU miss is used as it is: never staged twice)."""
    hits = cpu.hits(keys)
    if None not in hits:
        return [Source(h.key, h) for h in hits if h is not None]  # all are hits
    on_disk = disk.find_prefix([k for k, h in zip(keys, hits) if h is None])
    run: list[Source] = []
    num_disk = 0
    for key, hit in zip(keys, hits):
        if hit is not None:
            run.append(Source(key, hit))
        elif num_disk < len(on_disk):
            run.append(Source(key, None, on_disk[num_disk]))
            num_disk += 1
        else:
            break
    return run


def within_staging_budget(cpu: CpuIndex, run: list[Source]) -> list[Source]:
    """``run`` up to the first chunk that would find no CPU slot to stage into."""
    num_staged = sum(s.cpu is None for s in run)
    if num_staged <= cpu.num_free:
        return run
    budget = cpu.num_reservable(s.cpu for s in run if s.cpu is not None)
    for i, source in enumerate(run):
        if source.cpu is None:
            if budget == 0:
                return run[:i]
            budget -= 1
    return run


def final_chunk_key(request: Any, keys: Sequence[ChunkKey], chunk_tokens: int,
                    tokens_per_hash: int) -> ChunkKey | None:
    """The key of the whole chunk a request ends with (its tokens a multiple of the chunk),
    the one past ``keys`` (the chunks below its last token); else None."""
    end = (len(keys) + 1) * (chunk_tokens // tokens_per_hash)
    if request.num_tokens != (len(keys) + 1) * chunk_tokens or len(request.block_hashes) < end:
        return None
    return bytes(request.block_hashes[end - 1])


def partial_source(cpu: CpuIndex, disk: DiskTier, tails: TailIndex, request: Any,
                   keys: Sequence[ChunkKey], index: int, *, chunk_tokens: int,
                   tokens_per_hash: int,
                   remote_has: Callable[[ChunkKey], bool] | None = None
                   ) -> tuple[Source, int] | None:
    """Where tokens of chunk ``index`` (the first that the whole-chunk run from ``keys``
    lacks) can come from, and how many, short of the request's last token: that whole
    chunk when the request ends with it (``final_chunk_key``; CPU, disk or remote tier,
    ``remote_has`` telling from the remote tier's answer; its last token is left to
    compute), else the stored tail of the chunk before it that shares the most tokens
    with the request (CPU tier, ``tails.TailIndex``, or disk tier, ``tails_of``).
    Read-only."""
    start, limit = index * chunk_tokens, request.num_tokens - 1
    if limit <= start:
        return None
    key = final_chunk_key(request, keys, chunk_tokens, tokens_per_hash)
    if index == len(keys) and key is not None:
        hit = cpu.hit(key)
        if hit is not None:
            return Source(key, hit), limit - start
        on_disk = disk.find_prefix([key]) if key not in cpu else []
        if on_disk:
            return Source(key, None, on_disk[0]), limit - start
        if key not in cpu and remote_has is not None and remote_has(key):
            return Source(key, None, None, True), limit - start
    seed = tail_seed(request)
    if seed is None:
        return None
    tokens = request.all_token_ids[start:min(limit, start + chunk_tokens)]
    parent = keys[index - 1] if index else seed
    match = tails.best(parent, tokens, lambda key: cpu.hit(key) is not None)
    if match is not None and match.num_tokens == len(tokens):
        return Source(match.key, cpu.hit(match.key), tail=True), match.num_tokens
    stored = longest_shared(disk.tails_of(parent), tokens) if disk.enabled else None
    if stored is not None and (match is None or stored.num_tokens > match.num_tokens):
        hit = cpu.hit(stored.key)  # staged from the disk tier by an earlier load
        on_disk = disk.find_prefix([stored.key]) if hit is None and stored.key not in cpu else []
        if hit is not None or on_disk:
            return (Source(stored.key, hit, on_disk[0] if on_disk else None, tail=True),
                    stored.num_tokens)
    if match is None:
        return None
    return Source(match.key, cpu.hit(match.key), tail=True), match.num_tokens


def planned_again(found: tuple[list[Source], list[ChunkKey], int] | None,
                  keys: list[ChunkKey], first: int, end: int, *, chunk_tokens: int
                  ) -> tuple[list[Source], list[ChunkKey]]:
    """The sources and keys of a load of the tokens up to ``end`` (the lookup's answer),
    from ``found``: the run from chunk ``first`` planned again when the load is planned
    (the planner's ``_hit_run``: its sources, keys and the token it ends at; None while
    the remote tier's answer is pending, since a question asked anew then, the local run
    having changed since, is not waited for). ``keys``: the request's chunk keys.

    A run planned again that ends before ``end`` lost a source since the lookup (the
    disk tier may be shared: another engine evicted or dropped it) and may end in
    another partial source than the lookup's: a tail sharing fewer tokens, or one
    standing where a whole chunk was. Then only its whole chunks load and the rest are
    failed moves (vLLM recomputes them): that partial source would report tokens whose
    KV it does not hold (invariant 10)."""
    if found is None:
        return [], keys
    run, found_keys, covered = found
    if covered >= end:
        return run, found_keys
    return run[:covered // chunk_tokens - first], keys


class RemoteAsks:
    """The planner's questions to the remote tier: how many leading chunks of a request
    it holds. Never waits on the network: the tier's ``RemoteLookups`` asks the server
    on its own threads (started with the first question), within the lookup budget; the
    answer is memoised per request (``RequestState.remote``: vLLM asks again, next step,
    while a request waits). Counts lookups, their errors and time. ``on``: False after
    the connector's reset (``OffloadScheduler.reset_all``)."""

    def __init__(self, remote: Any, counters: Any, clock: Callable[[], float]) -> None:
        self.remote, self.counters, self._clock = remote, counters, clock
        self.on = remote is not None
        self._lookups: Any = None
        self._errors = 0

    def ask(self, state: Any, keys: Sequence[ChunkKey], start: int) -> int | None:
        """Leading chunks of ``keys[start:]`` the remote tier holds; None while pending."""
        if self.remote is None or not self.on or start >= len(keys):
            return 0
        memo = state.remote
        if memo is not None and memo[:2] == (start, len(keys)):
            return len(memo[2])
        if self._lookups is None:
            self._lookups = self.remote.async_lookups(clock=self._clock)
            self._errors = self.remote.health.num_failures
        began = self._clock()
        hits = self._lookups.ask(state.request.request_id, keys[start:])
        self.counters.seconds_remote_lookup += self._clock() - began
        if hits is None:
            return None
        self.counters.remote_lookups += 1
        # Failed round trips and answers past the budget since the last answer.
        errors = self._lookups.num_timeouts + self.remote.health.num_failures
        self.counters.remote_lookup_errors += max(0, errors - self._errors)
        self._errors = errors
        state.remote = (start, len(keys), frozenset(keys[start:start + hits]))
        return hits

    def forget(self, req_id: str) -> None:
        if self._lookups is not None:
            self._lookups.forget(req_id)

    def close(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
