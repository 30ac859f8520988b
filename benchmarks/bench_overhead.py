"""What our connector costs when nothing is reused, and what it gains with 50% reuse.

Two engines of the same process kind run side by side: plain vLLM (no connector) and
vLLM with kv-offload (CPU tier and disk tier on, stores on). Each round gives both the
same batch of prompts, alternating which one goes first, and every round uses new prompts:

  no_reuse   32 distinct prompts of 1k tokens (+16-token suffix), 8 output tokens each:
             everything is computed, and ours also stores every chunk to CPU and disk
  reuse_50   after reset_prefix_cache() on both: 16 prompts repeat a prefix of this
             round's no_reuse batch with a new suffix, 16 are new. vLLM's own cache
             was reset (as if evicted), so plain recomputes them; ours loads them

Throughput is (prompt + output tokens) / wall seconds of the batch; TTFT is vLLM's
per-request first_token_latency (queueing included, all requests arrive at once).
Before each batch the other engine gets SETTLE_S to stop spinning (see _engine.Turns).
Ratios ours/plain are taken per round (paired) and the median is reported. Target:
no_reuse throughput >= 0.97x plain.

    python benchmarks/bench_overhead.py --quick --json /tmp/overhead.json
    python benchmarks/bench_overhead.py --json overhead.json          # ~4 min, 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _engine import Turns, benchmark_env
from _markdown import Targets, fill, fmt, table

from kv_offload.testing.engine import (
    EngineError,
    EngineProcess,
    engine_kwargs,
    offload_transfer,
    start_engines,
)
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model

SUFFIX_TOKENS = 16
TARGET_NO_REUSE = 0.97
WORKLOADS = ("no_reuse", "reuse_50")


def prompts_for(round_: int, args: argparse.Namespace) -> dict[str, list[str]]:
    """This round's two batches (the same for both engines)."""
    def prefix(i: int) -> str:
        return make_prompt(args.prompt_tokens, seed=500_000 + round_ * 1000 + i)

    def suffix(i: int, variant: int) -> str:
        return make_prompt(SUFFIX_TOKENS, seed=700_000 + round_ * 1000 + i * 10 + variant)

    n = args.num_prompts
    no_reuse = [prefix(i) + suffix(i, 0) for i in range(n)]
    reuse = []
    for i in range(n):  # alternate: a repeated prefix with a new suffix, then a new prompt
        reuse.append(prefix(i // 2) + suffix(i // 2, 1) if i % 2 == 0
                     else prefix(n + i) + suffix(n + i, 0))
    return {"no_reuse": no_reuse, "reuse_50": reuse}


def run_batch(engine: EngineProcess, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    out = engine.generate(prompts, max_tokens=max_tokens, one_by_one=False)
    tokens = out["num_prompt_tokens"] + out["num_output_tokens"]
    return {"seconds": out["seconds"], "tokens": tokens,
            "throughput_tok_s": tokens / out["seconds"],
            "output_tok_s": out["num_output_tokens"] / out["seconds"],
            "mean_ttft_s": statistics.fmean(out["ttft_s"]) if out["ttft_s"] else None,
            "external_hit_tokens": int(out["metrics"]["external_hits"]),
            "vllm_hit_tokens": int(out["metrics"]["prefix_cache_hits"])}


def run_rounds(args: argparse.Namespace, plain: EngineProcess, ours: EngineProcess,
               turns: Turns) -> list[dict]:
    rounds = []
    for r in range(args.rounds):
        batches = prompts_for(r, args)
        order = [("plain", plain), ("ours", ours)]
        if r % 2:
            order.reverse()
        row: dict[str, Any] = {"round": r, "first": order[0][0]}
        for workload in WORKLOADS:
            if workload == "reuse_50":
                for _, engine in order:
                    turns.take(engine)
                    if not engine.reset():
                        raise EngineError("vLLM refused reset_prefix_cache: blocks in use")
            for name, engine in order:
                turns.take(engine)
                row.setdefault(workload, {})[name] = run_batch(
                    engine, batches[workload], args.max_tokens)
        rounds.append(row)
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    return rounds


def summarize(rounds: list[dict]) -> dict[str, dict[str, Any]]:
    """Per workload: medians per engine and the median of the paired ours/plain ratios."""
    out: dict[str, dict[str, Any]] = {}
    for workload in WORKLOADS:
        rows = [r[workload] for r in rounds]
        summary: dict[str, Any] = {}
        for name in ("plain", "ours"):
            summary[name] = {
                key: statistics.median(x[name][key] for x in rows)
                for key in ("throughput_tok_s", "output_tok_s", "seconds")
            }
            ttfts = [x[name]["mean_ttft_s"] for x in rows if x[name]["mean_ttft_s"] is not None]
            summary[name]["mean_ttft_s"] = statistics.median(ttfts) if ttfts else None
            summary[name]["external_hit_tokens"] = sum(x[name]["external_hit_tokens"]
                                                       for x in rows)
        summary["throughput_ratio"] = statistics.median(
            x["ours"]["throughput_tok_s"] / x["plain"]["throughput_tok_s"] for x in rows)
        ttft = [x["ours"]["mean_ttft_s"] / x["plain"]["mean_ttft_s"] for x in rows
                if x["ours"]["mean_ttft_s"] and x["plain"]["mean_ttft_s"]]
        summary["ttft_ratio"] = statistics.median(ttft) if ttft else None
        out[workload] = summary
    return out


def render_section(data: dict, img: Path | None, targets: Targets) -> list[str]:
    """This benchmark's section of docs/benchmarks.md (no plot: ``img`` is unused)."""
    rows = []
    for workload, s in data["summary"].items():
        for name in ("plain", "ours"):
            e = s[name]
            ttft = e["mean_ttft_s"] and e["mean_ttft_s"] * 1e3
            rows.append([workload, name, fmt(e["throughput_tok_s"], ".0f"), fmt(ttft, ".0f"),
                         e["external_hit_tokens"], ""])
        rows.append([workload, "ours/plain", fmt(s["throughput_ratio"]), fmt(s["ttft_ratio"]),
                     "", "paired per round, median"])
    v = data["verdict"]
    targets.add("Zero-hit overhead: " + v["target"], v["value"], f">= {v['limit']}", v["pass"],
                "bench_overhead")
    targets.add("50% reuse: throughput ours/plain (gain shown, no target)",
                data["summary"]["reuse_50"]["throughput_ratio"], "-", None, "bench_overhead")
    header = ["workload", "engine", "tokens/s", "mean TTFT (ms)", "external hit tokens", "note"]
    return fill("overhead", num_prompts=data["num_prompts"], prompt_tokens=data["prompt_tokens"],
                suffix_tokens=data["suffix_tokens"], max_tokens=data["max_tokens"],
                ours_config=data["ours_config"], rounds=data["rounds"], env=data["env"],
                table="\n".join(table(header, rows)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 4 prompts of 256 tokens, one round")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 32")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prefix tokens per prompt (default 1024)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens (default 8)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 4)")
    parser.add_argument("--vllm-default-binding", action="store_true",
                        help="leave vLLM's CPU thread binding alone: on 2 cores an engine "
                             "with any connector then gets 2 unbound OpenMP threads, one "
                             "without gets 1 bound thread (default: same binding for all)")
    parser.add_argument("--in-process", action="store_true",
                        help="one process per engine (vLLM's uni executor, no engine-core "
                             "process): fast start-up, not the default topology (implied by "
                             "--quick)")
    parser.add_argument("--dir", type=Path, default=None, help="where the store and logs go")
    args = parser.parse_args(argv)
    args.num_prompts = args.num_prompts or (4 if args.quick else 32)
    args.prompt_tokens = args.prompt_tokens or (256 if args.quick else 1024)
    args.max_tokens = args.max_tokens or (4 if args.quick else 8)
    args.rounds = args.rounds or (1 if args.quick else 4)  # even: each engine first as often
    args.in_process = args.in_process or args.quick
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="kv-offload-overhead-", dir=args.dir))
    ours_cfg = {"cpu_size": "1GiB", "disk_path": str(base / "store"), "disk_size": "4GiB"}
    model = make_tiny_model()
    engine = engine_kwargs(in_process=args.in_process)
    env = benchmark_env(in_process=args.in_process,
                        vllm_default_binding=args.vllm_default_binding)
    started = time.perf_counter()
    plain, ours = start_engines([
        EngineProcess(model, log_path=base / "logs" / f"{name}.log", engine=engine,
                      transfer=transfer, in_process=args.in_process, env=env)
        for name, transfer in (("plain", None), ("ours", offload_transfer(ours_cfg)))])
    ok = False
    try:
        turns = Turns(0.0) if args.quick else Turns()  # --quick: no figures to protect
        warmup = [make_prompt(64, seed=3 + i) for i in range(4)]
        for e in (plain, ours):
            turns.take(e)
            e.generate(warmup, max_tokens=2, one_by_one=False)
        rounds = run_rounds(args, plain, ours, turns)
        ok = True
    finally:
        plain.close()
        ours.close()
        if ok:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"bench_overhead failed; engine logs kept in {base / 'logs'}", file=sys.stderr)
    summary = summarize(rounds)
    value = summary["no_reuse"]["throughput_ratio"]
    result = {
        "bench": "overhead",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
        "model": {"name": "test default", "path": str(model)},
        "engine": engine, "env": env, "in_process": args.in_process,
        "ours_config": {k: v for k, v in ours_cfg.items() if k != "disk_path"},
        "num_prompts": args.num_prompts, "prompt_tokens": args.prompt_tokens,
        "suffix_tokens": SUFFIX_TOKENS, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "startup_s": {"plain": plain.startup_s, "ours": ours.startup_s},
        "per_round": rounds, "summary": summary,
        "verdict": {"target": f"no_reuse throughput ours/plain >= {TARGET_NO_REUSE}",
                    "value": value, "limit": TARGET_NO_REUSE, "pass": value >= TARGET_NO_REUSE},
        "seconds": round(time.perf_counter() - started, 1),
    }
    targets = Targets()
    print("\n".join(["", *render_section(result, None, targets),
                     *table(["target", "measured", "limit", "verdict", "from"], targets.rows)]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
