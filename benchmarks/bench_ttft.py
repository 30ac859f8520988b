"""Time to first token on vLLM's CPU backend: cold, vLLM's prefix cache, our tiers, the peer.

Prompts of L + 16 tokens, one request at a time, in the modes of ``MODES``; engines side
by side in rotating blocks (``_engine.Turns``), then ours and the peer restarted. Our hits
are paired with vLLM hits of the same prompts on the same engine (``PAIRED``); targets in
``TARGETS``. ``--sliding-window``: a Gemma-3-style model and its device KV capacity
(templates/hybrid.md), no peer. ``--chat``: multi-turn chats on a small KV cache, plain vLLM
and kv-offload with and without partial hits (templates/chat.md). The method: templates/ttft.md.

    python benchmarks/bench_ttft.py --quick --json /tmp/ttft.json   # tiny, 2 short lengths
    python benchmarks/bench_ttft.py --json ttft.json                  # 1k-8k, ~6 min
    python benchmarks/bench_ttft.py --chat 8 --json chat.json         # ~4 min
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import time
from itertools import combinations
from pathlib import Path

from _common import BenchParser, add_engine_flags, csv, finish, new_result, paired, rotated, workdir
from _engine import MODELS, SETTLE_S, SUFFIX_TOKENS, Turns, running, suffixed, ttft_engine
from _markdown import Targets, fill, fmt, pyplot, save, table

from kv_offload.testing import kv_capacity as kv
from kv_offload.testing.engine import (
    EngineError,
    EngineProcess,
    example_transfer_config,
    offload_transfer,
)
from kv_offload.testing.tiny_model import make_prompt, make_tiny_hybrid_model, make_tiny_model

MODES = {  # mode -> what it measures, in table order
    "cold": "cold prefill, no connector",
    "cold_ours": "cold prefill, with kv-offload storing",
    "cold_peer": "cold prefill, with ExampleConnector storing",
    "vllm_hit": "vLLM prefix-cache hit (upper bound)",
    "cpu": "kv-offload CPU tier (after reset_prefix_cache)",
    "cpu_new_suffix": "kv-offload CPU tier, same prefix + new suffix",
    "disk": "kv-offload disk tier, fresh process",
    "cpu_after_restart": "kv-offload, fresh process, 2nd+ pass (CPU tier)",
    "peer_same_process": "ExampleConnector, same process after reset",
    "peer_warm": "ExampleConnector warm, fresh process",
    "own_hit": "vLLM prefix-cache hit on kv-offload's engine, after each CPU-tier block",
    "own_hit_restarted": "the same on the restarted engine, after its disk-tier block",
}
RATIOS = (  # (name, numerator mode, denominator mode), in table order
    ("cpu_vs_cold", "cpu", "cold"), ("disk_vs_cold", "disk", "cold"),
    ("vllm_hit_vs_cold", "vllm_hit", "cold"), ("cpu_new_suffix_vs_cold", "cpu_new_suffix", "cold"),
    ("peer_vs_cold", "peer_warm", "cold"), ("cpu_vs_peer", "cpu", "peer_warm"),
    ("disk_vs_peer", "disk", "peer_warm"), ("cold_ours_vs_cold", "cold_ours", "cold"),
    ("cpu_vs_vllm_hit", "cpu", "vllm_hit"), ("disk_vs_vllm_hit", "disk", "vllm_hit"))
PAIRED = (  # (name, mode, its vLLM-hit mode): median of per-prompt ratios, same engine
    ("cpu_vs_own_hit", "cpu", "own_hit"), ("disk_vs_own_hit", "disk", "own_hit_restarted"))
CHAT = {"plain": None, "whole": {"partial_hits": False}, "partial": {}}  # --chat's engines
SYSTEM_TOKENS, USER_TOKENS, REPLY_TOKENS = 300, (30, 200), (50, 150)  # --chat's text
# --sliding-window: vLLM's device KV plan with its hybrid manager off and on (templates/hybrid.md)
CAPACITY_ENGINE = dict(max_num_batched_tokens=2048, kv_cache_memory_bytes=512 << 20)
CONTEXTS, IN_FLIGHT, BUDGET_GIB = (32768, 131072), (2048, 8192, 16384), 64
TARGETS = (  # (ratio key, limit, what, prompt length graded)
    ("cpu_vs_cold", 0.15, "CPU-tier hit <= 0.15x cold prefill", 4096),
    ("disk_vs_cold", 0.25, "disk-tier hit after restart <= 0.25x cold prefill", 4096),
    ("cpu_vs_peer", 0.5, "ours (CPU tier) <= 0.5x ExampleConnector warm", 4096),
    ("disk_vs_peer", 0.5, "ours (disk tier, restarted) <= 0.5x ExampleConnector warm", 4096),
    # DESIGN.md: the floor, not cold prefill, is the yardstick
    ("cpu_vs_own_hit", 1.1, "CPU-tier hit <= 1.1x vLLM's own prefix-cache hit (paired)", 8192),
    ("disk_vs_own_hit", 1.3,
     "disk-tier hit after restart <= 1.3x vLLM's own prefix-cache hit (paired)", 8192),
)


def prompt(length: int, rep: int, *, suffix: int = 0) -> str:
    """Prefix ``length`` tokens (one per (length, rep)) + a 16-token suffix ``suffix``."""
    seed = 10_000 + length * 10 + rep  # distinct seeds: same-seed prompts share a prefix
    return suffixed(length, seed, 900_000 + seed * 10 + suffix)


class Recorder:
    """TTFT samples per (mode, length), with the hit metrics of each request. An engine
    that fails is recorded (``errors``) and skipped from then on: it costs its own figures."""

    def __init__(self, turns: Turns, in_process: bool) -> None:
        self.samples: dict[str, dict[int, list[dict]]] = {}
        self.errors: dict[str, str] = {}
        self.turns, self.in_process = turns, in_process
        self._dead: set[int] = set()

    def warm_up(self, engines: list[EngineProcess]) -> None:
        """One short request per engine: first-request costs stay out of the figures."""
        for i, engine in enumerate(engines):
            self.turns.take(engine)
            engine.generate([make_prompt(64, seed=7 + i)], max_tokens=1)

    def block(self, engine: EngineProcess | None, mode: str, prompts: list[tuple[int, str]]
              ) -> None:
        """Run (length, text) requests one by one on ``engine``, recorded as ``mode``."""
        for length, text in prompts:
            if engine is None or id(engine) in self._dead:  # None: not in this run
                return
            self.turns.take(engine)
            try:
                out = engine.generate([text], max_tokens=1, one_by_one=True)
            except EngineError as exc:
                self._dead.add(id(engine))
                first = str(exc).splitlines()[0]
                self.errors[mode] = f"L={length}: {first} (engine log: {engine.log_path.name})"
                print(f"  {mode} at L={length} failed: {first}", file=sys.stderr, flush=True)
                return
            m = out["metrics"]
            self.samples.setdefault(mode, {}).setdefault(length, []).append({
                "ttft_s": out["latency_s"][0], "served": out["cached_tokens"][0],
                "vllm_hit": int(m["prefix_cache_hits"]), "external_hit": int(m["external_hits"]),
                "host_hit": int(m["hits_host"]), "disk_hit": int(m["hits_disk"])})

    def reset(self, *engines: EngineProcess) -> None:
        """reset_prefix_cache() on the engines still alive, retried while a request that
        ended in its prefill step holds its blocks until its prompt tail is stored (--chat:
        an in-process engine is stepped for it, vLLM's engine-core process steps itself)."""
        for engine in engines:
            if engine is not None and id(engine) not in self._dead:
                self.turns.take(engine)
                try:
                    for _ in range(100):
                        if engine.reset():
                            break
                        if self.in_process:
                            engine.drain()
                        else:
                            time.sleep(0.05)
                    else:
                        raise EngineError("vLLM refused reset_prefix_cache: blocks in use")
                except EngineError as exc:
                    self._dead.add(id(engine))
                    self.errors[f"reset {engine.log_path.stem}"] = str(exc).splitlines()[0]

    def summary(self) -> dict[str, dict[str, dict]]:
        out: dict[str, dict[str, dict]] = {}
        for mode, per_length in self.samples.items():
            for length, rows in sorted(per_length.items()):
                times = [r["ttft_s"] for r in rows]
                out.setdefault(mode, {})[str(length)] = {
                    "median_s": statistics.median(times), "samples_s": times,
                    **{k: [r[v] for r in rows] for k, v in (  # --chat: per request
                        ("host_hits", "host_hit"), ("served", "served"))},
                    "hits": {k: statistics.median(r[k] for r in rows)
                             for k in ("vllm_hit", "external_hit", "host_hit", "disk_hit")}}
        return out


def spawn(args: argparse.Namespace, model: Path, name: str, transfer: dict | None,
          dirs: dict[str, Path]) -> EngineProcess:
    """Start an engine of this benchmark (in the background), its log ``logs/<name>.log``."""
    return EngineProcess(model, log_path=dirs["logs"] / f"{name}.log", engine=args.engine,
                         transfer=transfer, in_process=args.in_process, env=args.env)


def wave_one(args: argparse.Namespace, rec: Recorder, dirs: dict[str, Path],
             model: Path) -> dict[str, float]:
    """Plain, ours and the peer side by side: cold, vLLM hit, CPU tier, peer in-process."""
    ours = spawn(args, model, "ours-1", offload_transfer(args.ours), dirs)
    peer = None if args.no_peer else spawn(args, model, "peer-1",
                                           example_transfer_config(dirs["peer"]), dirs)
    plain = None if args.no_plain else spawn(args, model, "plain", None, dirs)
    with running([e for e in (ours, peer, plain) if e is not None]) as engines:
        rec.warm_up(engines)
        cold = [(plain, "cold"), (ours, "cold_ours"), (peer, "cold_peer")]
        if plain is None:  # cold and vllm_hit on ours
            cold = [(ours, "cold"), (peer, "cold_peer")]
        for rep in range(args.reps):
            for engine, mode in rotated(cold, rep):
                rec.block(engine, mode, [(n, prompt(n, rep)) for n in args.lengths])
        exact = [(n, prompt(n, rep)) for rep in range(args.reps) for n in args.lengths]
        for _ in range(args.passes):  # the prompts are all still in vLLM's cache
            rec.block(plain or ours, "vllm_hit", exact)
        for k in range(args.passes):
            rec.reset(ours, peer)
            turn = [(ours, "cpu"), (peer, "peer_same_process")]
            for engine, mode in (turn if k % 2 == 0 else turn[::-1]):
                rec.block(engine, mode, exact)
                if mode == "cpu":  # the same prompts, now in vLLM's cache: paired samples
                    rec.block(ours, "own_hit", exact)
        rec.reset(ours)
        rec.block(ours, "cpu_new_suffix",
                  [(n, prompt(n, rep, suffix=1)) for rep in range(args.reps) for n in args.lengths])
        return {name: e.startup_s for name, e in (("ours", ours), ("peer", peer), ("plain", plain))
                if e is not None}


def wave_two(args: argparse.Namespace, rec: Recorder, engines: list[EngineProcess]
             ) -> dict[str, float]:
    """Fresh processes on the same stores: our disk tier against the peer's warm TTFT."""
    with running(engines):
        ours, peer = [*engines, None][:2]
        rec.warm_up(engines)
        exact = [(n, prompt(n, rep)) for rep in range(args.reps) for n in args.lengths]
        for k in range(args.passes):
            if k:
                rec.reset(ours, peer)
            turn = [(ours, "disk" if k == 0 else "cpu_after_restart"), (peer, "peer_warm")]
            for engine, mode in (turn if k % 2 == 0 else turn[::-1]):
                rec.block(engine, mode, exact)
                if mode == "disk":
                    rec.block(ours, "own_hit_restarted", exact)
        return {f"{name}_restarted": e.startup_s for name, e in zip(("ours", "peer"), engines)}


def conversation(c: int, num_turns: int) -> list[str]:
    """Conversation ``c``'s prompt at each turn: the system prompt (shared by all), then a
    user message; the next turn appends a reply and a new message (sizes drawn per turn)."""
    rng, text, prompts = random.Random(c), make_prompt(SYSTEM_TOKENS, seed=1), []
    for t in range(num_turns):
        text += make_prompt(rng.randint(*USER_TOKENS), seed=80_000 + 100 * c + t)
        prompts.append(text)
        text += make_prompt(rng.randint(*REPLY_TOKENS), seed=90_000 + 100 * c + t)
    return prompts


def chat(args: argparse.Namespace, rec: Recorder, dirs: dict[str, Path], model: Path
         ) -> dict[str, float]:
    """--chat: an engine per ``CHAT`` option set (None: no connector), all with one small KV
    cache. Turn by turn, each engine serves every conversation's prompt: mode = engine, length = turn."""
    engines = {name: spawn(args, model, name, extra if extra is None else offload_transfer(
        {"cpu_size": "1GiB", **extra}), dirs) for name, extra in CHAT.items()}
    convs = [conversation(c, args.turns) for c in range(args.chat)]
    with running(list(engines.values())):
        rec.warm_up(list(engines.values()))
        for t in range(args.turns):
            for name in rotated(list(engines), t):
                rec.block(engines[name], name, [(t + 1, prompts[t]) for prompts in convs])
    return {name: e.startup_s for name, e in engines.items()}


def ratios(modes: dict[str, dict[str, dict]]) -> dict[str, dict[str, float]]:
    """Per length: medians over medians (``RATIOS``), and the median of per-prompt ratios
    of the samples measured in pairs (``PAIRED``)."""
    def get(mode: str, length: str, what: str) -> object:
        return modes.get(mode, {}).get(length, {}).get(what)

    out: dict[str, dict[str, float]] = {}
    for length in modes.get("cold", {}):
        row = out[length] = {}
        for name, num, den in RATIOS:
            a, b = get(num, length, "median_s"), get(den, length, "median_s")
            if isinstance(a, float) and isinstance(b, float) and b:
                row[name] = round(a / b, 4)
        for name, num, den in PAIRED:
            value = paired(get(num, length, "samples_s"), get(den, length, "samples_s"))
            if value is not None:
                row[name] = round(value, 4)
    return out


def verdicts(result: dict) -> list[dict]:
    """PASS/MISS per target at its length (or the longest length measured below it)."""
    lengths = [int(k) for k in result["ratios"]]
    out = []
    for key, limit, what, length in TARGETS:
        at = max((n for n in lengths if n <= length), default=max(lengths))
        value = result["ratios"][str(at)].get(key)
        out.append({"target": what, "length": at, "key": key, "value": value, "limit": limit,
                    "pass": value is not None and value <= limit})
    return out


def capacity(model: Path, max_model_len: int, logs: Path) -> dict:
    """vLLM's device KV plan with its hybrid manager off and on: what two in-process
    kv-offload engines on ``model`` report, beside kv_capacity's plan of the same
    geometry; and kv_capacity's plan of real geometries (BUDGET_GIB of KV)."""
    engine = {**CAPACITY_ENGINE, "max_model_len": max_model_len}
    return {"engine": engine, "budget_gib": BUDGET_GIB, "measured": [kv.engine_against_plan(
        model, engine={**engine, **extra}, log_path=logs / f"capacity-{i}.log",
        lengths=[1024, 4096, max_model_len])
        for i, extra in enumerate(({"disable_hybrid_kv_cache_manager": True}, {}))],
        "computed": [{"geometry": g.name, "context": c, "in_flight": n, **kv.off_and_on(
            g, kv_cache_bytes=BUDGET_GIB << 30, max_model_len=c, max_num_batched_tokens=n,
            lengths=[c])}
            for g in (kv.GEMMA3_27B_LIKE, kv.GPT_OSS_120B_LIKE) for c in CONTEXTS
            for n in IN_FLIGHT]}


def capacity_lines(data: dict) -> list[str]:
    """The capacity part of the --sliding-window section."""
    cap = data["capacity"]
    (off, off_plan), (on, on_plan) = ((r["engine"], r["computed"]) for r in cap["measured"])
    rows = [("the TTFT model, engines", off["max_model_len"], off["max_num_batched_tokens"],
             off["max_concurrency"], on["max_concurrency"], cap["engine"]["kv_cache_memory_bytes"])]
    rows += [(r["geometry"], r["context"], r["in_flight"], r["off"]["max_concurrency"],
              r["on"]["max_concurrency"], cap["budget_gib"] << 30) for r in cap["computed"]]
    return fill("hybrid", cap, window=data["model"]["sliding_window"], **{
        f"{k}_{side}": fmt(e[k], ",") if k != "groups" else ", ".join(e[k])
        for side, e in (("off", off), ("on", on))
        for k in ("groups", "num_blocks", "kv_cache_size_tokens")},
        planner="yes" if all(e[k] == c[k] for e, c in ((off, off_plan), (on, on_plan))
                             for k in ("num_blocks", "kv_cache_size_tokens")) else "**no**",
        gemma_groups=", ".join(next(r["on"]["groups"] for r in cap["computed"])),
        table="\n".join(table(["model", "context L", "tokens in flight", "requests of L (off)",
                                "requests of L (on)", "on/off", "GiB of KV per request (off / on)"],
                               [[name, f"{ctx // 1024}k", n, fmt(a, ".2f"), fmt(b, ".2f"),
                                 fmt(b / a, ".2f"), f"{gib / 2**30 / a:.2f} / {gib / 2**30 / b:.2f}"]
                                for name, ctx, n, a, b, gib in rows])))


def chat_lines(data: dict, img: Path | None) -> list[str]:
    """The --chat section: per turn and engine (``CHAT``), tokens served and TTFT, and TTFT
    paired per conversation (each later engine over each earlier one); its plot under ``img``."""
    modes, names = data["modes"], list(data["chat_options"])
    pairs = list(combinations(names[::-1], 2))
    rows = [[t, *[fmt(statistics.fmean(modes[n][t]["served"]), ".0f") for n in names],
             *[fmt(modes[n][t]["median_s"] * 1e3, ".1f") for n in names],
             *[fmt(paired(modes[a][t]["samples_s"], modes[b][t]["samples_s"])) for a, b in pairs]]
            for t in modes[names[0]]]
    header = ["turn", *[f"served: {n}" for n in names], *[f"TTFT {n} (ms)" for n in names],
              *[f"{a} / {b}" for a, b in pairs]]
    plotted = img is not None and chat_plot(modes, img / "chat.png")
    return fill("chat", data, options=data["chat_options"], model=data["model"]["name"],
                loadavg=" / ".join(f"{x:.1f}" for x in data["machine"]["loadavg_end"]),
                kv_mib=f'{data["engine"]["kv_cache_memory_bytes"] / 2**20:.2f}',
                max_model_len=data["engine"]["max_model_len"], **data["text_tokens"],
                table="\n".join(table(header, rows)),
                plot="![TTFT and tokens served per turn](img/chat.png)\n" if plotted else "")


def chat_plot(modes: dict, path: Path) -> bool:
    fig, axes = (plt := pyplot()).subplots(1, 2, figsize=(9, 4))
    for ax, (label, y) in zip(axes, (("TTFT, median (ms)", lambda p: p["median_s"] * 1e3), (
            "prompt tokens served from a cache, mean", lambda p: statistics.fmean(p["served"])))):
        for name, per in modes.items():
            ax.plot([int(t) for t in per], [y(p) for p in per.values()], marker="o", label=name)
        ax.set(xlabel="turn of each conversation", ylabel=label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save(fig, plt, path)


def render_section(data: dict, img: Path | None, targets: Targets) -> list[str]:
    """This benchmark's section of docs/benchmarks.md (plot under ``img`` unless None);
    with --sliding-window, the capacity part first and no plot; --chat's own section."""
    if data.get("chat"):
        return chat_lines(data, img)
    hybrid = bool(data.get("capacity"))
    lengths, modes = [str(n) for n in data["lengths"]], data["modes"]
    last = lengths[-1]
    rows = [[f"{mode}: {text}",
             *[fmt(modes[mode][n]["median_s"] * 1e3, ".1f") if n in modes[mode] else "-"
               for n in lengths],
             len(modes[mode].get(last, {}).get("samples_s", []))]
            for mode, text in MODES.items() if mode in modes]
    hits = [f"{mode} {h['vllm_hit']:.0f} vLLM / {h['host_hit']:.0f} host / "
            f"{h['disk_hit']:.0f} disk / {h['external_hit']:.0f} external"
            for mode in ("vllm_hit", "cpu", "disk", "peer_warm")
            if last in modes.get(mode, {}) for h in [modes[mode][last]["hits"]]]
    # Derived from the stored medians, so that ratios and targets added later also
    # grade earlier runs.
    data = {**data, "ratios": ratios(modes)}
    data["verdicts"] = verdicts(data)
    ratios_rows = [[key, *[fmt(data["ratios"].get(n, {}).get(key)) for n in lengths]]
                   for key, _, _ in (*RATIOS, *PAIRED)]
    for v in data["verdicts"]:
        if v["value"] is not None or not hybrid:  # no peer with a sliding window
            targets.add(f"TTFT{' (sliding window)' * hybrid}: {v['target']} at {v['length']} "
                        "tokens", v["value"], f"<= {v['limit']}", v["pass"], "bench_ttft")
    model = data["model"]
    plotted = img is not None and not hybrid and plot(data, img / "ttft.png")
    lines = fill(
        "ttft", data, model=model["name"], family="Gemma-3-style (`make_tiny_hybrid_model`, "
        "vLLM's hybrid KV cache manager on)" if model.get("sliding_window") else "Llama",
        geometry=", ".join(f"{k}={v}" for k, v in model.items() if k not in ("name", "path"))
        or "test default", block_size=data["engine"]["block_size"],
        max_num_batched_tokens=data["engine"].get("max_num_batched_tokens", "default"),
        modes_table="\n".join(table(["mode", *[f"L={n} (ms)" for n in lengths], "samples"],
                                    rows)),
        errors="".join(f"**Error** in `{m}`: {e}\n\n" for m, e in data["errors"].items()),
        length=last, hits="; ".join(hits) or "none",
        ratios_table="\n".join(table(["ratio", *[f"L={n}" for n in lengths]], ratios_rows)),
        plot="![TTFT vs prompt length](img/ttft.png)\n" if plotted else "",
        startup=", ".join(f"{k} {v:.0f}" for k, v in data["startup_s"].items()),
        seconds=f"{data['seconds']:.0f}")
    return capacity_lines(data) + lines[2:] if hybrid else lines


def plot(data: dict, path: Path) -> bool:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = data["lengths"]
    for mode, text in MODES.items():
        per = data["modes"].get(mode, {})
        pts = [(n, per[str(n)]["median_s"] * 1e3) for n in lengths if str(n) in per]
        if pts:
            ours = mode in ("cpu", "cpu_new_suffix", "disk", "cpu_after_restart")
            style = "--" if mode.startswith("cold") else (":" if "peer" in mode else "-")
            ax.plot(*zip(*pts), style, marker="o", label=text, linewidth=2.5 if ours else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set(xlabel="prefix tokens", ylabel="TTFT, median (ms)",
           title="Time to first token by mode (vLLM CPU backend)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, plt, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = BenchParser(__doc__, "smoke test: the tiny test model, 256 and 512 tokens, 1 rep")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="random-weight model geometry (default tiny; see MODELS)")
    parser.sized("--lengths", "1024,2048,4096,8192", "256,512",
                 "comma-separated prefix lengths", type=str)
    parser.sized("--reps", 2, 1, "different prefixes per length")
    parser.sized("--passes", 3, 1, "repeats of each cheap warm measurement")
    parser.add_argument("--sliding-window", type=int, metavar="TOKENS", help="Gemma-3-style: "
                        "every other layer a window of TOKENS, vLLM's hybrid manager on, no peer")
    parser.add_argument("--chat", type=int, default=0, metavar="C", help="C multi-turn chats "
                        "instead, on plain vLLM and kv-offload with and without partial hits")
    parser.sized("--turns", 10, 3, "--chat: turns per conversation")
    add_engine_flags(parser)
    parser.add_workdir()
    args = parser.parse_args(argv)
    args.lengths = [SYSTEM_TOKENS + args.turns * (USER_TOKENS[1] + REPLY_TOKENS[1])] if (
        args.chat) else sorted(csv(args.lengths))  # --chat: room for the longest prompt
    # --quick: no connector-free engine (cold and vllm_hit measured on ours), and wave
    # two's engines start while wave one runs (not a restart): two start-ups less.
    args.no_plain, args.early_start = args.quick, args.quick and not args.chat
    args.no_peer = bool(args.sliding_window)  # ExampleConnector refuses the hybrid manager
    args.in_process = args.in_process or args.quick
    args.engine, args.env = ttft_engine(args.lengths, in_process=args.in_process,
                                        vllm_default_binding=args.vllm_default_binding)
    if args.chat:  # vLLM's KV cache: one longest prompt (+ the null block), float32 K and V
        g, e = MODELS["tiny" if args.quick else args.model], args.engine  # quick: tiny's KV
        e["kv_cache_memory_bytes"] = (e["max_model_len"] + e["block_size"]) * 8 * g[
            "num_layers"] * g["num_kv_heads"] * g["head_dim"]
    if args.sliding_window:  # an engine that cannot keep the manager on fails to start
        args.engine["disable_hybrid_kv_cache_manager"] = False
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    base = workdir(args, "ttft")
    dirs = {"logs": base / "logs", "peer": base / "peer", "store": base / "store"}
    dirs["peer"].mkdir(parents=True)
    args.ours = {"cpu_size": "1GiB", "disk_path": str(dirs["store"]), "disk_size": "4GiB"}
    model_kwargs = {} if args.quick else MODELS[args.model]
    if args.sliding_window:
        model_kwargs = {**model_kwargs, "sliding_window": args.sliding_window}
    model = (make_tiny_hybrid_model if args.no_peer else make_tiny_model)(**model_kwargs)
    started = time.perf_counter()
    # --quick: no pauses at engine switches (no figures to protect)
    rec = Recorder(Turns(0.0 if args.quick else SETTLE_S), args.in_process)
    def spawn_wave_two() -> list[EngineProcess]:  # ours and the peer, fresh processes
        ours = spawn(args, model, "ours-2", offload_transfer(args.ours), dirs)
        return [ours] if args.no_peer else [ours, spawn(
            args, model, "peer-2", example_transfer_config(dirs["peer"]), dirs)]

    early = spawn_wave_two() if args.early_start else None
    try:
        cap = args.no_peer and capacity(model, model_kwargs.get("max_position", 8192), dirs["logs"])
        if args.chat:
            startup = chat(args, rec, dirs, model)
        else:
            startup = wave_one(args, rec, dirs, model)
            startup.update(wave_two(args, rec, early or spawn_wave_two()))
    except BaseException:
        for e in early or ():
            e.close()
        print(f"bench_ttft failed; engine logs kept in {dirs['logs']}", file=sys.stderr)
        raise
    shutil.rmtree(base, ignore_errors=True)
    modes = rec.summary()
    result = new_result(
        "chat" if args.chat else "ttft", args,
        model={"name": "test default" if args.quick else args.model, "path": str(model),
               **model_kwargs},
        engine=args.engine, env=args.env,
        ours_config={k: v for k, v in args.ours.items() if k != "disk_path"},
        lengths=args.lengths, suffix_tokens=SUFFIX_TOKENS, reps=args.reps, passes=args.passes,
        plain_engine=not args.no_plain, early_start=args.early_start,
        in_process=args.in_process, startup_s=startup, modes=modes, errors=rec.errors,
        settle_s=rec.turns.settle_s, engine_switches=rec.turns.num_switches, ratios=ratios(modes),
        capacity=cap, chat=args.chat, turns=args.turns, chat_options=CHAT,
        text_tokens={"system": SYSTEM_TOKENS, "user": "{}-{}".format(*USER_TOKENS),
                     "reply": "{}-{}".format(*REPLY_TOKENS)})
    result["verdicts"] = [] if args.chat else verdicts(result)
    return finish(result, args.json, render_section, started)


if __name__ == "__main__":
    main()
