"""OffloadScheduler: the scheduler-side brain (lookups, load and store planning, pins).

Pure logic: imports neither torch nor vLLM, nor any secondary tier: the disk and remote
tiers (and a test's) are injected as ``tier_contract.SecondaryTier``, in order. It sees
requests through ``RequestLike`` (``request_id``, ``block_hashes``, ``num_tokens``,
``num_prompt_tokens``) and engine block ids through an injected callable, so it is
unit-tested with fakes. Its parts: ``lookup`` (which chunks a load can take),
``LoadPlanner`` and ``StorePlanner`` (jobs and their records), ``CpuIndex`` (the CPU
tier's slots and pins, the primary tier).

While a worker reports that vLLM has taken its KV cache away (``WorkerReport.paused``,
``unregister_kv_caches``) nothing is loaded or stored: lookups answer 0 and no store is
planned until every rank reported it back (``restore_kv_caches``). The tiers keep their
chunks; jobs already handed out complete as the workers report them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kv_offload.counters import SchedulerCounters
from kv_offload.groups import ChunkMap, KVGroup, UnservableChunkError
from kv_offload.jobs import SKIP_BLOCK, StepPlan, WorkerReport
from kv_offload.keys import ChunkKey, chunk_keys
from kv_offload.scheduler.cpu_index import CpuIndex
from kv_offload.scheduler.events import TierEvents
from kv_offload.scheduler.holds import (
    BlockHolds,
    BlockTables,
    block_tables,
    sources_freed,
    window_sources_of,
)
from kv_offload.scheduler.hook_guard import HookGuard
from kv_offload.scheduler.loads import LoadPlanner
from kv_offload.scheduler.lookup import (
    Pending,
    Source,
    expect_tails,
    final_chunk_key,
    first_chunk_held,
    hits_discarded,
    loadable_run,
    planned_again,
    tail_asker,
    tail_source,
    within_staging_budget,
)
from kv_offload.scheduler.records import RequestLike, RequestState
from kv_offload.scheduler.same_step import SameStepBudget, all_ready_in_cpu, ready_in_cpu
from kv_offload.scheduler.stores import StorePlanner
from kv_offload.scheduler.tails import TailIndex, offer_tail
from kv_offload.tier_contract import SecondaryTier

logger = logging.getLogger(__name__)
BoundaryStates = Mapping[str, Iterable[tuple[int, int, int]]]
"""vLLM's mamba "align" hand-offs of one step (``KVConnectorBlockState.
boundary_state_offloads``): per request, (group, block id, boundary tokens) of each state
block that this step's forward fills (docs/architecture.md, "Mamba state entries")."""


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The numbers the planner needs, resolved from OffloadConfig and the engine."""

    chunk_tokens: int
    block_size: int
    tokens_per_hash: int
    num_ranks: int
    num_cpu_slots: int
    store_generated: bool = False
    eviction_policy: str = "lru"
    groups: tuple[KVGroup, ...] = ()  # a hybrid engine's KV cache groups (KVLayout.groups)
    same_step_budget_s: float = 0.0  # copy time a step may spend on same-step loads (0: off)
    chunk_bytes: int = 0  # one chunk's bytes on one rank (KVLayout.slot_bytes)
    partial_hits: bool = False  # serve to the last cached token (tails.py), one group only
    # An asynchronous hit of fewer tokens is not reported (the connector: vLLM's block size;
    min_async_hit_tokens: int = 0  # docs/architecture.md, "Hits to the last cached token")


class OffloadScheduler:
    """Plans loads and stores from the CPU tier and the secondary ``tiers``; owns every pin.

    Scheduler thread only. ``tiers``: the secondary tiers, in the order a lookup asks
    them (the disk's ``disk.tier.DiskTier``, then the remote's ``remote.index.RemoteIndex``).
    ``block_ids_of(req_id)`` returns the request's engine block ids: one table per KV
    cache group (vLLM's ``KVCacheBlocks.get_block_ids()``), or a flat list for one group.
    """

    def __init__(
        self,
        config: PlannerConfig,
        *,
        block_ids_of: Callable[[str], BlockTables],
        tiers: Sequence[SecondaryTier] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.chunk_tokens % config.block_size or config.block_size % config.tokens_per_hash:
            raise ValueError(
                f"chunk_tokens={config.chunk_tokens} must be a multiple of the block size "
                f"{config.block_size}, itself a multiple of tokens_per_hash "
                f"{config.tokens_per_hash}"
            )
        self.config = config
        self.chunk_map = ChunkMap(
            config.groups or (KVGroup("full_attention", 1, config.block_size),),
            config.chunk_tokens)
        self.cpu = CpuIndex(config.num_cpu_slots, policy=config.eviction_policy)
        self.counters = SchedulerCounters()
        self.tiers = tuple(tiers)
        if len({t.name for t in self.tiers}) != len(self.tiers):
            raise ValueError(f"two secondary tiers share a name: {[t.name for t in self.tiers]}")
        for tier in self.tiers:
            tier.bind(self.counters, clock)
        job_ids = itertools.count(1)  # one sequence: a report names a load or a store
        self.loads = LoadPlanner(cpu=self.cpu, tiers=self.tiers, counters=self.counters,
                                 job_ids=job_ids, num_ranks=config.num_ranks)
        self.stores = StorePlanner(cpu=self.cpu, tiers=self.tiers, counters=self.counters,
                                   job_ids=job_ids, num_ranks=config.num_ranks)
        self.holds = BlockHolds()
        self._job_guard = HookGuard(self.counters)  # one job's bug spares the others
        self._block_ids_of = block_ids_of
        self._clock = clock
        self._requests: dict[str, RequestState] = {}
        self.events: TierEvents | None = None  # KV events: kv_events.attach_events
        self._fence_next: set[str] = set()  # finished requests whose copies need a fence
        self._paused_ranks: set[int] = set()  # ranks whose KV cache vLLM took away
        # Same-step loads (issue 29) need vLLM's invalid_block_ids, one KV cache group only.
        self.same_step = (SameStepBudget(config.same_step_budget_s, config.chunk_bytes)
                          if config.same_step_budget_s > 0 and not config.groups else None)
        # Partial hits: one full-attention group (a window's part-chunk needs unstored blocks).
        self.tails = TailIndex() if config.partial_hits and not self.chunk_map.hybrid else None

    def tier(self, name: str) -> SecondaryTier | None:
        """The secondary tier called ``name``, or None."""
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def disk_enabled(self) -> bool:
        """False without a disk tier, or once it failed or was reset."""
        disk = self.tier("disk")
        return disk is not None and disk.enabled

    @property
    def paused(self) -> bool:
        """A worker reported its KV cache taken away and not yet given back: no load or
        store is planned (see the module docstring)."""
        return bool(self._paused_ranks)

    # -- lookups ---------------------------------------------------------------------------

    def _keys(self, request: RequestLike, *, for_load: bool) -> list[ChunkKey]:
        # A load leaves at least one token to compute so vLLM can sample the next one.
        limit = request.num_tokens - 1 if for_load else None
        return chunk_keys(
            request.block_hashes,
            tokens_per_hash=self.config.tokens_per_hash,
            chunk_tokens=self.config.chunk_tokens,
            max_tokens=limit,
        )

    def num_matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> int | None:
        """Tokens past ``num_computed_tokens`` that the tiers can load and stage now
        (``lookup.loadable_run``); 0 while ``paused``, and 0 without a lookup for a
        request whose hits vLLM discards (``lookup.hits_discarded``) or for a hit that
        would load asynchronously for fewer than ``min_async_hit_tokens`` (vLLM computes
        them). No side effects beyond a per-request memo.

        None ("ask again later") once for a request whose previous load vLLM gave up
        as a whole, then 0 until it ran: see docs/vllm-bugs.md (vLLM 0.32 would stall
        it, and the requests behind it, if it reported an asynchronous hit again)."""
        state = self._requests.setdefault(request.request_id, RequestState(request))
        state.request = request
        if hits_discarded(request):  # no tier is asked, nothing pinned: its KV is computed
            state.lookup = (num_computed_tokens, 0)
            return 0
        if state.load_given_up is None and state.loading:
            state.loading, state.load_given_up = False, True
            self.counters.loads_given_up += 1
            return None
        keys = self._keys(request, for_load=True)
        first = num_computed_tokens // self.config.chunk_tokens
        state.same_step = False
        if first > len(keys) or state.load_given_up or self.paused \
                or (first == len(keys) and self.tails is None):
            hit_tokens = 0
        else:
            found = self._hit_run(state, keys, first)
            if found is None:  # the remote tier's answer is pending: vLLM asks next step
                return None
            run, _, end = found
            misses = max(0, len(keys) - first - len(run))
            state.tier_outcome = {t.name: (sum(s.place is not None and s.place.tier == t.name
                                               for s in run), misses)
                                  for t in self.tiers if t.enabled}
            hit_tokens = max(0, end - num_computed_tokens)
            state.same_step = (hit_tokens > 0 and self.same_step is not None
                               and all_ready_in_cpu(run) and self.same_step.take(len(run)))
            if not state.same_step and hit_tokens < self.config.min_async_hit_tokens:
                hit_tokens = 0  # a step outside the batch costs more than computing them
        state.lookup = (num_computed_tokens, hit_tokens)
        return hit_tokens

    def load_is_async(self, req_id: str) -> bool:
        """Whether the hit the last lookup of ``req_id`` reported loads asynchronously
        (the request waits outside the batch) rather than in the step that schedules it:
        ``same_step.SameStepBudget``."""
        state = self._requests.get(req_id)
        return state is None or not state.same_step

    def may_load_async(self, request: RequestLike) -> bool:
        """vLLM 0.34 asks as a request enters its waiting queues: may its lookup answer an
        asynchronous load? (Then, with ``--max-num-inflight-kv-loads``, the load may start
        while the batch is full. A wrong yes costs: vLLM keeps the request at the head of
        its queue and starts no other such load until a running slot frees.) Yes when the
        CPU tier holds its first chunk (``first_chunk_held``): a dict look-up, no disk or
        remote I/O. No while ``paused``, when vLLM discards the request's hits, and while
        same-step loads are on: a CPU-tier hit then loads in the step that schedules it
        (``same_step``), a synchronous answer (the connector turns them off when
        ``--max-num-inflight-kv-loads`` is set). Read-only."""
        if self.paused or self.same_step is not None or hits_discarded(request):
            return False
        return first_chunk_held(self.cpu, request.block_hashes, request.num_tokens,
                                chunk_tokens=self.config.chunk_tokens,
                                tokens_per_hash=self.config.tokens_per_hash)

    def _hit_run(self, state: RequestState, keys: Sequence[ChunkKey], first: int
                 ) -> tuple[list[Source], list[ChunkKey], int] | None:
        """The loadable run from chunk ``first``, its keys and the token it ends at; with
        partial hits it goes on with part of a chunk: the whole chunk a request ends with,
        to its last token but one (``lookup.final_chunk_key``: asked with the others), or
        a request tail (``lookup.tail_source``). None while a tier's answer is pending
        (meanwhile the tails that a complete miss or a full hit would need are asked for
        too: ``lookup.expect_tails``)."""
        chunk, per_hash, request = self.config.chunk_tokens, self.config.tokens_per_hash, \
            state.request
        last = None if self.tails is None else final_chunk_key(request, keys, chunk, per_hash)
        asked = list(keys) if last is None else [*keys, last]
        run = loadable_run(self.cpu, self.tiers, request.request_id, asked, first)
        if run is None:  # pending: the tails the run will likely need are asked alongside
            if self.tails is not None:
                expect_tails(self.tiers, request, keys, first, chunk_tokens=chunk)
            return None
        end = first + len(run)
        if end > len(keys):  # the chunk the request ends with: all of it but its last token
            return run, asked, request.num_tokens - 1
        partial = None if self.tails is None else tail_source(
            self.cpu, self.tiers, self.tails, request, keys, end, chunk_tokens=chunk)
        if partial is Pending.PENDING:  # a tier's tails answer is pending: vLLM asks next step
            return None
        if partial is None:
            return run, list(keys), end * chunk
        source, num_tokens = partial
        with_partial = within_staging_budget(self.cpu, [*run, source])
        if len(with_partial) <= len(run):  # no CPU slot left to stage it into
            return with_partial, list(keys), (first + len(with_partial)) * chunk
        return with_partial, [*keys[:end], source.key], end * chunk + num_tokens

    # -- loads -----------------------------------------------------------------------------

    def plan_load(self, request: RequestLike, block_ids: BlockTables,
                  num_external_tokens: int) -> None:
        """Pin sources and queue a LoadJob for ``num_external_tokens`` after the local hit.

        Called once vLLM allocated the request's blocks, also with 0 tokens (then it only
        counts the miss). Chunks that vanished since the lookup (another process evicted
        them from the disk or remote tier) become failed moves: the worker reports their
        blocks as load errors and vLLM recomputes them.
        """
        state = self._requests.get(request.request_id)
        if state is None or state.lookup is None:
            return
        num_local, _ = state.lookup
        state.lookup, state.load_from = None, num_local
        for tier in self.tiers:  # counted once per scheduled request
            tier.count_lookup(*state.tier_outcome.get(tier.name, (0, 0)))
        state.tier_outcome = {}
        past_local = max(0, request.num_tokens - 1 - num_local)
        if hits_discarded(request):  # never looked up: neither a hit nor a miss
            self.counters.lookup_skipped_tokens += past_local
        else:
            self.counters.miss_tokens += max(0, past_local - num_external_tokens)
        if num_external_tokens <= 0:
            return
        chunk = self.config.chunk_tokens
        end = num_local + num_external_tokens
        first, last = num_local // chunk, -(-end // chunk)  # a partial last chunk counts
        keys = self._keys(request, for_load=True)
        found = self._hit_run(state, keys, first)
        run, keys = planned_again(found, keys, first, end, chunk_tokens=chunk)
        run = run[:last - first]
        if self.events is not None:  # staged and filled chunks are announced too
            self.events.capture(request, range(first, first + len(run)), keys)
        keys = [*keys, *[b""] * (last - len(keys))]  # chunks gone since: failed moves
        same_step = state.same_step
        if same_step:  # nothing can be staged before this step's forward: the rest fails
            run = list(itertools.takewhile(ready_in_cpu, run))
        tables = block_tables(block_ids)
        blocks = []
        for c in range(first, last):
            try:
                blocks.append(self.chunk_map.load_blocks(tables, c, skip_before=num_local,
                                                         ends_load=c == last - 1,
                                                         load_end=end))
            except UnservableChunkError as exc:  # never with vLLM 0.32's rules: recompute
                logger.warning("kv-offload: %s; recomputing from there", exc)
                run = run[:c - first]  # this chunk and the rest fail (vLLM recomputes)
                blocks.append(self.chunk_map.store_blocks(tables, c) or (SKIP_BLOCK,))
        chunk_tiers = self.loads.plan(request.request_id, keys[first:last], run, blocks,
                                      same_step=same_step)
        self.counters.loads_same_step += same_step
        state.tier_tokens = {}
        for c, name, source in itertools.zip_longest(range(first, last), chunk_tiers, run):
            if name is not None:
                tokens = min(end, (c + 1) * chunk) - max(num_local, c * chunk)
                state.tier_tokens[name] = state.tier_tokens.get(name, 0) + tokens
                if source is not None and source.tail:
                    self.counters.hit_tokens_tail += tokens
        for name, tokens in state.tier_tokens.items():
            self.counters.add_per_tier("hit_tokens", name, tokens)
        state.loading = not same_step  # a same-step load's request runs in this step

    def fail_load(self, req_id: str, block_ids: BlockTables, num_external_tokens: int
                  ) -> None:
        """Queue a load whose every chunk fails, for a request told to wait for
        ``num_external_tokens`` after ``plan_load`` raised: the workers report its last
        ``num_external_tokens`` worth of blocks as load errors, and vLLM recomputes them
        instead of waiting forever. Holds no pin. A same-step request's table also holds
        the blocks of the tokens it computes in this step: its failed blocks are those
        after its local hit, which vLLM checks (it truncates at the first)."""
        num_blocks = -(-num_external_tokens // self.config.block_size)  # partial: its block too
        if num_blocks <= 0:
            return
        state = self._requests.get(req_id)
        same_step = state is not None and state.same_step
        table = block_tables(block_ids)[0]  # with groups, vLLM recomputes the request
        blocks = table[-num_blocks:]
        if state is not None:
            if same_step:
                local = state.lookup[0] if state.lookup is not None else state.load_from
                first = local // self.config.block_size
                blocks = table[first:first + num_blocks]
            state.loading, state.lookup = not same_step, None
        self.loads.fail(req_id, tuple(int(b) for b in blocks), same_step=same_step)

    def take_pending_loads(self) -> tuple:
        """Hand out the queued loads (what ``plan_step`` does first; the fallback plan
        when planning stores failed)."""
        return self.loads.take_pending()

    def hit_tokens_by_tier(self, req_id: str) -> dict[str, int]:
        """Tokens of the last planned load of ``req_id`` per tier ("cpu", "disk",
        "remote")."""
        state = self._requests.get(req_id)
        return dict(state.tier_tokens) if state else {}

    # -- stores ----------------------------------------------------------------------------

    def plan_step(self, scheduled: Iterable[tuple[str, int]],
                  preempted: Iterable[str] = (),
                  boundary_states: BoundaryStates | None = None) -> StepPlan:
        """Build this step's plan: queued loads, stores for chunks that this step
        completes, the requests held since the last plan, and ``preempted`` (vLLM's
        preempted requests of this step) where their blocks are still being copied.
        ``scheduled`` yields (req_id, tokens computed once the step ran). While
        ``paused`` no store is planned; the chunks completed meanwhile are stored by the
        first plan after the pause, from the blocks of the requests still running.
        ``boundary_states``: this step's mamba state hand-offs; with mamba groups a
        chunk is stored only with the state handed over for its end (else counted in
        ``stores_without_state``; the chunks of a paused step are lost so)."""
        stores: list[tuple[ChunkKey, tuple[int, ...], str]] = []
        tails: list[tuple[ChunkKey, tuple[int, ...], str]] = []
        for req_id, computed in scheduled:
            state = self._requests.get(req_id)
            if state is not None:
                state.loading, state.load_given_up = False, None  # it runs: its load is over
                if not self.paused:
                    stores += self._completed_chunks(
                        req_id, state, computed, (boundary_states or {}).get(req_id, ()))
                    tails += self._completed_tail(req_id, state, computed)
        # Fence first: a request preempted and resumed in this schedule() (vLLM's reset
        # with running requests) has copies of its old blocks, which the workers' fence
        # covers, and may get a store job of its new blocks below, which must be held.
        preempted = tuple(preempted)
        fenced = tuple(r for r in preempted if self.holds.is_copying(r))
        fenced += self._window_freed(exclude=preempted)
        fenced += tuple(sorted(self._fence_next - set(fenced)))  # finished, see request_finished
        self._fence_next.clear()
        if self.same_step is not None:
            self.same_step.new_step()
        self.holds.forget(fenced)  # the fence protects their freed blocks: never held later
        store_jobs = []
        for job in (self.stores.plan(stores) if stores else None,
                    self.stores.plan(tails, tail=True) if tails else None):
            if job is not None:
                self.holds.copying(job.job_id, job.req_ids, window_sources_of(job, self.chunk_map.released_positions,
                                                                   self._block_ids_of))
                store_jobs.append(job)
        for tier in self.tiers:  # what no reservation above wrote: one transaction a step
            tier.end_step()
        loads = self.take_pending_loads()  # last: if anything above raised, the connector
        # hands them out itself (a load never handed out would leave its request waiting)
        return StepPlan(loads, tuple(store_jobs), held=self.holds.take_new(),
                        preempted=fenced)

    def _completed_chunks(self, req_id: str, state: RequestState, computed: int,
                          handed_over: Iterable[tuple[int, int, int]] = ()
                          ) -> list[tuple[ChunkKey, tuple[int, ...], str]]:
        """The chunks of a request completed by ``computed`` tokens and not yet stored
        (key, engine blocks, request); those already in the CPU tier are only touched.
        ``handed_over``: the request's mamba state hand-offs of this step."""
        request = state.request
        limit = computed if self.config.store_generated else min(
            computed, request.num_prompt_tokens)
        # Decide from counts first: building keys every decode step costs O(prompt).
        hashed = len(request.block_hashes) * self.config.tokens_per_hash
        num_done = min(hashed, limit) // self.config.chunk_tokens
        if num_done <= state.next_store_chunk:
            return []
        keys = self._keys(request, for_load=False)
        tables = block_tables(self._block_ids_of(req_id))
        chunk, state_groups = self.config.chunk_tokens, self.chunk_map.state_groups
        states: dict[int, dict[int, int]] = {}  # chunk -> mamba group -> state block
        for group, block, boundary in handed_over if state_groups else ():
            if boundary % chunk == 0:  # sub-block and other boundaries: not a chunk end
                states.setdefault(boundary // chunk - 1, {})[int(group)] = int(block)
        out = []
        for c in range(state.next_store_chunk, num_done):
            if keys[c] in self.cpu:
                self.cpu.touch([keys[c]])
            elif (blocks := self.chunk_map.store_blocks(tables, c, states.get(c))) is not None:
                out.append((keys[c], blocks, req_id))
            elif state_groups and len(states.get(c, ())) < len(state_groups):
                self.counters.stores_without_state += 1  # no hand-off of this boundary
            else:
                self.counters.stores_without_window += 1  # vLLM freed a block it needs
        if self.events is not None and out:  # what the chunks' KV events will carry
            self.events.capture(request, range(state.next_store_chunk, num_done), keys)
        state.next_store_chunk = num_done
        return out

    def _completed_tail(self, req_id: str, state: RequestState, computed: int
                        ) -> list[tuple[ChunkKey, tuple[int, ...], str]]:
        """The prompt's tail to store once this step computes its last token, once per
        request (``tails.offer_tail``; its disk records go with its commit)."""
        if self.tails is None or state.tail_planned or computed < state.request.num_prompt_tokens:
            return []
        state.tail_planned = True
        tail = offer_tail(self.tails, self.cpu, state.request, block_tables(self._block_ids_of(
            req_id)), self.chunk_map, tokens_per_hash=self.config.tokens_per_hash)
        if tail is not None:
            for tier in self.tiers:
                if tier.keeps_tails:
                    tier.note_tail(tail.key, tail.parent, tail.tokens)
        return [] if tail is None else [(tail.key, tail.blocks, req_id)]

    def _window_freed(self, *, exclude: Sequence[str]) -> tuple[str, ...]:
        """Running requests with a copy in flight of a sliding-window block that vLLM has
        freed since (it left the window; it may even be back in the same table at a later
        position): their copies are fenced like a preempted request's, before this step's
        forward may rewrite the block (invariant 3)."""
        freed = []
        for req, sources in self.holds.window_sources().items():
            if req in exclude or req not in self._requests:
                continue  # preempted: fenced anyway; finished: held or fenced
            if sources_freed(sources, block_tables(self._block_ids_of(req))):
                freed.append(req)
        return tuple(freed)

    def blocks_spoiled_by(self, failed_blocks: Collection[int]) -> set[int]:
        """The engine blocks whose KV a failed load may have spoiled: ``failed_blocks``
        and, in the table of every request kv-offload knows of, each block from its first
        failed one on (a same-step load's forward computed those on the failed KV; a
        request that hit a failed block in vLLM's prefix cache in that step too).
        Read-only. First KV cache group only: vLLM takes block-level load errors from
        single-group engines only."""
        failed = set(failed_blocks)
        spoiled = set(failed)
        for req_id in self._requests:
            table = block_tables(self._block_ids_of(req_id))[0]
            first = next((i for i, b in enumerate(table) if b in failed), None)
            if first is not None:
                spoiled.update(int(b) for b in table[first:])
        return spoiled

    # -- completions -----------------------------------------------------------------------

    def on_report(self, report: WorkerReport) -> None:
        """Apply what workers finished: publish, commit, release pins (invariants 1-2).
        Each job is applied on its own: one that raises (a bug) is logged and counted
        (``hook_errors``) and does not keep the report's other jobs from completing."""
        for name, why in report.broken.items():
            if (broken := self.tier(name)) is not None:
                broken.disable(why)
        if report.paused:
            self._on_paused(report.paused)
        run = self._job_guard.call
        for job_id in report.host_stored.keys() | report.host_failed.keys():
            run("on_report (store copied)", lambda: None, self._on_copied, job_id,
                report.host_stored.get(job_id, 0), report.host_failed.get(job_id, 0))
        for job_id, by_tier in report.written.items():
            if job_id in self.loads.records:  # a load's fills
                run("on_report (load fills)", lambda: None, self.loads.on_fills, job_id,
                    by_tier)
            else:
                run("on_report (store written)", lambda: None, self.stores.on_written,
                    job_id, by_tier)
        for job_id, bad in report.bad_reads.items():
            run("on_report (bad reads)", lambda: None, self.loads.on_bad_reads, job_id, bad)
        for job_id, failed in report.loaded.items():
            run("on_report (loaded)", lambda: None, self.loads.on_loaded, job_id, failed)

    def _on_paused(self, ranks: dict[int, bool]) -> None:
        """Ranks whose KV cache vLLM took away (True) or gave back (False)."""
        was = self.paused
        for rank, paused in ranks.items():
            if paused:
                self._paused_ranks.add(rank)
            else:
                self._paused_ranks.discard(rank)
        if self.paused and not was:
            logger.info("kv-offload: vLLM released the KV cache; no chunk is loaded or "
                        "stored until it is restored")
        elif was and not self.paused:
            logger.info("kv-offload: vLLM restored the KV cache; loads and stores resume")

    def _on_copied(self, job_id: int, stored: int, failed: int) -> None:
        if self.stores.on_copied(job_id, stored + failed, failed):
            self.holds.copied(job_id)

    # -- lifecycle -------------------------------------------------------------------------

    def request_finished(self, req_id: str, block_ids: BlockTables | None = None) -> bool:
        """Forget a finished request. Its jobs keep their pins until they complete.
        True when vLLM must keep its blocks until the workers report it sent (a copy
        of them may still be running: ``BlockHolds``). Never for a request waiting for
        its load: vLLM keeps those blocks until ``finished_recving`` by itself, and no
        store copies them (a hold too would free the request twice: vLLM asserts).

        ``block_ids``: the tables vLLM hands over (``request_finished_all_groups``).
        vLLM frees a finishing request's out-of-window sliding-window blocks before it
        asks, so a hold cannot keep those: when a copy in flight reads one, the request's
        copies are fenced before the next step's forward instead (and it is not held)."""
        state = self._requests.pop(req_id, None)
        for tier in self.tiers:
            tier.forget(req_id)
            tier.forget(tail_asker(req_id))
        if state is not None and state.loading:
            return False
        if block_ids is not None and sources_freed(self.holds.window_sources().get(req_id, ()),
                                                   block_tables(block_ids)):
            self.holds.forget([req_id])
            self._fence_next.add(req_id)
            return False
        return self.holds.finish(req_id)

    def blocks_released(self, req_ids: Iterable[str]) -> None:
        """vLLM freed the blocks of these held requests (``finished_sending``)."""
        self.holds.released(req_ids)

    def num_pending_jobs(self) -> int:
        """Jobs planned or in flight (loads not yet handed out count too)."""
        return len(self.loads.records) + len(self.stores.records)

    def has_pending_work(self) -> bool:
        return bool(self.loads.has_pending() or self.stores.records or self.holds.num_held()
                    or any(t.has_queued() for t in self.tiers)
                    or (self.events is not None and self.events.has_queued()))

    def reset_cpu_tier(self) -> int:
        """Drop unpinned READY CPU entries (``connector_reset="cpu"``)."""
        return self.cpu.clear_unpinned()

    def reset_all(self) -> int:
        """Forget every chunk computed so far (``connector_reset="all"``): the CPU tier's
        entries at once (those pinned or in flight are never published), and the disk
        and remote tiers for the rest of the run (no lookups, no stores; jobs in flight
        finish what they wrote). Returns how many CPU entries were dropped."""
        dropped = self.cpu.discard_all()
        if any(t.enabled for t in self.tiers):
            logger.warning(
                "kv-offload: vLLM reset the connector's cache (it does so around weight "
                "updates); the disk and remote tiers, keyed by the model's config and not "
                "its weights, are not used for the rest of this run. Restart (with another "
                "namespace_salt if the weights changed) to use them again, or set "
                "connector_reset='cpu' if the weights never change in place.")
        for tier in self.tiers:
            tier.disable("reset", failed=False)
        return dropped

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

