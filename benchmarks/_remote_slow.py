"""bench_remote's slow-server TTFT: two engines side by side, one with the remote tier
behind a proxy that holds every Redis reply 50-200 ms, one without a remote tier.

Per round, vLLM's prefix caches are dropped and the engines run, one request at a time
with max_tokens=1, alternating request by request (which engine goes first alternates
too): the "local" prompts (stored in the CPU tier by a first pass: local hits) and
"fresh" prompts (never seen: no reuse anywhere). Median TTFT per kind and length,
remote / plain of the medians (target: <= 1.2) and the median of the per-request
ratios (paired samples: robust to load from other processes). The tokens of
both engines must be equal (the script reports it).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from kv_offload.testing.engine import EngineProcess, offload_transfer, start_engines
from kv_offload.testing.redis_server import SlowProxy
from kv_offload.testing.tiny_model import make_prompt

DELAY_S = (0.05, 0.2)


def _prompt(length: int, seed: int) -> str:
    return make_prompt(length, seed=seed) + make_prompt(16, seed=900_000 + seed)


def _flush(engine: EngineProcess, seed: int) -> None:
    """Short requests that step the engine, so the first pass's stores are reported
    and published in the CPU tier before the local prompts come back."""
    for i in range(2):
        engine.generate([make_prompt(32, seed=seed + i)], max_tokens=1)
        time.sleep(0.3)


def bench_slow_ttft(args: Any, server_port: int, base: Path, model: Path,
                    engine: dict, env: dict) -> dict:
    lengths = args.lengths
    local = [_prompt(n, 50_000 + n) for n in lengths]
    proxy = SlowProxy(server_port, delay_s=DELAY_S).start()
    offload = {"cpu_size": "1GiB", "remote_timeout_s": args.timeout_s}
    engines = {
        name: EngineProcess(model, log_path=base / "slow" / f"{name}.log", engine=engine,
                            transfer=offload_transfer(extra), in_process=args.in_process,
                            env=env, timeout_s=1800)
        for name, extra in (("plain", offload),
                            ("remote", {**offload, "remote_url": proxy.url}))}
    samples: dict[str, dict[str, dict[int, list[float]]]] = {
        name: {"local": {}, "fresh": {}} for name in engines}
    tokens: dict[str, list] = {name: [] for name in engines}
    local_hits = dict.fromkeys(engines, 0.0)
    try:
        start_engines(list(engines.values()))
        for i, eng in enumerate(engines.values()):
            tokens[list(engines)[i]].append(
                eng.generate(local, max_tokens=1, one_by_one=True)["tokens"])
            _flush(eng, 60_000)
        for rnd in range(args.rounds):
            fresh = [_prompt(n, 70_000 + 100 * rnd + n) for n in lengths]
            for eng in engines.values():
                eng.reset()
            for kind, prompts in (("local", local), ("fresh", fresh)):
                for i, (n, prompt) in enumerate(zip(lengths, prompts)):
                    # Request by request, engines alternating first: paired samples.
                    names = list(engines) if (rnd + i) % 2 == 0 else list(engines)[::-1]
                    for name in names:
                        out = engines[name].generate([prompt], max_tokens=1, one_by_one=True)
                        tokens[name].append(out["tokens"])
                        if kind == "local":
                            local_hits[name] += out["metrics"]["hits_host"]
                        samples[name][kind].setdefault(n, []).append(out["latency_s"][0])
    finally:
        for eng in engines.values():
            eng.close()
        proxy.stop()
    medians = {name: {kind: {str(n): statistics.median(v) for n, v in per.items()}
                      for kind, per in kinds.items()} for name, kinds in samples.items()}
    ratios = {kind: {str(n): round(medians["remote"][kind][str(n)]
                                   / medians["plain"][kind][str(n)], 3) for n in lengths}
              for kind in ("local", "fresh")}
    paired = {kind: {str(n): round(statistics.median(
        r / p for r, p in zip(samples["remote"][kind][n], samples["plain"][kind][n])), 3)
        for n in lengths} for kind in ("local", "fresh")}
    return {"delay_ms": [d * 1e3 for d in DELAY_S], "lengths": lengths, "rounds": args.rounds,
            "median_s": medians, "ratios": ratios, "paired_ratio_medians": paired,
            "local_hit_tokens": local_hits,
            "tokens_equal": tokens["plain"] == tokens["remote"],
            "samples_s": samples}
