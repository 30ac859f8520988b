"""Decodes while hits load: same-step (sync) loads vs async loads vs plain vLLM, in one run.

Engines ``sync`` (default ``sync_load_budget_ms``) and ``async`` (0), or --contender; each
round, each in turn: N decodes, then K hits arriving every --interval-ms, their prefixes in
the CPU tier only (mode ``<engine>``) or in vLLM's cache (``plain@<engine>``). --decodes 0:
hits alone, an interleaved A/B of option sets. The method: templates/concurrent.md.

    python benchmarks/bench_concurrent.py --quick --json /tmp/concurrent.json
    python benchmarks/bench_concurrent.py --json concurrent.json      # ~3 min, 2 cores
"""

from __future__ import annotations

import json
import os
import statistics
import time
import zlib
from typing import Any

from _common import BenchParser, finish, new_result, paired, rotated
from _engine import TTFT_MODEL, Turns, benchmark_env, suffixed
from _markdown import Targets, fill, fmt, table

from kv_offload.testing.engine import engine_kwargs, offload_transfer
from kv_offload.testing.soak import percentile
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model

WARM_TOKENS = 4  # tokens each decode has before the first hit arrives (first gaps not kept)
CONTENDERS = {"sync": {}, "async": {"sync_load_budget_ms": 0}}
COLUMNS = {"hits": "hits", "ttft_median_ms": "hit TTFT median (ms)", "ttft_p90_ms": "p90",
           "itl_gaps": "decode gaps ending with a hit in flight",
           "itl_median_ms": "their median (ms)", "itl_p99_ms": "p99", "itl_max_ms": "max",
           "base_itl_median_ms": "other gaps: median", "base_itl_p99_ms": "p99",
           "cached_tokens_min": "cached tokens per hit (min)"}
RATIOS = ("ttft_median_ms", "ttft_p90_ms", "paired_ttft", "itl_median_ms", "itl_p99_ms")


def phase(llm: Any, tag: str, hits: list[str], args: Any) -> dict[str, list]:
    """N decodes, then K hits every --interval-ms, until every hit has its token. Returns
    the hits' TTFT (ms) and cached prompt tokens, and the decodes' inter-token gaps (ms):
    ``itl_ms`` those ending while a hit is in flight, ``base_itl_ms`` the others."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine, stamps = llm.llm_engine, {f"{tag}-d{i}": [] for i in range(args.decodes)}
    for rid in stamps:  # outputs carry these ids (vLLM adds a suffix inside)
        engine.add_request(rid, make_prompt(64, seed=zlib.crc32(rid.encode())), SamplingParams(
            temperature=0.0, max_tokens=4096, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
    arrived, ttft, cached, start, end = {}, {}, [], None, 0.0
    while len(ttft) < len(hits):
        now = time.perf_counter()
        if start is None and all(len(s) >= WARM_TOKENS for s in stamps.values()):
            start = now
        while start is not None and len(arrived) < min(
                len(hits), 1 + int((now - start) * 1e3 / args.interval_ms)):
            rid = f"{tag}-h{len(arrived)}"
            engine.add_request(rid, hits[len(arrived)],
                               SamplingParams(temperature=0.0, max_tokens=1))
            arrived[rid] = time.perf_counter()
        if not engine.has_unfinished_requests():  # --decodes 0, between hits: step() blocks
            time.sleep(0.001)
            continue
        for out in engine.step():
            t = time.perf_counter()
            if out.request_id in stamps:
                stamps[out.request_id] += [t] * len(out.outputs[0].token_ids)
            elif out.request_id in arrived and out.request_id not in ttft:
                ttft[out.request_id], end = t - arrived[out.request_id], t
                cached.append(out.num_cached_tokens or 0)
    engine.abort_request(list(stamps))
    loading = [(arrived[r], arrived[r] + ttft[r]) for r in arrived]
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for times in stamps.values():
        for a, b in zip(times[WARM_TOKENS - 1 :], times[WARM_TOKENS:]):
            if b <= end:  # later gaps: no hit to come
                gaps[any(lo < b <= hi for lo, hi in loading)].append((b - a) * 1e3)
    return {"ttft_ms": [ttft[r] * 1e3 for r in arrived], "cached_tokens": cached,
            "itl_ms": gaps[True], "base_itl_ms": gaps[False]}


def run(args: Any) -> dict[str, list[dict[str, list]]]:
    """One engine per contender (vLLM's engine-core processes; this process drives their
    step loops); the hit prompts stored cold, then the rounds. Per mode, each round's
    ``phase``; a kv-offload mode's phase after ``reset_prefix_cache`` (retried while the
    aborted decodes still hold blocks)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model = str(make_tiny_model(**({} if args.quick else TTFT_MODEL)))
    hits = [suffixed(args.length, 60_000 + i, 61_000 + i) for i in range(args.hits)]
    engines = {name: LLM(model=model, **args.engine, kv_transfer_config=KVTransferConfig(
        **offload_transfer({"cpu_size": "1GiB", **extra})))
        for name, extra in args.contenders.items()}
    turns, samples = Turns(0.0) if args.quick else Turns(), {}
    try:
        for llm in engines.values():
            turns.take(llm)
            llm.generate(hits, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        for r in range(args.rounds):
            for name in rotated(list(engines), r):
                turns.take(engines[name])
                for mode in (name, f"plain@{name}")[:: 1 if r % 2 == 0 else -1]:
                    while mode == name and not engines[name].reset_prefix_cache():
                        time.sleep(0.05)
                    samples.setdefault(mode, []).append(phase(engines[name], f"r{r}-{mode}",
                                                              hits, args))
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
    return samples


def summarize(samples: dict[str, list[dict[str, list]]]) -> dict[str, dict[str, Any]]:
    """Per mode, all rounds pooled (``COLUMNS``); a kv-offload mode over the same engine's
    plain mode (``vs_plain``), and the median over rounds of the round's TTFT median over
    plain's (``paired_ttft``)."""
    out: dict[str, dict[str, Any]] = {}
    for mode, rounds in samples.items():
        s = {k: [x for r in rounds for x in r[k]] for k in rounds[0]}
        out[mode] = {"hits": len(s["ttft_ms"]), "cached_tokens_min": min(s["cached_tokens"]),
                     "ttft_median_ms": percentile(s["ttft_ms"], 0.5),
                     "ttft_p90_ms": percentile(s["ttft_ms"], 0.9), "itl_gaps": len(s["itl_ms"]),
                     "itl_max_ms": max(s["itl_ms"], default=None), **{
                         f"{pre}itl_{name}_ms": percentile(s[f"{pre}itl_ms"], q)
                         for pre in ("", "base_") for name, q in (("median", 0.5), ("p99", 0.99))}}
    for mode, row in out.items():
        if (base := out.get(f"plain@{mode}")) is not None:
            per_round = [[statistics.median(r["ttft_ms"]) for r in samples[m]]
                         for m in (mode, f"plain@{mode}")]
            row["vs_plain"] = {**{k: round(row[k] / base[k], 3) for k in RATIOS if base.get(k)},
                               "paired_ttft": round(paired(*per_round) or 0.0, 3)}
    return out


def render_section(data: dict, img: Any, targets: Targets) -> list[str]:
    """This benchmark's section of docs/benchmarks.md (no plot, no target)."""
    modes, load = data["summary"], data["machine"]
    rows = [[mode, *[fmt(s[k], ".1f" if k.endswith("_ms") else "d") for k in COLUMNS]]
            for mode, s in modes.items()]
    ratios = [[mode, *[fmt(s["vs_plain"].get(k)) for k in RATIOS]]
              for mode, s in modes.items() if "vs_plain" in s]
    head = ["mode / plain@mode", "TTFT median", "TTFT p90", "paired per round",
            "gaps with a hit in flight: median", "p99"]
    return fill("concurrent", data, contenders=json.dumps(data["contenders"]),
                loadavg=" -> ".join(" / ".join(f"{x:.1f}" for x in load[k])
                                    for k in ("loadavg_start", "loadavg_end")),
                table="\n".join(table(["mode", *COLUMNS.values()], rows)),
                ratios="\n".join(table(head, ratios)))


def contender(spec: str) -> tuple[str, dict[str, Any]]:
    """'NAME=OPTION=JSON,...' -> (NAME, {OPTION: value})."""
    name, _, rest = spec.partition("=")
    return name, {k: json.loads(v) for k, v in (o.split("=", 1) for o in rest.split(",") if o)}


def main(argv: list[str] | None = None) -> dict:
    parser = BenchParser(__doc__, "smoke test: test model, 512-token prefixes, 1 round")
    parser.sized("--rounds", 16, 1, "interleaved rounds")
    parser.sized("--length", 8192, 512, "prefix tokens of a hit prompt (+16)")
    parser.sized("--hits", 4, 2, "hit prompts per phase (K)")
    parser.sized("--decodes", 4, 2, "decoding requests per phase (N)")
    parser.sized("--interval-ms", 150, 60, "time between two hits' arrivals", type=float)
    parser.add_argument("--contender", action="append", type=contender,
                        metavar="NAME=OPT=JSON,...", help="an engine with these kv-offload "
                        "options (repeatable; default: sync= async=sync_load_budget_ms=0)")
    args = parser.parse_args(argv)
    args.contenders = dict(args.contender or CONTENDERS)
    env = benchmark_env(in_process=False, vllm_default_binding=False)
    os.environ.update(env)
    # One process, several engines, one Prometheus registry: no stat loggers (a hit's
    # num_cached_tokens says it hit; after the reset only kv-offload can serve it).
    args.engine = engine_kwargs(max_model_len=max(args.length + 64, 4224), disable_log_stats=True)
    started = time.perf_counter()
    result = new_result("concurrent", args, model="test default" if args.quick else "tiny",
                        env=env, warm=WARM_TOKENS, **{k: getattr(args, k) for k in (
                            "contenders", "length", "hits", "decodes", "interval_ms", "rounds",
                            "engine")})
    result["samples"] = run(args)
    result["summary"] = summarize(result["samples"])
    return finish(result, args.json, render_section, started)


if __name__ == "__main__":
    main()
