"""What our connector costs with no reuse or every request storing; what it gains at 50% reuse.

Plain vLLM and kv-offload variants (``VARIANTS``) side by side on the same batches, rotating
order; ratios paired per round. Targets: no_reuse and store_heavy throughput >= 0.97x
plain. The method: templates/overhead.md.

    python benchmarks/bench_overhead.py --quick --json /tmp/overhead.json
    python benchmarks/bench_overhead.py --json overhead.json          # ~10 min, 2 cores
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import BenchParser, add_engine_flags, finish, new_result, paired, rotated, workdir
from _engine import SUFFIX_TOKENS, Turns, benchmark_env, running
from _markdown import Targets, fill, fmt, table

from kv_offload.testing.engine import EngineError, EngineProcess, engine_kwargs, offload_transfer
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model

TARGET = 0.97  # issue 15: no_reuse and store_heavy throughput ours/plain
WORKLOADS = ("no_reuse", "reuse_50", "store_heavy")
CONTENDERS = ("plain", "ours", "ours_bg", "ours_cpu", "ours_noaudit", "ours_ref")
VARIANTS: dict[str, dict[str, Any]] = {  # name -> kv-offload options over the base config (disk_path None: no disk tier)
    "ours": {}, "ours_bg": {"cpu_background_stores": True}, "ours_cpu": {"disk_path": None},
    "ours_noaudit": {"audit_rate": 0.0}}  # ours/ours_noaudit: what the runtime audit costs
GRADED = ("no_reuse", "store_heavy")
PAIRS = (  # (numerator, denominator, key suffix) of the ratios paired per round
    ("ours", "plain", ""), ("ours_bg", "plain", "_bg"), ("ours_cpu", "plain", "_cpu"),
    ("ours_bg", "ours", "_bg_vs_sync"), ("ours", "ours_ref", "_vs_ref"),
    ("ours", "ours_noaudit", "_audit"))


def prompts_for(round_: int, args: argparse.Namespace) -> dict[str, list[str]]:
    """This round's two batches (the same for both engines)."""
    def prefix(i: int) -> str:
        return make_prompt(args.prompt_tokens, seed=500_000 + round_ * 1000 + i)

    def suffix(i: int, variant: int) -> str:
        return make_prompt(SUFFIX_TOKENS, seed=700_000 + round_ * 1000 + i * 10 + variant)

    n, h = args.num_prompts, args.heavy_prompts
    no_reuse = [prefix(i) + suffix(i, 0) for i in range(n)]
    # reuse_50 alternates: a prefix of no_reuse with a new suffix, then a new prompt
    reuse = [prefix(i // 2) + suffix(i // 2, 1) if i % 2 == 0 else prefix(n + i) + suffix(n + i, 0)
             for i in range(n)]
    # lengths spread over one chunk: requests complete their chunks on different steps
    heavy = [make_prompt(args.heavy_prompt_tokens + i * args.chunk_tokens // h,
                         seed=900_000 + round_ * 1000 + i) for i in range(h)]
    return {"no_reuse": no_reuse, "reuse_50": reuse, "store_heavy": heavy}


def run_batch(engine: EngineProcess, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    out = engine.generate(prompts, max_tokens=max_tokens, one_by_one=False)
    tokens = out["num_prompt_tokens"] + out["num_output_tokens"]
    return {"seconds": out["seconds"], "tokens": tokens,
            "throughput_tok_s": tokens / out["seconds"],
            "output_tok_s": out["num_output_tokens"] / out["seconds"],
            "mean_ttft_s": statistics.fmean(out["ttft_s"]) if out["ttft_s"] else None,
            "external_hit_tokens": int(out["metrics"]["external_hits"]),
            "vllm_hit_tokens": int(out["metrics"]["prefix_cache_hits"]),
            # reported by the time the batch returned; readable in-process only
            "chunks_stored": out["kv_offload"].get("kv_offload_chunks_stored_total{tier=cpu}")}


def run_rounds(args: argparse.Namespace, engines: dict[str, EngineProcess],
               turns: Turns) -> list[dict]:
    """Every workload on every engine per round; the engines' order rotates per round."""
    rounds = []
    names = list(engines)
    max_tokens = {"no_reuse": args.max_tokens, "reuse_50": args.max_tokens,
                  "store_heavy": args.heavy_max_tokens}
    for r in range(args.rounds):
        batches = prompts_for(r, args)
        order = rotated(names, r)
        row: dict[str, Any] = {"round": r, "order": order}
        for workload in args.workloads:
            if workload == "reuse_50":
                for name in order:
                    turns.take(engines[name])
                    if not engines[name].reset():
                        raise EngineError("vLLM refused reset_prefix_cache: blocks in use")
            for name in order:
                turns.take(engines[name])
                row.setdefault(workload, {})[name] = run_batch(
                    engines[name], batches[workload], max_tokens[workload])
        rounds.append(row)
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    return rounds


def summarize(rounds: list[dict], workloads: list[str]) -> dict[str, dict[str, Any]]:
    """Per workload: medians per engine and the medians of the paired ratios (``PAIRS``)."""
    out: dict[str, dict[str, Any]] = {}
    for workload in workloads:
        rows = [r[workload] for r in rounds]
        summary: dict[str, Any] = {}
        for name in (n for n in CONTENDERS if n in rows[0]):
            summary[name] = {key: statistics.median(x[name][key] for x in rows)
                             for key in ("throughput_tok_s", "output_tok_s", "seconds")}
            ttfts = [x[name]["mean_ttft_s"] for x in rows if x[name]["mean_ttft_s"] is not None]
            summary[name]["mean_ttft_s"] = statistics.median(ttfts) if ttfts else None
            for key in ("external_hit_tokens", "chunks_stored"):
                counts = [x[name].get(key) for x in rows]
                summary[name][key] = None if None in counts else int(sum(counts))
        for num, den, suffix in PAIRS:
            if num in summary and den in summary:
                for key, ratio in (("throughput_tok_s", "throughput_ratio"),
                                   ("mean_ttft_s", "ttft_ratio")):  # median over rounds
                    summary[ratio + suffix] = paired(*([x[n][key] for x in rows]
                                                       for n in (num, den)))
        out[workload] = summary
    return out


def render_section(data: dict, img: Path | None, targets: Targets) -> list[str]:
    """This benchmark's section of docs/benchmarks.md (no plot: ``img`` is unused)."""
    rows = []
    for workload, s in data["summary"].items():
        for name in (n for n in CONTENDERS if n in s):  # older runs: fewer engines
            e = s[name]
            ttft = e["mean_ttft_s"] and e["mean_ttft_s"] * 1e3
            rows.append([workload, name, fmt(e["throughput_tok_s"], ".0f"), fmt(ttft, ".0f"),
                         e["external_hit_tokens"], fmt(e.get("chunks_stored"), ".0f"), ""])
        for num, den, suffix in (p for p in PAIRS if "throughput_ratio" + p[2] in s):
            rows.append([workload, f"{num}/{den}", fmt(s["throughput_ratio" + suffix]),
                         fmt(s["ttft_ratio" + suffix]), "", "", "paired per round, median"])
    for v in data["verdicts"]:
        targets.add(v["target"], v["value"], f">= {v['limit']}", v["pass"], "bench_overhead")
    if "reuse_50" in data["summary"]:
        targets.add("50% reuse: throughput ours/plain (gain shown, no target)",
                    data["summary"]["reuse_50"]["throughput_ratio"], "-", None, "bench_overhead")
    sync = {w: s["throughput_ratio_bg_vs_sync"] for w, s in data["summary"].items()}
    load = data["machine"]
    header = ["workload", "engine", "tokens/s", "mean TTFT (ms)", "external hit tokens",
              "chunks stored (CPU)", "note"]
    return fill("overhead", data, topology="one process per engine (--in-process)"
                if data["in_process"] else "vLLM's default engine processes",
                loadavg=f"{load['loadavg_start'][0]:.2f} -> {load['loadavg_end'][0]:.2f}",
                bg_vs_sync=", ".join(f"{w} {fmt(v)}" for w, v in sync.items()),
                table="\n".join(table(header, rows)), notes="\n\n".join(data.get("notes", [])),
                reference=(f" `ours_ref`: `ours` run from another checkout, at {ref['commit']} "
                           "(`--reference-tree`), so that `ours/ours_ref` measures the change "
                           "since then side by side.") if (ref := data.get("reference")) else "")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, "smoke test: 4 prompts of 256 tokens, one round")
    parser.sized("--num-prompts", 32, 4, "prompts per batch")
    parser.sized("--prompt-tokens", 1024, 256, "prefix tokens per prompt")
    parser.sized("--max-tokens", 8, 4, "output tokens")
    parser.sized("--rounds", 6, 1, "interleaved rounds")  # each engine first as often
    parser.sized("--heavy-prompts", 16, 2, "store_heavy: prompts per batch")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated subset to run (reuse_50 needs no_reuse)")
    parser.add_argument("--chunk-tokens", type=int, default=64, help="kv-offload's chunk_tokens")
    parser.add_argument("--reference-tree", type=Path, metavar="DIR", help="also run `ours` "
                        "from another checkout (`git worktree add DIR <commit>`) as ours_ref")
    add_engine_flags(parser)
    parser.add_workdir()
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    args.workloads = [w for w in WORKLOADS if w in names]
    if (set(names) - set(WORKLOADS) or not args.workloads
            or ("reuse_50" in args.workloads and "no_reuse" not in args.workloads)):
        parser.error(f"--workloads: a non-empty subset of {','.join(WORKLOADS)}; reuse_50 "
                     "repeats prefixes of no_reuse, so it needs no_reuse too")
    # store_heavy: prompts of 3 chunks (--quick 1) + up to one more, 192 output tokens
    args.heavy_prompt_tokens = args.chunk_tokens * (1 if args.quick else 3)
    args.heavy_max_tokens = 2 * args.chunk_tokens if args.quick else 192
    args.in_process = args.in_process or args.quick
    tree = args.reference_tree  # which checkout ours_ref runs: its path and commit
    args.reference = tree and {"tree": str(tree), "commit": subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h"], capture_output=True, text=True,
        check=False).stdout.strip() or "unknown"}
    return args


def verdicts(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per graded workload and kv-offload variant."""
    out = []
    for workload in (w for w in GRADED if w in summary):
        for name, suffix in (("ours", ""), ("ours_bg", "_bg"), ("ours_cpu", "_cpu")):
            value = summary[workload]["throughput_ratio" + suffix]
            out.append({"target": f"{workload} throughput {name}/plain >= {TARGET}",
                        "value": value, "limit": TARGET,
                        "pass": value is not None and value >= TARGET})
    return out


def contenders(args: argparse.Namespace, base: Path, ours_cfg: dict, model: Path,
               engine: dict, env: dict) -> dict[str, EngineProcess]:
    """Plain vLLM and each variant (each with a store of its own: no shared hits), plus
    ours_ref from ``--reference-tree`` (its checkout first on PYTHONPATH); not started."""
    configs: dict[str, dict | None] = {"plain": None}
    variants: dict[str, dict] = {**VARIANTS, **({"ours_ref": {}} if args.reference_tree else {})}
    for name, extra in variants.items():
        config = {**ours_cfg, "disk_path": str(base / f"store-{name}"), **extra}
        if config["disk_path"] is None:  # no disk tier
            del config["disk_path"], config["disk_size"]
        configs[name] = config
    ref_env = {**env, "PYTHONPATH": str(args.reference_tree.resolve())} if args.reference_tree else env
    names = [n for n in CONTENDERS if n in configs]
    return {name: EngineProcess(model, log_path=base / "logs" / f"{name}.log", engine=engine,
                                transfer=configs[name] and offload_transfer(configs[name]),
                                in_process=args.in_process,
                                env=ref_env if name == "ours_ref" else env) for name in names}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    base = workdir(args, "overhead")
    ours_cfg = {"cpu_size": "1GiB", "disk_size": "4GiB", "chunk_tokens": args.chunk_tokens,
                "store_generated": True}
    model = make_tiny_model()
    engine = engine_kwargs(in_process=args.in_process)
    env = benchmark_env(in_process=args.in_process, vllm_default_binding=args.vllm_default_binding)
    started, loadavg_start = time.perf_counter(), os.getloadavg()
    engines = contenders(args, base, ours_cfg, model, engine, env)
    try:
        with running(list(engines.values())):
            turns = Turns(0.0) if args.quick else Turns()  # --quick: no figures to protect
            warmup = [make_prompt(64, seed=3 + i) for i in range(4)]
            for e in engines.values():
                turns.take(e)
                e.generate(warmup, max_tokens=2, one_by_one=False)
            rounds = run_rounds(args, engines, turns)
    except BaseException:
        print(f"bench_overhead failed; engine logs kept in {base / 'logs'}", file=sys.stderr)
        raise
    shutil.rmtree(base, ignore_errors=True)
    summary = summarize(rounds, args.workloads)
    result = new_result(
        "overhead", args, model={"name": "test default", "path": str(model)}, engine=engine,
        env=env, in_process=args.in_process, ours_config=ours_cfg, variants=VARIANTS,
        **{k: getattr(args, k) for k in ("num_prompts", "prompt_tokens", "max_tokens", "rounds",
                                         "heavy_prompts", "heavy_prompt_tokens",
                                         "heavy_max_tokens", "workloads")},
        suffix_tokens=SUFFIX_TOKENS, startup_s={name: e.startup_s for name, e in engines.items()},
        per_round=rounds, summary=summary, verdicts=verdicts(summary), reference=args.reference)
    result["machine"]["loadavg_start"] = loadavg_start
    return finish(result, args.json, render_section, started)


if __name__ == "__main__":
    main()
