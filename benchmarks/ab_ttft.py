"""Interleaved TTFT A/B of two kv-offload checkouts or option sets: what a change does to a hit.

One engine per ``NAME=PATH[,OPTION=JSON...]``, side by side on one prompt; every round a
vLLM hit, a CPU-tier hit and a disk-tier hit (after ``reset_prefix_cache(reset_connector=
True)``) on each, in alternating order. Paired medians hold up on a noisy machine where two
runs of ``bench_ttft.py`` do not. Not in ``make bench``. E.g. (an older checkout must know
every option this one's config writes): ``ab_ttft.py async=.,sync_load_budget_ms=0 new=.``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _engine import Turns, benchmark_env

from kv_offload.testing.engine import EngineProcess, engine_kwargs, offload_transfer, start_engines
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model

MODES = ("vllm_hit", "cpu", "disk")


def paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def contender(spec: str) -> tuple[str, tuple[str, dict]]:
    name, rest = spec.split("=", 1)
    path, *options = rest.split(",")
    return name, (path, {k: json.loads(v) for k, v in (o.split("=", 1) for o in options)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs=2, metavar="NAME=PATH", help="two checkouts")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--length", type=int, default=8192, help="prompt tokens (+16)")
    args = parser.parse_args()
    trees = dict(map(contender, args.trees))
    model = make_tiny_model(max_position=max(16384, args.length + 64))
    env = benchmark_env(in_process=False, vllm_default_binding=False)
    text = make_prompt(args.length, seed=4242) + make_prompt(16, seed=99)
    ttft: dict[tuple[str, str], list[float]] = {(n, m): [] for n in trees for m in MODES}
    with tempfile.TemporaryDirectory(prefix="ab-ttft-") as tmp:
        engines = dict(zip(trees, start_engines([EngineProcess(
            model, log_path=Path(tmp) / f"{name}.log",
            engine=engine_kwargs(max_model_len=args.length + 64),
            transfer=offload_transfer({"cpu_size": "1GiB", "disk_size": "4GiB",
                                       "disk_path": str(Path(tmp) / f"store-{name}"),
                                       "connector_reset": "cpu", **options}),
            env={**env, "PYTHONPATH": str(Path(path).resolve())})
            for name, (path, options) in trees.items()])))
        turns = Turns()
        try:
            for engine in engines.values():
                turns.take(engine)
                engine.generate([text], max_tokens=1)  # cold: stores the prompt
            for r in range(args.rounds):
                for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                    engine = engines[name]
                    turns.take(engine)
                    for mode in MODES:
                        if mode != "vllm_hit":
                            engine.reset(connector=mode == "disk")
                        out = engine.generate([text], max_tokens=1)
                        if mode != "vllm_hit" and out["metrics"]["external_hits"] < args.length - 64:
                            raise SystemExit(f"{name}: a {mode} hit loaded too little: "
                                             f"{out['metrics']}")
                        ttft[(name, mode)].append(out["ttft_s"][0] * 1e3)
        finally:
            for engine in engines.values():
                engine.close()
    for name in trees:
        hit = ttft[(name, "vllm_hit")]
        print(f"{name}: " + ", ".join(f"{m} {statistics.median(ttft[(name, m)]):.1f} ms"
                                      for m in MODES) + "; paired over vLLM hit: "
              + ", ".join(f"{m} {paired(ttft[(name, m)], hit):.3f}" for m in MODES[1:]))
    first, second = trees
    print(f"{second} / {first}, paired: " + ", ".join(
        f"{m} {paired(ttft[(second, m)], ttft[(first, m)]):.3f}" for m in MODES))


if __name__ == "__main__":
    main()
