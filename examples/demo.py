"""`make demo`: the same long-prefix requests cold, from the CPU tier, and from the disk
tier after a restart, side by side.

Each request is a 2048-token document plus a short question. Engine 1 runs them cold, then
again after ``reset_prefix_cache()`` (vLLM forgot them; kv-offload's CPU tier did not).
Engine 2 is a new process on the same store: its CPU tier is empty, so the prefix comes
from the disk tier. TTFT is the latency of each request with ``max_tokens=1``, sent one at
a time. Every request carries its own ``cache_salt``, so vLLM's own prefix cache cannot
serve one request of a phase from the one before: every warm hit below is kv-offload's.
A second set of requests generates 16 tokens per phase; all three runs must agree.

``--hybrid`` (``make demo HYBRID=1``) keeps vLLM's hybrid KV cache manager on, with a tiny
random-weight Gemma-3-style model whose layers alternate sliding-window (64 tokens) and
full attention unless ``--model`` names another hybrid model: the engine must report its
KV cache groups (one per attention kind), and the three runs must still agree.

    python examples/demo.py [--model MODEL] [--store DIR] [--hybrid]

Takes 2 to 6 minutes on 2 CPU cores with the tiny model, mostly the two engine start-ups.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from kv_offload.config import format_size
from kv_offload.disk import list_namespaces
from kv_offload.testing.engine import default_engine_kwargs
from kv_offload.testing.tiny_model import make_prompt, make_tiny_hybrid_model, make_tiny_model
from kv_offload.testing.workload import run_in_subprocess

NUM_QUESTIONS = 4
TEXT_TOKENS = 16


def build_requests(model: str, doc_tokens: int) -> tuple[list[dict], list[dict]]:
    """(TTFT requests, text-check requests): one document, NUM_QUESTIONS questions each."""
    tokenizer_dir = model if (Path(model) / "tokenizer.json").is_file() else None
    document = make_prompt(doc_tokens, seed=1, model_dir=tokenizer_dir)
    questions = [make_prompt(40, seed=100 + i, model_dir=tokenizer_dir)
                 for i in range(NUM_QUESTIONS)]
    ttft = [{"prompt": document + q, "cache_salt": f"ttft-{i}"} for i, q in enumerate(questions)]
    text = [{"prompt": document + q, "cache_salt": f"text-{i}"} for i, q in enumerate(questions)]
    return ttft, text


def phases(tier: str, ttft: list[dict], text: list[dict], *, reset: bool) -> list[dict]:
    """A TTFT phase (max_tokens=1, one request at a time) and a text phase for ``tier``."""
    return [{"name": tier, "prompts": ttft, "max_tokens": 1, "one_by_one": True,
             "reset_prefix_cache": reset},
            {"name": f"{tier}-text", "prompts": text, "max_tokens": TEXT_TOKENS,
             "reset_prefix_cache": reset}]


def bytes_per_token(store: Path) -> float:
    """KV bytes of one token over all ranks, from the namespace the engine created."""
    (ns,) = list_namespaces(store)
    return ns["slot_bytes"] * ns["num_ranks"] / ns["descriptor"]["chunk_tokens"]


def print_table(results: dict[str, dict], per_token: float) -> None:
    cold = statistics.median(results["cold"]["latency_s"])
    print(f"\n{'phase':<11}{'TTFT median':>13}{'vs cold':>9}   "
          f"{'hit tokens device / cpu / disk':>31}{'KV loaded':>12}")
    for name, label in (("cold", "cold"), ("cpu", "CPU tier"), ("disk", "disk tier")):
        phase = results[name]
        ttft, m = statistics.median(phase["latency_s"]), phase["metrics"]
        hits = f"{m['hits_device']:.0f} / {m['hits_host']:.0f} / {m['hits_disk']:.0f}"
        loaded = format_size(int((m["hits_host"] + m["hits_disk"]) * per_token))
        print(f"{label:<11}{ttft * 1000:>10.0f} ms{cold / ttft:>8.1f}x   {hits:>31}{loaded:>12}")


def check(results: dict[str, dict]) -> bool:
    """Same first tokens and same 16-token texts in every run; the tiers were hit."""
    ok = True
    for suffix, what in (("", "first tokens"), ("-text", f"{TEXT_TOKENS}-token texts")):
        runs = [results[f"{tier}{suffix}"]["tokens"] for tier in ("cold", "cpu", "disk")]
        same = runs[0] == runs[1] == runs[2]
        ok &= same
        print(f"{what} cold == CPU tier == disk tier: {'OK' if same else 'MISMATCH'}")
    for tier, metric in (("cpu", "hits_host"), ("disk", "hits_disk")):
        if not results[tier]["metrics"][metric]:
            print(f"MISSING HITS: the {tier} phase loaded nothing from the {tier} tier")
            ok = False
    return ok


def kv_cache_groups(log: str) -> str | None:
    """kv-offload's start-up line on the engine's KV cache groups (only logged with more
    than one group), from its "N KV cache groups" on; None if there is none."""
    for line in log.splitlines():
        if "KV cache groups (vLLM's hybrid" in line:
            return line[line.index(": ") + 2:]
    return None


def model_and_engine(model: str | None, *, hybrid: bool) -> tuple[str, dict]:
    """The model (a tiny one generated offline unless given) and the engine's kwargs."""
    engine = default_engine_kwargs()
    if hybrid:  # vLLM fails at start-up, rather than turn it off, if it is refused
        engine["disable_hybrid_kv_cache_manager"] = False
    return model or str(make_tiny_hybrid_model() if hybrid else make_tiny_model()), engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory or hub name (default: a tiny "
                        "random Llama generated offline)")
    parser.add_argument("--store", help="disk store directory to use and keep (default: a "
                        "temporary directory, removed afterwards)")
    parser.add_argument("--doc-tokens", type=int, default=2048, help="document length (2048)")
    parser.add_argument("--hybrid", action="store_true", help="keep vLLM's hybrid KV cache "
                        "manager on (default model: a tiny sliding-window + full attention "
                        "model generated offline)")
    args = parser.parse_args()

    if args.store and list_namespaces(args.store):
        print(f"--store {args.store} already holds chunks, so the cold run would not be cold; "
              f"run `kv-offload clear {args.store}` or choose another directory",
              file=sys.stderr)
        return 2
    print("preparing the model ...", flush=True)
    model, engine = model_and_engine(args.model, hybrid=args.hybrid)
    work = Path(tempfile.mkdtemp(prefix="kv-offload-demo-"))
    store = Path(args.store) if args.store else work / "store"
    try:
        ttft, text = build_requests(model, args.doc_tokens)
        spec = {"model": model, "engine": engine,
                "offload": {"cpu_size": "1GiB", "disk_path": str(store), "disk_size": "4GiB"}}
        print(f"engine 1: {NUM_QUESTIONS} requests of {args.doc_tokens}+40 tokens, cold "
              "then from the CPU tier ...", flush=True)
        first = run_in_subprocess({**spec, "phases": phases("cold", ttft, text, reset=False)
                                   + phases("cpu", ttft, text, reset=True)}, work / "engine1")
        print(f"  started in {first['startup_s']:.0f} s", flush=True)
        groups = kv_cache_groups(first["log"])
        if args.hybrid:
            print(f"  {groups or 'one KV cache group: not a hybrid model'}", flush=True)
        print("engine 2: a new process on the same store, from the disk tier ...", flush=True)
        second = run_in_subprocess({**spec, "phases": phases("disk", ttft, text, reset=False)},
                                   work / "engine2")
        print(f"  started in {second['startup_s']:.0f} s", flush=True)
        results = {p["name"]: p for p in first["phases"] + second["phases"]}
        print_table(results, bytes_per_token(store))
        print()
        ok = check(results) and (groups is not None or not args.hybrid)
    except RuntimeError as exc:  # an engine run failed: its log is in the message
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
