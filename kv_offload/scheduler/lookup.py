"""Which chunks a load can take now, and from which tier (the planner's lookup).

Pure over its collaborators: reads the CPU index and asks the secondary tiers
(``tier_contract.SecondaryTier``) in their order, mutates nothing but the tiers' memos.
``hits_discarded`` says for which requests vLLM throws the connector's answer away, so
that they are not looked up at all.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, NamedTuple

from kv_offload.keys import ChunkKey
from kv_offload.scheduler.cpu_index import CpuHit, CpuIndex
from kv_offload.scheduler.tails import TailIndex, longest_shared, tail_seed
from kv_offload.tier_contract import Place, SecondaryTier


class Source(NamedTuple):
    """Where one chunk of a loadable run comes from: a CPU hit, or the place of a
    secondary tier to stage it from (a NamedTuple: built per chunk on every lookup)."""

    key: ChunkKey
    cpu: CpuHit | None = None
    place: Place | None = None
    tail: bool = False  # a request tail (tails.py), not a chunk
    # A tail staged from a secondary tier: (its parent, all its token ids), for the
    # earlier tiers that keep tails and take fills (``SecondaryTier.note_tail``).
    tail_of: tuple[bytes, tuple[int, ...]] | None = None


class Pending(enum.Enum):
    """A tier's answer is not known yet: vLLM asks again next step."""

    PENDING = "pending"


PENDING = Pending.PENDING


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


def loadable_run(cpu: CpuIndex, tiers: Sequence[SecondaryTier], asker: str,
                 keys: Sequence[ChunkKey], first: int) -> list[Source] | None:
    """The chunks of ``keys[first:]`` a load can take now, each with its tier: the
    longest run held by the CPU tier (READY or STAGING) or, for the chunks it lacks, by
    the secondary tiers (each asked, in order, for the chunks no tier before it holds:
    ``tier_run``), cut where no CPU slot is left to stage a chunk into, so a hit
    reported to vLLM can always be staged and pinned. None while a tier's answer is
    pending (``asker`` asks again next step)."""
    run = tier_run(cpu, tiers, asker, keys[first:])
    return None if run is None else within_staging_budget(cpu, run)


def tier_run(cpu: CpuIndex, tiers: Sequence[SecondaryTier], asker: str,
             keys: Sequence[ChunkKey]) -> list[Source] | None:
    """The leading chunks of ``keys`` held by the CPU tier or a secondary tier (a CPU
    entry past a CPU miss is used as it is: never staged twice). A chunk the CPU tier
    holds in another state (STORING: it is READY soon) ends the run. None while a tier's
    answer is pending."""
    hits = cpu.hits(keys)
    if None not in hits:  # every chunk in the CPU tier: the common hit, no tier asked
        return [Source(h.key, h) for h in hits if h is not None]
    missing: list[int] = []  # positions a secondary tier may fill
    for i, (key, hit) in enumerate(zip(keys, hits)):
        if hit is None:
            if key in cpu:
                break
            missing.append(i)
    places: dict[int, Place] = {}
    for tier in tiers:
        if not missing:
            break
        if not tier.enabled:
            continue
        found = tier.find(asker, [keys[i] for i in missing])
        if found is None:
            return None
        places.update(zip(missing, found))
        missing = missing[len(found):]
    run: list[Source] = []
    for i, (key, hit) in enumerate(zip(keys, hits)):
        if hit is not None:
            run.append(Source(key, hit))
        elif i in places:
            run.append(Source(key, None, places[i]))
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


def tail_source(cpu: CpuIndex, tiers: Sequence[SecondaryTier], tails: TailIndex,
                request: Any, keys: Sequence[ChunkKey], index: int, *, chunk_tokens: int
                ) -> tuple[Source, int] | None | Pending:
    """Where tokens of chunk ``index`` (the first that the whole-chunk run from ``keys``
    lacks) can come from, and how many, short of the request's last token: the stored
    tail of the chunk before it that shares the most tokens with the request (CPU tier,
    ``tails.TailIndex``, or a secondary tier that keeps tails, ``tails_of``, then
    ``find``, both as ``tail_asker``). ``PENDING`` while such a tier's answer is pending
    (the remote tier's: asked off the scheduler thread). Read-only but for the tiers'
    memos."""
    start, limit = index * chunk_tokens, request.num_tokens - 1
    seed = tail_seed(request)
    if limit <= start or seed is None:
        return None
    tokens = request.all_token_ids[start:min(limit, start + chunk_tokens)]
    parent = keys[index - 1] if index else seed
    match = tails.best(parent, tokens, lambda key: cpu.hit(key) is not None)
    best = None if match is None else (Source(match.key, cpu.hit(match.key), tail=True),
                                       match.num_tokens)
    for tier in tiers:
        if best is not None and best[1] == len(tokens):
            break
        if not (tier.enabled and tier.keeps_tails):
            continue
        asker = tail_asker(request.request_id)
        held = tier.tails_of(asker, parent)
        if held is None:
            return PENDING
        stored = longest_shared(held, tokens)
        if stored is None or (best is not None and stored.num_tokens <= best[1]):
            continue
        hit = cpu.hit(stored.key)  # staged from the tier by an earlier load
        if hit is not None:
            best = Source(stored.key, hit, tail=True), stored.num_tokens
        elif stored.key not in cpu:
            found = tier.find(asker, [stored.key])
            if found is None:
                return PENDING
            if found:
                tail_of = parent, tuple(dict(held)[stored.key])
                best = (Source(stored.key, None, found[0], tail=True, tail_of=tail_of),
                        stored.num_tokens)
    return best


def likely_tail_parents(request: Any, keys: Sequence[ChunkKey], first: int, *,
                        chunk_tokens: int) -> list[bytes]:
    """The parents whose tails ``tail_source`` asks for if the run from chunk ``first``
    ends on a complete miss (``keys[first - 1]``, or the request's ``tail_seed`` when
    ``first`` is 0) or on a full hit of ``keys`` (``keys[-1]``), each where tokens would
    be left to serve before the request's last token; [] for a request without tails.
    Read-only."""
    seed = tail_seed(request)
    if seed is None:
        return []
    limit = request.num_tokens - 1
    return [keys[index - 1] if index else seed
            for index in dict.fromkeys((first, len(keys)))
            if index <= len(keys) and index * chunk_tokens < limit]


def expect_tails(tiers: Sequence[SecondaryTier], request: Any, keys: Sequence[ChunkKey],
                 first: int, *, chunk_tokens: int) -> None:
    """Tell the tiers that keep tails which parents ``tail_source`` will likely ask
    (``likely_tail_parents``), as ``tail_asker``: called while the request's chunk
    question is pending, so that the remote tier asks for both in the same step and a
    run that ends at either parent waits one step, not two
    (``SecondaryTier.expect_tails``). A run that ends in between asks its parent's tails
    afterwards (one step more). Mutates only the tiers' memos."""
    parents = likely_tail_parents(request, keys, first, chunk_tokens=chunk_tokens)
    if not parents:
        return
    asker = tail_asker(request.request_id)
    for tier in tiers:
        if tier.enabled and tier.keeps_tails:
            tier.expect_tails(asker, parents)


def tail_asker(req_id: str) -> str:
    """Who asks a tier for a request's tail: not the request itself, whose question about
    its whole chunks a tier may be keeping (``SecondaryTier.find``)."""
    return f"{req_id}/tail"


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
