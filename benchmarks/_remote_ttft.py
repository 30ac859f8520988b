"""bench_remote's TTFT figures and their report lines: loading from Redis against cold
prefill, and a slow server against no remote tier, paired (target: <= 1.2x).
The method: templates/remote_ttft.md and remote_slow.md."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import paired
from _engine import SETTLE_S, SUFFIX_TOKENS, TTFT_MODEL, running, suffixed, ttft_engine
from _markdown import Targets, fill, fmt, table, verdict

from kv_offload.testing.engine import EngineProcess, offload_transfer
from kv_offload.testing.redis_server import SlowProxy
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model

SLOW_TARGET = 1.2  # the slow server: TTFT remote / no remote tier, medians
DELAY_S = (0.05, 0.2)


def engine_parts(args: argparse.Namespace, server: Any, base: Path, result: dict) -> str | None:
    """The TTFT parts, into ``result["ttft"]`` and ``result["slow_ttft"]``. A part that
    fails records its error and the others still run; returns what failed, or None."""
    failed = []
    for key, part in (("ttft", lambda: bench_ttft(args, server.url, base)),
                      ("slow_ttft", lambda: slow_ttft(args, server.port, base))):
        try:
            result[key] = part()
        except Exception as exc:  # keep the other figures; fail at the end
            first = (str(exc).strip().splitlines() or [""])[0]
            result[key] = {"error": f"{type(exc).__name__}: {first}"[:300]}
            print(str(exc)[-4000:], file=sys.stderr)
        if "error" in result[key]:
            failed.append(f"{key} failed: {result[key]['error']}")
    ttft = result["ttft"]  # say so when the remote pass did not load all its prefixes
    if ttft.get("remote_hit_tokens", 1) < ttft.get("expected_hit_tokens", 0):
        print(f"WARNING: the remote pass loaded {ttft['remote_hit_tokens']:.0f} of "
              f"{ttft['expected_hit_tokens']} prefix tokens from the remote tier "
              f"({ttft['remote_pass_host_hit_tokens']:.0f} from the CPU tier)",
              file=sys.stderr, flush=True)
    return "; ".join(failed) or None


def _setup(args: argparse.Namespace) -> tuple[dict, Path, dict, dict]:
    """(model geometry, model path, engine kwargs, environment) of both TTFT parts:
    bench_ttft's default model (its cached files are reused), the test model with --quick."""
    model_kwargs = {} if args.quick else dict(TTFT_MODEL)
    return model_kwargs, make_tiny_model(**model_kwargs), *ttft_engine(
        args.lengths, in_process=args.in_process)


def _prompt(length: int, seed: int) -> str:
    return suffixed(length, seed, 700_000 + seed)


def bench_ttft(args: argparse.Namespace, url: str, base: Path) -> dict:
    """One engine, remote tier on, no disk tier: per round new prompts cold, then again
    after reset_prefix_cache(reset_connector=True), loaded from Redis."""
    model_kwargs, model, engine, env = _setup(args)
    offload = {"cpu_size": "1GiB", "remote_url": url, "remote_timeout_s": args.timeout_s,
               "connector_reset": "cpu"}  # the reset leaves Redis serving
    samples: dict[str, dict[int, list[float]]] = {"cold": {}, "remote": {}}
    hits = dict.fromkeys(("remote_hit_tokens", "remote_pass_host_hit_tokens",
                          "cold_external_hit_tokens"), 0.0)
    mismatches = []
    started = time.perf_counter()
    with EngineProcess(model, log_path=base / "engine" / "log.txt", engine=engine,
                       transfer=offload_transfer(offload), in_process=args.in_process,
                       env=env, timeout_s=1800) as eng:
        eng.generate([make_prompt(64, seed=7)], max_tokens=1)  # warm-up
        for rnd in range(args.rounds):
            prompts = [_prompt(n, 30_000 + n * 10 + rnd) for n in args.lengths]
            cold = eng.generate(prompts, max_tokens=1, one_by_one=True)
            # A chunk's CPU-tier entry stays pinned until its remote write is reported,
            # at an engine step after the write ends; reset_connector keeps pinned
            # entries (the remote pass would then hit the CPU tier): short requests,
            # with pauses for the writes, step the engine first.
            _flush(eng, 8 + 10 * rnd)
            eng.reset(connector=True)
            remote = eng.generate(prompts, max_tokens=1, one_by_one=True)
            if cold["tokens"] != remote["tokens"]:
                mismatches.append(rnd)
            for mode, out in (("cold", cold), ("remote", remote)):
                for n, latency in zip(args.lengths, out["latency_s"]):
                    samples[mode].setdefault(n, []).append(latency)
            hits["remote_hit_tokens"] += remote["metrics"]["hits_external_unspecified"]
            hits["remote_pass_host_hit_tokens"] += remote["metrics"]["hits_host"]
            hits["cold_external_hit_tokens"] += cold["metrics"]["external_hits"]
    result: dict[str, Any] = {
        "model": {"name": "test default" if args.quick else "tiny", **model_kwargs},
        "engine": engine, "env": env, "offload": {k: v for k, v in offload.items()
                                                  if k != "remote_url"},
        "lengths": args.lengths, "suffix_tokens": SUFFIX_TOKENS, "rounds": args.rounds,
        "startup_s": round(eng.startup_s or 0.0, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "modes": {mode: {str(n): {"median_s": statistics.median(v), "samples_s": v}
                         for n, v in per.items()} for mode, per in samples.items()},
        **hits, "expected_hit_tokens": args.rounds * sum(args.lengths),
        "tokens_equal": not mismatches}
    result["ratios"] = {str(n): round(result["modes"]["remote"][str(n)]["median_s"]
                                      / result["modes"]["cold"][str(n)]["median_s"], 4)
                        for n in args.lengths}
    if mismatches:
        result["error"] = f"tokens differ between the cold and remote passes in rounds {mismatches}"
    return result


def _flush(engine: EngineProcess, seed: int) -> None:
    """Short requests that step the engine, with pauses for the I/O threads, so that
    earlier stores (host copies, remote writes) are reported to the scheduler."""
    for i in range(2):
        # two tokens: a request that ends in its prefill step is held while its prompt
        # tail is copied (reported a step later), and vLLM then refuses a reset
        engine.generate([make_prompt(32, seed=seed + i)], max_tokens=2)
        time.sleep(0.3)


def slow_ttft(args: argparse.Namespace, server_port: int, base: Path) -> dict:
    """The slow server against no remote tier, side by side (see the module docstring)."""
    _, model, engine, env = _setup(args)
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
        with running(list(engines.values())):
            for name, eng in engines.items():
                tokens[name].append(eng.generate(local, max_tokens=1, one_by_one=True)["tokens"])
                _flush(eng, 60_000)
            for rnd in range(args.rounds):
                fresh = [_prompt(n, 70_000 + 100 * rnd + n) for n in lengths]
                for eng in engines.values():
                    eng.reset()
                for kind, prompts in (("local", local), ("fresh", fresh)):
                    for i, (n, prompt) in enumerate(zip(lengths, prompts)):
                        # Request by request, engines alternating first: paired samples.
                        # vLLM's queue readers spin for 1 s after each message: the engine
                        # that just ran would slow the other one down, so wait it out.
                        names = list(engines) if (rnd + i) % 2 == 0 else list(engines)[::-1]
                        for name in names:
                            time.sleep(SETTLE_S)
                            out = engines[name].generate([prompt], max_tokens=1, one_by_one=True)
                            tokens[name].append(out["tokens"])
                            if kind == "local":
                                local_hits[name] += out["metrics"]["hits_host"]
                            samples[name][kind].setdefault(n, []).append(out["latency_s"][0])
    finally:  # after the engines
        proxy.stop()
    medians = {name: {kind: {str(n): statistics.median(v) for n, v in per.items()}
                      for kind, per in kinds.items()} for name, kinds in samples.items()}
    ratios = {kind: {str(n): round(medians["remote"][kind][str(n)]
                                   / medians["plain"][kind][str(n)], 3) for n in lengths}
              for kind in ("local", "fresh")}
    pairs = {kind: {str(n): round(paired(samples["remote"][kind][n],
                                         samples["plain"][kind][n]) or 0.0, 3)
                    for n in lengths} for kind in ("local", "fresh")}
    return {"delay_ms": [d * 1e3 for d in DELAY_S], "lengths": lengths, "rounds": args.rounds,
            "median_s": medians, "ratios": ratios, "paired_ratio_medians": pairs,
            "local_hit_tokens": local_hits, "tokens_equal": tokens["plain"] == tokens["remote"],
            "samples_s": samples}


def ttft_lines(ttft: dict | None) -> list[str]:
    if not ttft or "modes" not in ttft:
        return [f"**TTFT.** Not measured: {(ttft or {}).get('error', 'no data')}.", ""]
    lengths = [str(n) for n in ttft["lengths"]]
    in_process = ttft["env"].get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    rows = [[mode, *[fmt(ttft["modes"][mode][n]["median_s"] * 1e3, ".1f") for n in lengths]]
            for mode in ("cold", "remote")]
    rows.append(["remote / cold", *[fmt(ttft["ratios"][n]) for n in lengths]])
    return fill("remote_ttft", ttft, model=ttft["model"]["name"],
        in_process="\n".join(fill("remote_in_process")) + "\n" if in_process else "",
        table="\n".join(table(["TTFT", *[f"L={n} (ms)" for n in lengths]], rows)),
        ratios=", ".join(f"{fmt(ttft['ratios'][n], '.2f')}x at {n} tokens" for n in lengths),
        hits=fmt(ttft["remote_hit_tokens"], ".0f"), expected=fmt(ttft["expected_hit_tokens"], ".0f"),
        host_hits=fmt(ttft["remote_pass_host_hit_tokens"], ".0f"),
        startup=fmt(ttft["startup_s"], ".0f"))


def slow_ttft_lines(slow: dict | None, targets: Targets) -> list[str]:
    """The slow-server TTFT (``bench_slow_ttft``) and its target row."""
    if not slow:
        return []
    if "error" in slow:
        return [f"**TTFT with a slow server.** Not measured: {slow['error']}.", ""]
    cases = [(kind, str(n)) for kind in ("local", "fresh") for n in slow["lengths"]]
    ratios = [slow["ratios"][kind][n] for kind, n in cases]
    targets.add(f"Remote tier behind a server held {slow['delay_ms'][0]:.0f}-"
                f"{slow['delay_ms'][1]:.0f} ms: TTFT <= {SLOW_TARGET}x without a remote tier "
                f"({sum(r <= SLOW_TARGET for r in ratios)} of {len(ratios)} cases)",
                max(ratios), f"<= {SLOW_TARGET} (worst case shown)",
                all(r <= SLOW_TARGET for r in ratios), "bench_remote")
    return fill("remote_slow", slow, low=f"{slow['delay_ms'][0]:.0f}",
                high=f"{slow['delay_ms'][1]:.0f}", local_hits=slow["local_hit_tokens"],
                table="\n".join(table(
                    ["prompts", "L", "no remote tier (ms)", "remote tier (ms)", "ratio of medians",
                     "median of paired ratios", "verdict"],
                    [[kind, n, fmt(slow["median_s"]["plain"][kind][n] * 1e3, ".1f"),
                      fmt(slow["median_s"]["remote"][kind][n] * 1e3, ".1f"),
                      fmt(slow["ratios"][kind][n]), fmt(slow["paired_ratio_medians"][kind][n]),
                      verdict(slow["ratios"][kind][n] <= SLOW_TARGET)] for kind, n in cases])))
