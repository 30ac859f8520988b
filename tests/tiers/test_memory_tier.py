"""The tier contract's proof: a secondary tier added through the contract alone.

``MemoryTier`` (scheduler half) and ``MemoryIO`` (worker half) keep chunks in this
process's memory, per namespace, with a capacity, LRU eviction, pins and request tails.
They live in this file only and reach kv-offload through the ``extra_tiers`` option
(``kv_offload.tier_plugins``) and ``kv_offload.tier_contract``: vLLM's real scheduler,
kv-offload's planner and worker and the fake model runner of ``SchedulerHarness`` use
them like the disk tier, and the fake model checks that every token is computed on the
KV of its own tokens, also where it was loaded from this tier (after a restart too).
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from kv_offload.tier_contract import Address, Place
from kv_offload.tier_plugins import TierContext

NAME = "memory"
SPEC = f"{__name__}:memory_tier"
DATA: dict[str, dict[Address, dict[int, bytes]]] = {}  # namespace -> address -> rank -> bytes
TIERS: list[MemoryTier] = []  # the scheduler halves made, for the tests to read


def memory_tier(context: TierContext) -> Any:
    """The ``extra_tiers`` factory: one half of the memory tier of ``context.namespace``."""
    data = DATA.setdefault(context.namespace, {})
    if context.side == "worker":
        return MemoryIO(data, context.rank)
    tier = MemoryTier(data, context.num_ranks, capacity=6)
    TIERS.append(tier)
    return tier


class MemoryTier:
    """The scheduler half: which key is at which address (``SecondaryTier``)."""

    name = NAME
    keeps_tails = True
    takes_fills = False

    def __init__(self, data: dict[Address, dict[int, bytes]], num_ranks: int, *,
                 capacity: int) -> None:
        self.data, self.num_ranks, self.capacity = data, num_ranks, capacity
        self.enabled = True
        # What an earlier engine on this namespace committed (a restart finds it).
        self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict(
            (v[-1], a) for a, v in data.items() if isinstance(a, int) and -1 in v)
        self.reserved: dict[int, bytes] = {}
        self.pins: collections.Counter[int] = collections.Counter()
        self.notes: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}
        self.tails: dict[bytes, dict[bytes, tuple[int, ...]]] = {}
        self.addresses = itertools.count(max((a for a in data if isinstance(a, int)),
                                             default=-1) + 1)
        self.found = self.stored = self.dropped = 0

    def bind(self, counters: Any, clock: Callable[[], float]) -> None:
        pass

    def find(self, asker: str, keys: Sequence[bytes]) -> list[Place]:
        out = []
        for key in keys:
            if key not in self.index or not self.enabled:
                break
            self.index.move_to_end(key)
            out.append(Place(NAME, self.index[key]))
        self.found += len(out)
        return out

    def forget(self, asker: str) -> None:
        pass

    def tails_of(self, asker: str, parent: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
        return list(self.tails.get(parent, {}).items())

    def expect_tails(self, asker: str, parents: Sequence[bytes]) -> None:
        pass  # tails_of answers at once

    def note_tail(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        self.notes[key] = (parent, tokens)

    def count_lookup(self, hits: int, misses: int) -> None:
        pass

    def pin(self, places: Sequence[Place]) -> None:
        self.pins.update(int(p.address) for p in places)

    def unpin(self, places: Sequence[Place]) -> None:
        self.pins.subtract(int(p.address) for p in places)
        assert min(self.pins.values(), default=0) >= 0, "unpinned more than pinned"

    def reserve(self, keys: Sequence[bytes]) -> list[Place | None]:
        out: list[Place | None] = []
        for key in keys:
            if not self.enabled or key in self.index or not self._make_room():
                out.append(None)
                continue
            address = next(self.addresses)
            self.reserved[address] = key
            out.append(Place(NAME, address))
        return out

    def _make_room(self) -> bool:
        while len(self.index) + len(self.reserved) >= self.capacity:
            victim = next((k for k, a in self.index.items() if not self.pins[a]), None)
            if victim is None:
                return False
            self._forget(victim)
        return True

    def _forget(self, key: bytes) -> None:
        address = self.index.pop(key)
        self.data.pop(address, None)
        for tails in self.tails.values():
            tails.pop(key, None)

    def release(self, places: Sequence[Place]) -> None:
        for place in places:
            self.reserved.pop(int(place.address))
            self.data.pop(place.address, None)

    def written(self, keys: Sequence[bytes], places: Sequence[Place | None],
                results: Mapping[int, Sequence[object | None]],
                failed: frozenset[int] = frozenset()) -> int:
        done = 0
        for i, (key, place) in enumerate(zip(keys, places)):
            if place is None:
                continue
            address = int(place.address)
            assert self.reserved.pop(address) == key, "written to a place it did not reserve"
            ok = (i not in failed and len(results) == self.num_ranks
                  and all(r[i] is not None for r in results.values()))
            if not ok or key in self.index:
                self.data.pop(address, None)
                continue
            self.index[key] = address
            self.data.setdefault(address, {})[-1] = key  # committed: a restart finds it
            if (note := self.notes.pop(key, None)) is not None:
                self.tails.setdefault(note[0], {})[key] = note[1]
            done += 1
        self.stored += done
        return done

    def drop(self, place: Place, key: bytes) -> None:
        if self.index.get(key) == place.address and not self.pins[int(place.address)]:
            self._forget(key)
            self.dropped += 1

    def end_step(self) -> None:
        pass

    def has_queued(self) -> bool:
        return False

    def disable(self, reason: str, *, failed: bool = True) -> None:
        self.enabled = False

    def attach_events(self, events: Any) -> None:
        pass

    def stats(self) -> dict | None:
        return {"found": self.found, "stored": self.stored, "entries": len(self.index),
                "pinned": sum(1 for n in self.pins.values() if n), "reserved": len(self.reserved)}

    def close(self) -> None:
        pass


class MemoryIO:
    """The worker half of one rank: copies between host slots and ``data`` (``TierIO``)."""

    name = NAME
    write_batch = 2

    def __init__(self, data: dict[Address, dict[int, bytes]], rank: int) -> None:
        self.data, self.rank = data, rank

    def bind(self, count: Callable[[Any], None], clock: Callable[[], float]) -> None:
        pass

    def read(self, place: Place, out: memoryview) -> bool:
        payload = self.data.get(place.address, {}).get(self.rank)
        if payload is None or len(payload) != len(out):
            return False
        out[:] = payload
        return True

    def write(self, addresses: Sequence[Address], views: Sequence[memoryview]
              ) -> list[object | None]:
        for address, view in zip(addresses, views):
            self.data.setdefault(address, {})[self.rank] = bytes(view)
        return [True] * len(addresses)

    def take_broken(self) -> str | None:
        return None

    def close(self) -> None:
        pass


@pytest.fixture
def make_harness(harness_factory):
    """``harness_factory`` with the memory tier and no disk tier, its data cleared."""
    DATA.clear()
    TIERS.clear()
    options = dict(disk=False, cpu_slots=4, num_blocks=32, extra_tiers=(SPEC,))
    return lambda **kwargs: harness_factory(**{**options, **kwargs})


@pytest.fixture(autouse=True)
def quiet(caplog):
    caplog.set_level(logging.CRITICAL, logger="kv_offload")


def doc(n: int, base: int) -> list[int]:
    return [3 + (base + 7 * i) % 997 for i in range(n)]


def test_a_tier_added_by_extra_tiers_serves_hits_on_the_right_kv(make_harness):
    harness = make_harness()
    (tier,) = TIERS
    prompt = doc(48, 0)
    harness.add("writer", prompt + [5], max_tokens=2)
    harness.run()
    assert tier.stats()["entries"] >= 3, "the three chunks (and the prompt's tail)"
    assert harness.reset_prefix_cache(reset_connector=True)  # vLLM's cache and the CPU tier
    counters = harness.scheduler_side.counters
    missed, loaded = counters.miss_tokens, counters.chunks_loaded_cpu
    harness.add("reader", prompt + [5], max_tokens=4)
    harness.run()
    assert harness.check_idle() == []
    assert tier.found >= 3 and harness.runner.num_checked_tokens > 0
    assert counters.miss_tokens == missed and counters.chunks_loaded_cpu == loaded, (
        "all 48 tokens come from the memory tier")


def test_a_restarted_engine_is_served_what_the_first_one_stored(make_harness):
    first = make_harness()
    prompts = [doc(40, 100 * i) for i in range(3)]
    for i, prompt in enumerate(prompts):
        first.add(f"w{i}", prompt, max_tokens=1)
    first.run()
    assert first.check_idle() == []
    first.close()
    second = make_harness()  # a fresh CPU tier and vLLM cache, the same namespace
    for i, prompt in enumerate(prompts):
        second.add(f"r{i}", prompt, max_tokens=3)
    second.run()
    assert second.check_idle() == [] and TIERS[1].found > 0
    counters = second.scheduler_side.counters
    assert counters.hit_tokens_cpu == 0 and counters.miss_tokens < sum(map(len, prompts))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_with_the_memory_tier_ends_idle_on_the_right_kv(
        make_harness, seed, async_scheduling):
    """Shared prefixes under a CPU tier of 4 chunks and a memory tier of 6: chunks are
    staged from it, evicted from it while others are pinned, and reset from the CPU tier."""
    harness = make_harness(async_scheduling=async_scheduling, cpu_slots=4, num_blocks=24)
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 1000) for _ in range(rng.randrange(16, 72))] for _ in range(4)]
    for i in range(50):
        if rng.random() < 0.6:
            prompt = rng.choice(docs)[:rng.randrange(8, 72)]
            harness.add(f"q{i}", prompt + [rng.randrange(3, 1000)],
                        max_tokens=rng.randrange(1, 8))
        if rng.random() < 0.08:
            harness.reset_prefix_cache(reset_connector=True)  # refused while requests run
        harness.step()
    harness.run()
    assert harness.check_idle() == [], f"seed {seed}"
    stats = TIERS[0].stats()
    assert stats["found"] > 0 and stats["pinned"] == 0 and stats["reserved"] == 0, stats
    assert harness.runner.num_checked_tokens > 0
