"""Scheduler-side cost of lookups and planning as the store grows (10k, 100k, 1M chunks).

Targets: lookup <= 5 us per chunk at 1M chunks, every cost flat (1M within 2x of 10k).
The method: templates/lookup.md.

    python benchmarks/bench_lookup.py --quick --json /tmp/lookup.json   # 10k only, seconds
    python benchmarks/bench_lookup.py --json lookup.json                # 10k, 100k, 1M
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from _common import BenchParser, csv, finish, new_result, workdir
from _markdown import Targets, fill, fmt, table

from kv_offload.disk import DiskIndex
from kv_offload.jobs import WorkerReport
from kv_offload.scheduler import OffloadScheduler, PlannerConfig, SlotState
from kv_offload.testing.tiers import secondary_tiers

BLOCK_SIZE = 32
CHUNK_TOKENS = 256
HASHES_PER_CHUNK = CHUNK_TOKENS // BLOCK_SIZE
CHUNKS_PER_REQUEST = 16  # 4k-token requests
SLOT_BYTES = 4096  # the index never touches bytes; only the slot count matters
TARGET_US_PER_CHUNK = 5.0
FLAT_FACTOR = 2.0  # "flat": the largest size costs at most this times the smallest
DECODE_BATCH = 16  # running requests in a decode step
FILLER = bytes(32)  # block hashes that are not chunk keys are never looked up


class Bench:
    """One scheduler over a full CPU index and a full DiskIndex of ``n`` chunks each."""

    def __init__(self, n: int, root: Path, rng: random.Random) -> None:
        self.n, self.rng = n, rng
        self.block_ids = list(range(CHUNKS_PER_REQUEST * HASHES_PER_CHUNK + 1))
        self.disk = DiskIndex.open(root, namespace_id="b1" * 16, descriptor={"bench": "lookup"},
                                   slot_bytes=SLOT_BYTES, num_ranks=1,
                                   capacity_bytes=n * SLOT_BYTES)
        config = PlannerConfig(chunk_tokens=CHUNK_TOKENS, block_size=BLOCK_SIZE,
                               tokens_per_hash=BLOCK_SIZE, num_ranks=1, num_cpu_slots=n)
        self.sched = OffloadScheduler(config, tiers=secondary_tiers(self.disk),
                                      block_ids_of=lambda _rid: self.block_ids)
        self.cpu_groups, self.fill_cpu_s = self._fill(self._fill_cpu)
        self.disk_groups, self.fill_disk_s = self._fill(self._fill_disk)
        self._ids = 0

    def _fill(self, put: Callable[[list[bytes]], None]) -> tuple[list[list[bytes]], float]:
        """Insert n fresh keys in groups of one request's chunks; (groups, seconds)."""
        groups, start = [], time.perf_counter()
        for _ in range(self.n // CHUNKS_PER_REQUEST):
            group = [self.rng.randbytes(32) for _ in range(CHUNKS_PER_REQUEST)]
            put(group)
            groups.append(group)
        return groups, time.perf_counter() - start

    def _fill_cpu(self, keys: list[bytes]) -> None:
        cpu = self.sched.cpu
        for key in keys:
            slot = cpu.reserve(key, SlotState.STORING)
            cpu.publish(slot)
            cpu.unpin([slot])

    def _fill_disk(self, keys: list[bytes]) -> None:
        slots = self.disk.allocate(keys)
        self.disk.commit([(k, s, (0,)) for k, s in zip(keys, slots) if s is not None])

    def request(self, keys: list[bytes]) -> SimpleNamespace:
        """A new request whose i-th chunk is named ``keys[i]``, plus one token to compute:
        what the scheduler reads of a vLLM request."""
        self._ids += 1
        hashes = [h for key in keys for h in [*[FILLER] * (HASHES_PER_CHUNK - 1), key]]
        num_tokens = len(keys) * CHUNK_TOKENS + 1
        return SimpleNamespace(request_id=f"r{self._ids}", block_hashes=hashes,
                               num_tokens=num_tokens, num_prompt_tokens=num_tokens)

    # -- measurements: each returns seconds per call -------------------------------------

    def lookup(self, groups: list[list[bytes]] | None) -> float:
        """One lookup of a random stored group (all hit), or of new keys (``None``: miss)."""
        keys = self.rng.choice(groups) if groups else self.new_keys()
        req = self.request(keys)
        start = time.perf_counter()
        hit = self.sched.num_matched_tokens(req, 0)
        elapsed = time.perf_counter() - start
        self.sched.request_finished(req.request_id)
        if hit != (CHUNKS_PER_REQUEST * CHUNK_TOKENS if groups else 0):
            raise RuntimeError(f"lookup bench: {hit} hit tokens, groups given: {bool(groups)}")
        return elapsed

    def new_keys(self) -> list[bytes]:
        return [self.rng.randbytes(32) for _ in range(CHUNKS_PER_REQUEST)]

    def load(self, groups: list[list[bytes]]) -> tuple[float, float]:
        """(plan_load + plan_step, on_report) seconds for one request's 16-chunk hit."""
        # a random stored group, removed from ``groups`` (its chunks change tier)
        req = self.request(groups.pop(self.rng.randrange(len(groups))))
        hit = self.sched.num_matched_tokens(req, 0)
        start = time.perf_counter()
        self.sched.plan_load(req, self.block_ids, hit)
        (job,) = self.sched.plan_step([]).loads
        planned = time.perf_counter()
        self.sched.on_report(WorkerReport(loaded={job.job_id: {0: frozenset()}}))
        done = time.perf_counter()
        self.sched.request_finished(req.request_id)
        if any(m.cpu_slot is None for m in job.chunks):
            raise RuntimeError("lookup bench: a planned load lost its chunks")
        return planned - start, done - planned

    def store(self) -> tuple[float, float]:
        """(plan_step, on_report) seconds to store a request's 16 new chunks."""
        req = self.request(self.new_keys())
        self.sched.num_matched_tokens(req, 0)
        start = time.perf_counter()
        (job,) = self.sched.plan_step([(req.request_id, req.num_tokens)]).stores
        planned = time.perf_counter()
        sums = tuple(0 for _ in job.chunks)
        self.sched.on_report(WorkerReport(host_stored={job.job_id: 1},
                                          written={job.job_id: {"disk": {0: sums}}}))
        done = time.perf_counter()
        self.sched.request_finished(req.request_id)
        return planned - start, done - planned

    def decode_steps(self, num_requests: int, num_steps: int) -> list[float]:
        """Seconds per plan_step over ``num_requests`` running requests whose chunks are
        all stored already (decode steps: nothing new to plan)."""
        reqs = [self.request(self.new_keys()) for _ in range(num_requests)]
        for req in reqs:
            self.sched.num_matched_tokens(req, 0)
        plan = self.sched.plan_step([(r.request_id, r.num_tokens) for r in reqs])
        for job in plan.stores:
            self.sched.on_report(WorkerReport(host_stored={job.job_id: 1}, written={job.job_id: {"disk": {0: tuple(0 for _ in job.chunks)}}}))
        times = []
        for step in range(1, num_steps + 1):
            scheduled = [(r.request_id, r.num_tokens + step) for r in reqs]
            start = time.perf_counter()
            plan = self.sched.plan_step(scheduled)
            times.append(time.perf_counter() - start)
            if plan:
                raise RuntimeError("lookup bench: a decode step planned work")
        for req in reqs:
            self.sched.request_finished(req.request_id)
        return times


def median_us(samples: list[float], per: int = 1) -> float:
    return round(statistics.median(samples) / per * 1e6, 3)


def measure(n: int, calls: int, base: Path, seed: int) -> dict:
    """All figures for one store size ``n``."""
    root = Path(tempfile.mkdtemp(prefix=f"lookup-{n}-", dir=base))
    bench = Bench(n, root, random.Random(seed))
    try:
        per = CHUNKS_PER_REQUEST
        row = {"num_chunks": n, "fill_cpu_s": round(bench.fill_cpu_s, 2),
               "fill_disk_s": round(bench.fill_disk_s, 2)}
        for key, groups, div in (("lookup_cpu_us_per_chunk", bench.cpu_groups, per),
                                 ("lookup_disk_us_per_chunk", bench.disk_groups, per),
                                 ("lookup_miss_us_per_request", None, 1)):
            row[key] = median_us([bench.lookup(groups) for _ in range(calls)], div)
        flush = time.perf_counter()
        bench.disk.flush_access()  # the accesses of the lookups above, batched
        row["access_flush_us_per_chunk"] = round(
            (time.perf_counter() - flush) / (calls * per) * 1e6, 3)
        num_loads = min(calls, len(bench.disk_groups) // 2, len(bench.cpu_groups) // 2)
        for tier, groups in (("cpu", bench.cpu_groups), ("disk", bench.disk_groups)):
            plan, done = zip(*(bench.load(groups) for _ in range(num_loads)))
            row[f"plan_load_{tier}_us_per_chunk"] = median_us(list(plan), per)
            row[f"complete_load_{tier}_us_per_chunk"] = median_us(list(done), per)
        plan, done = zip(*(bench.store() for _ in range(calls)))
        row["plan_store_us_per_chunk"] = median_us(list(plan), per)
        row["complete_store_us_per_chunk"] = median_us(list(done), per)
        row["plan_step_decode_us_per_request"] = median_us(
            bench.decode_steps(DECODE_BATCH, max(20, calls // 10)), DECODE_BATCH)
        row["counters"] = bench.sched.counters.snapshot()
        return row
    finally:
        bench.sched.close()
        shutil.rmtree(root, ignore_errors=True)


LOOKUP_KEYS = ("lookup_cpu_us_per_chunk", "lookup_disk_us_per_chunk")
PLAN_KEYS = ("plan_load_cpu_us_per_chunk", "plan_load_disk_us_per_chunk",
             "plan_store_us_per_chunk", "complete_store_us_per_chunk",
             "access_flush_us_per_chunk", "plan_step_decode_us_per_request")


def verdicts(rows: list[dict]) -> list[dict]:
    """PASS/MISS per target: <= 5 us/chunk at the largest size; flat across sizes."""
    largest, smallest = rows[-1], rows[0]
    out = []
    for key in LOOKUP_KEYS:
        out.append({"target": f"{key} <= {TARGET_US_PER_CHUNK} at {largest['num_chunks']}",
                    "value": largest[key], "limit": TARGET_US_PER_CHUNK,
                    "pass": largest[key] <= TARGET_US_PER_CHUNK})
    if len(rows) > 1:
        for key in LOOKUP_KEYS + PLAN_KEYS:
            growth = largest[key] / max(smallest[key], 1e-9)
            out.append({"target": f"{key} flat: {largest['num_chunks']} vs "
                                  f"{smallest['num_chunks']} <= {FLAT_FACTOR}x",
                        "value": round(growth, 2), "limit": FLAT_FACTOR,
                        "pass": growth <= FLAT_FACTOR})
    return out


REPORT_COLUMNS = ("lookup_cpu_us_per_chunk", "lookup_disk_us_per_chunk",
                  "lookup_miss_us_per_request", "access_flush_us_per_chunk",
                  "plan_load_cpu_us_per_chunk", "plan_load_disk_us_per_chunk",
                  "complete_load_disk_us_per_chunk", "plan_store_us_per_chunk",
                  "complete_store_us_per_chunk", "plan_step_decode_us_per_request", "fill_disk_s")


def render_section(data: dict, img: Path | None, targets: Targets) -> list[str]:
    """This benchmark's section of docs/benchmarks.md (no plot: ``img`` is unused)."""
    rows = [[r["num_chunks"], *[fmt(r.get(c), ".2f") for c in REPORT_COLUMNS]]
            for r in data["results"]]
    names = [c.replace("_us_per_chunk", "").replace("_us_per_request", " /req")
             .replace("_", " ") for c in REPORT_COLUMNS]
    for v in data["verdicts"]:
        targets.add(f"Scheduler: {v['target']}", v["value"], f"<= {v['limit']}", v["pass"],
                    "bench_lookup")
    return fill("lookup", data, table="\n".join(table(["chunks", *names], rows)))


def main(argv: list[str] | None = None) -> dict:
    parser = BenchParser(__doc__, "10k chunks only, fewer calls")
    parser.sized("--sizes", "10000,100000,1000000", "10000",
                 "comma-separated store sizes in chunks", type=str)
    parser.sized("--calls", 2000, 200, "timed calls per figure")
    parser.add_workdir()
    args = parser.parse_args(argv)
    args.sizes = sorted(csv(args.sizes))
    if min(args.sizes) < 4 * CHUNKS_PER_REQUEST:
        parser.error(f"--sizes: each size must be >= {4 * CHUNKS_PER_REQUEST} chunks")
    base = workdir(args, "lookup")
    started = time.perf_counter()
    result = new_result("lookup", args, chunk_tokens=CHUNK_TOKENS, block_size=BLOCK_SIZE,
                        chunks_per_request=CHUNKS_PER_REQUEST, calls=args.calls,
                        target_us_per_chunk=TARGET_US_PER_CHUNK, flat_factor=FLAT_FACTOR,
                        results=[])
    try:
        for i, n in enumerate(args.sizes):
            result["results"].append(measure(n, args.calls, base, seed=i))
            print(f"  {n} chunks done ({time.perf_counter() - started:.0f} s)", flush=True)
        result["verdicts"] = verdicts(result["results"])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return finish(result, args.json, render_section, started)


if __name__ == "__main__":
    main()
