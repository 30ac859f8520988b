"""The remote tier in real vLLM engines (CPU backend) against real Redis servers.

Every engine runs in a fresh process with its own disk store, as on different hosts;
they share only the Redis server. The reference tokens are those of the first engine's
cold run, which loads nothing (asserted), i.e. tokens computed from scratch.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from kv_offload.disk import iter_entries, list_namespaces
from kv_offload.testing.engine import EngineProcess, offload_transfer, start_engines
from kv_offload.testing.redis_server import RedisServer, SlowProxy
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model
from kv_offload.testing.workload import run_in_subprocess

pytestmark = pytest.mark.engine

PREFIX_TOKENS = 640
CHUNK = 64


def prompts() -> list[str]:
    """Four prompts sharing a 640-token prefix, and two unrelated ones."""
    prefix = make_prompt(PREFIX_TOKENS, seed=201)
    shared = [prefix + make_prompt(40 + 7 * i, seed=210 + i) for i in range(4)]
    return shared + [make_prompt(300, seed=250), make_prompt(520, seed=251)]


def later_prompts() -> list[str]:
    """Prompts first seen after the server came back."""
    return [make_prompt(400 + 60 * i, seed=260 + i) for i in range(3)]


def head() -> str:
    """Three chunks that host B holds before the ``head`` case (``head_prompt``)."""
    return make_prompt(3 * CHUNK, seed=288)


def head_prompt() -> str:
    """Host B's only prompt before the ``head`` case: ``head()``, a short tail."""
    return head() + make_prompt(20, seed=279)


def exact_prompts() -> dict[str, tuple[str, int, int]]:
    """Prompts of whole chunks only (issue 33: partial hits), by case: (text, tokens,
    tokens host B's CPU tier holds when it is served). One, four and seven chunks; and
    four whose first three B holds (``head_prompt``), the last only in Redis."""
    out = {f"{n}": (make_prompt(n, seed=280 + n // CHUNK), n, 0) for n in (64, 256, 448)}
    out["head"] = (head() + make_prompt(CHUNK, seed=289), 4 * CHUNK, 3 * CHUNK)
    return out


def tail_prompts() -> dict[int, str]:
    """Prompts that end inside a chunk (issue 33: request tails), by length: five whole
    chunks and 4 tokens (neither a multiple of the chunk nor of vLLM's block, 32), five
    and a block (a multiple of the block), and one shorter than a chunk (its tail's
    parent is the seed, not a chunk)."""
    return {n: make_prompt(n, seed=290 + n % 97) for n in (5 * CHUNK + 4, 5 * CHUNK + 32, 45)}


def all_prompts() -> list[str]:
    """Every prompt host A computes (the reference)."""
    # A tail's record is written once the scheduler hears its value was, after the
    # request; the engine's quit steps until it has (engine_server: a CI dry run lost the
    # 45-token tail, host A's last prompt, before it did).
    return (prompts() + list(tail_prompts().values()) + later_prompts()
            + [text for text, _, _ in exact_prompts().values()])


def offload(store: Path | None, **remote) -> dict:
    # A lookup budget of 5 s: on a loaded 2-core test machine (three Redis nodes, the
    # engine and its remote writes on the same cores) round trips pass the default
    # 50 ms, even 500 ms, and a lookup past its budget is a miss, the next one skipped
    # once; these tests need the hits (a CI dry run lost the one-chunk prompt's 63 so).
    # The lookup threads now connect at engine start, so the first ask no longer pays
    # for connecting, but a descheduled lookup thread still can pass 500 ms; the budget
    # itself is tested with a fake clock (tests/remote/test_lookups.py). 30 s: two CI dry
    # runs saw a lookup round trip held 5 s with the server healthy (an open problem).
    return {"cpu_size": "64MiB", "disk_path": str(store) if store else None,
            "disk_size": "256MiB", "chunk_tokens": CHUNK, "io_threads": 2,
            "remote_max_backoff_s": 2.0, "remote_lookup_budget_ms": 30000.0,
            "connector_reset": "cpu", **remote}  # a reset leaves the tiers below serving


def hits_checkable(phase: dict) -> None:
    """Skip the hit checks of a phase in which a remote lookup passed its budget and was
    answered a miss (its tokens are checked before): twice in CI dry runs a lookup of
    host B waited the whole budget (5 s then) with the server healthy, an open problem
    (``RemoteLookups`` now logs such a lookup with what its threads were doing)."""
    errors = phase["kv_offload"].get("kv_offload_remote_lookup_errors_total{}", 0)
    if errors:
        pytest.skip(f"{errors:.0f} remote lookup(s) of phase {phase['name']!r} passed their "
                    "budget: a miss by design; hits not checked (tokens were)")


def spec(model: Path, offload_cfg: dict, phases: list[dict]) -> dict:
    # Each host is its own OS process; vLLM's engine core and worker run inside it.
    return {"model": str(model), "offload": offload_cfg, "engine": {}, "phases": phases,
            "in_process": True}


@pytest.fixture(scope="module")
def model() -> Path:
    return make_tiny_model()


@pytest.fixture(scope="module")
def first_host(model, redis_server, tmp_path_factory) -> dict:
    """Host A: cold run of every prompt; it stores them in its tiers and in Redis."""
    phases = [{"name": "cold", "prompts": all_prompts()}]
    store = tmp_path_factory.mktemp("host-a") / "store"
    return run_in_subprocess(spec(model, offload(store, remote_url=redis_server.url), phases),
                             tmp_path_factory.mktemp("run-a"))


@pytest.fixture(scope="module")
def reference(first_host) -> dict[str, list[int]]:
    cold = first_host["phases"][0]
    assert cold["metrics"]["external_hits"] == 0, "the reference run must compute everything"
    return dict(zip(all_prompts(), cold["tokens"]))


def expected(reference, texts: list[str]) -> list[list[int]]:
    return [reference[t] for t in texts]


@pytest.fixture(scope="module")
def second_host(model, redis_server, first_host, tmp_path_factory) -> dict:
    """Host B: its own empty store, the same Redis; then ``head_prompt`` and each of
    ``exact_prompts`` and ``tail_prompts`` alone, vLLM's own prefix cache reset before
    each."""
    store = tmp_path_factory.mktemp("host-b") / "store"
    phases = [{"name": "remote", "prompts": prompts()},
              {"name": "cpu", "prompts": prompts(), "reset_prefix_cache": True},
              {"name": "head", "prompts": [head_prompt()]},
              *[{"name": f"exact-{case}", "prompts": [text], "reset_prefix_cache": True}
                for case, (text, _, _) in exact_prompts().items()],
              *[{"name": f"tail-{n}", "prompts": [text], "reset_prefix_cache": True}
                for n, text in tail_prompts().items()]]
    out = run_in_subprocess(spec(model, offload(store, remote_url=redis_server.url), phases),
                            tmp_path_factory.mktemp("run-b"))
    out["store"] = store
    return out


def test_second_host_loads_what_the_first_served(second_host, reference):
    phase = second_host["phases"][0]
    assert phase["tokens"] == expected(reference, prompts())
    assert phase["metrics"]["hits_external_unspecified"] >= PREFIX_TOKENS
    # Requests sharing the prefix in the same batch wait on the first one's fetch (host hits).
    assert phase["metrics"]["hits_disk"] == 0


def test_remote_chunks_land_in_the_local_tiers(second_host, reference):
    """Fetched chunks are published in B's CPU tier and written to B's disk."""
    phase = second_host["phases"][1]
    assert phase["tokens"] == expected(reference, prompts())
    assert phase["metrics"]["hits_host"] >= PREFIX_TOKENS
    (namespace,) = list_namespaces(second_host["store"])
    entries = list(iter_entries(second_host["store"], namespace["namespace_id"]))
    # B computed no full chunk itself: every chunk on its disk came from Redis.
    assert len(entries) >= PREFIX_TOKENS // CHUNK


@pytest.mark.parametrize("case", list(exact_prompts()))
def test_remote_tier_serves_a_final_whole_chunk_but_its_last_token(second_host, reference,
                                                                   case):
    """Partial hits from the remote tier (issue 33): a prompt of N tokens, whole chunks
    only, its last chunk held only by Redis, loads up to its last token but one (N - 1):
    that chunk is fetched and served short of its last token; greedy tokens equal
    recompute. A final chunk not served would load N - 64 tokens (none for N = 64)."""
    text, n, from_cpu = exact_prompts()[case]
    phase = next(p for p in second_host["phases"] if p["name"] == f"exact-{case}")
    assert phase["tokens"] == expected(reference, [text])
    hits_checkable(phase)
    assert phase["metrics"]["external_hits"] == n - 1
    hits = phase["kv_offload"]
    assert hits["kv_offload_hit_tokens_total{tier=cpu}"] == from_cpu
    assert hits["kv_offload_hit_tokens_total{tier=remote}"] == n - 1 - from_cpu
    assert hits.get("kv_offload_tail_hit_tokens_total{}", 0) == 0
    assert phase["metrics"]["hits_disk"] == 0


@pytest.mark.parametrize("n", list(tail_prompts()))
def test_remote_tier_serves_a_request_tail_to_the_last_token_but_one(second_host, reference,
                                                                      n):
    """Request tails from the remote tier (issue 33): host A stored each prompt's tail
    (the tokens past its last whole chunk) in Redis with a record under its parent; host
    B, which never saw the prompt, loads its whole chunks and its tail from Redis, N - 1
    tokens, and its greedy tokens equal recompute. Without tails on the remote tier it
    loaded the whole chunks only (N - 1 - (N - 1) % 64 tokens; none for N = 45)."""
    text = tail_prompts()[n]
    phase = next(p for p in second_host["phases"] if p["name"] == f"tail-{n}")
    assert phase["tokens"] == expected(reference, [text])
    hits_checkable(phase)
    assert phase["metrics"]["external_hits"] == n - 1
    hits = phase["kv_offload"]
    assert hits["kv_offload_hit_tokens_total{tier=remote}"] == n - 1
    assert hits.get("kv_offload_hit_tokens_total{tier=cpu}", 0) == 0
    assert hits["kv_offload_tail_hit_tokens_total{}"] == (n - 1) % CHUNK
    assert phase["metrics"]["hits_disk"] == 0


def test_cluster_serves_across_three_nodes(model, redis_cluster, reference, tmp_path_factory):
    remote = {"remote_cluster_nodes": redis_cluster.seeds}
    phases = [{"name": "cold", "prompts": prompts()},
              {"name": "remote", "prompts": prompts(), "reset_connector": True}]
    out = run_in_subprocess(spec(model, offload(None, **remote), phases),
                            tmp_path_factory.mktemp("run-cluster"))
    cold, warm = out["phases"]
    assert cold["tokens"] == warm["tokens"] == expected(reference, prompts())
    assert warm["metrics"]["hits_external_unspecified"] >= PREFIX_TOKENS
    keys_per_node = [int(n.cli("dbsize").strip()) for n in redis_cluster.nodes]
    assert all(k > 0 for k in keys_per_node), keys_per_node


def test_server_killed_mid_workload(model, reference, tmp_path_factory):
    """Kill -9 the server while requests load from it, serve while it is down, restart it
    empty: every token equals recompute, and the tier works again once it is back."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis-killed")).start()
    try:
        kill = ["kill", "-9", str(server.proc.pid)]
        phases = [
            {"name": "warm", "prompts": prompts()},
            # Served from Redis first; then killed 0.3 s into the next phase, wherever its
            # requests then are (on a busy machine, before their first load).
            {"name": "served", "prompts": prompts()[4:], "reset_connector": True},
            {"name": "killed", "prompts": prompts(), "reset_connector": True,
             "one_by_one": True, "command_during": {"argv": kill, "after_s": 0.3}},
            {"name": "down", "prompts": later_prompts()},
            # After the restart, the backoff's first call is a probe; writes racing with
            # it are skipped (counted), so a small request brings the tier back first.
            {"name": "probe", "prompts": [make_prompt(200, seed=299)],
             "command_before": server.argv(daemonize=True), "sleep_before_s": 3.0},
            {"name": "back", "prompts": later_prompts(), "reset_connector": True},
            {"name": "remote-again", "prompts": later_prompts() + prompts()[:1],
             "reset_connector": True}]
        out = run_in_subprocess(spec(model, offload(None, remote_url=server.url), phases),
                                tmp_path_factory.mktemp("run-killed"))
    finally:
        server.stop()
    by_name = {p["name"]: p for p in out["phases"]}
    for name, texts in [("warm", prompts()), ("served", prompts()[4:]), ("killed", prompts()),
                        ("down", later_prompts()), ("back", later_prompts()),
                        ("remote-again", later_prompts() + prompts()[:1])]:
        assert by_name[name]["tokens"] == expected(reference, texts), name
    # Not asked of "killed": whether its loads began within 0.3 s depends on the machine.
    assert by_name["served"]["metrics"]["hits_external_unspecified"] > 0, "served before"
    assert by_name["remote-again"]["metrics"]["hits_external_unspecified"] >= 2 * CHUNK
    assert out["log"].count("remote tier") >= 2
    failures = out["log"].count("failed (")
    assert 1 <= failures <= 6, f"one warning per burst and process, got {failures}"
    assert "is back after" in out["log"]


# -- a slow server: side by side with an engine without the remote tier -------------------
# TTFT itself is measured side by side in benchmarks/bench_remote.py (slow-server TTFT):
# tests make no timing claims. Here: what keeps it, checked by counts.


def local_prompts() -> list[str]:
    """Served from the CPU tier after a first pass (local hits)."""
    return [make_prompt(330 + 45 * i, seed=600 + i) for i in range(6)]


def fresh_prompts() -> list[str]:
    """Never seen before: no reuse anywhere."""
    return [make_prompt(300 + 40 * i, seed=700 + i) for i in range(6)]


@pytest.fixture(scope="module")
def slow_side_by_side(model, redis_server, tmp_path_factory) -> dict:
    """Two in-process engines started together, one with the remote tier behind a proxy
    that holds every Redis reply 200-400 ms, one without a remote tier; the same phases on
    each: a cold pass, the same prompts again (CPU-tier hits), fresh prompts; then, for
    the remote engine, the path made fast again and its CPU tier dropped."""
    # Replies held 200-400 ms against a 100 ms budget: past it, and a fast probe fits it
    # even on a loaded test machine.
    proxy = SlowProxy(redis_server.port, delay_s=(0.2, 0.4)).start()
    logs = tmp_path_factory.mktemp("slow-side-by-side")
    engines = {"plain": EngineProcess(model, log_path=logs / "plain.log", in_process=True,
                                      transfer=offload_transfer(offload(None))),
               "remote": EngineProcess(model, log_path=logs / "remote.log", in_process=True,
                                       transfer=offload_transfer(offload(
                                           None, remote_url=proxy.url,
                                           remote_lookup_budget_ms=100.0)))}
    out: dict = {name: {} for name in engines}
    try:
        start_engines(list(engines.values()))
        for name, engine in engines.items():
            side = out[name]
            side["cold"] = engine.generate(local_prompts())
            engine.drain(timeout_s=120)
            side["counters"] = [_counters(engine)]
            engine.reset()  # vLLM's prefix cache: the prompts come from our CPU tier
            side["local"] = engine.generate(local_prompts())
            side["counters"].append(_counters(engine))
            side["fresh"] = engine.generate(fresh_prompts())
            side["counters"].append(_counters(engine))
        out["remote"]["recovered"] = _recover(engines["remote"], proxy)
    finally:
        for engine in engines.values():
            engine.close()
        proxy.stop()
    return out


def _counters(engine: EngineProcess) -> dict:
    return engine.snapshot()["connector"]["counters"]


def _recover(engine: EngineProcess, proxy: SlowProxy) -> dict:
    """The path is fast again: after the backoff, probes (one per burst of requests,
    each answered a miss at once) bring the lookups back, and the prompts, dropped from
    the CPU tier, load from Redis (the asynchronous lookup answered while the requests
    waited). A probe slower than the budget (a loaded machine), or one before the backoff
    ended, keeps the tier skipping: bursts repeat until the prompts load from Redis or
    the deadline passes (the caller asserts the hits). It slept 2.5 s for the backoff
    and 0.5 s for each probe's round trip, which a loaded machine could outlast."""
    proxy.delay_s = (0.0, 0.0)
    deadline = time.monotonic() + 120  # bounds the wait only; each burst checks itself
    seed = 799
    while True:
        engine.generate([make_prompt(200, seed=seed)], max_tokens=1)  # a probe
        engine.drain(timeout_s=120)  # blocks held for copies would keep vLLM's cache
        assert engine.reset(connector=True), "vLLM's prefix cache must be dropped"
        out = engine.generate(local_prompts())
        if out["metrics"]["hits_external_unspecified"] > 0 or time.monotonic() > deadline:
            return out
        seed += 1


def test_slow_server_local_hits_never_ask_the_remote_tier(slow_side_by_side):
    """Every chunk of a local hit is found locally: no remote question, no wait."""
    remote = slow_side_by_side["remote"]
    before, after_local, _ = remote["counters"]
    assert remote["local"]["metrics"]["hits_host"] > 0
    assert after_local["remote_lookups"] == before["remote_lookups"]
    assert after_local["seconds_remote_lookup"] == before["seconds_remote_lookup"]


def test_slow_server_fresh_prompts_are_answered_misses(slow_side_by_side):
    """Fresh prompts are looked up while the server is slow: each answered (a miss),
    the slowness noticed as failed round trips, nothing loaded."""
    remote = slow_side_by_side["remote"]
    _, after_local, after_fresh = remote["counters"]
    assert after_fresh["remote_lookups"] - after_local["remote_lookups"] == len(fresh_prompts())
    assert after_fresh["remote_lookup_errors"] >= 1
    assert remote["fresh"]["metrics"]["external_hits"] == 0


def test_slow_server_tokens_equal_recompute(slow_side_by_side):
    plain, remote = slow_side_by_side["plain"], slow_side_by_side["remote"]
    assert plain["cold"]["metrics"]["external_hits"] == 0, "the reference computes everything"
    reference = plain["cold"]["tokens"]
    for side in (plain, remote):
        assert side["cold"]["tokens"] == reference
        assert side["local"]["tokens"] == reference
    # Fresh prompts hit nowhere: the engine without a remote tier computed them.
    assert remote["fresh"]["tokens"] == plain["fresh"]["tokens"]
    recovered = remote["recovered"]
    assert recovered["tokens"] == reference
    assert recovered["metrics"]["hits_external_unspecified"] > 0, "loaded from Redis again"
