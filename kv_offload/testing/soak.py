"""Soak run: many requests against vLLM's OpenAI server with kv-offload, then leak checks.

Starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with kv-offload
(CPU and disk tiers), sends requests whose prefixes are shared by a Zipf distribution
(a few hot system prompts, a long tail) from ``--concurrency`` threads, and reports:

- errors (HTTP or transport), latency percentiles, throughput;
- hit rates from ``/metrics``: kv-offload's ``kv_offload_hit_tokens_total`` and
  ``kv_offload_miss_tokens_total``, and vLLM's ``vllm:prompt_tokens_cached_by_source``
  against ``vllm:prompt_tokens_total``;
- leak checks after the run: ``kv_offload_pending_jobs`` back to 0 (no pin or slot held
  by a job that never finished), and the server processes' RSS and open files compared
  with a sample taken after warm-up, within the stated bounds.

The exit status is 0 when every check passes, 1 otherwise, 2 when the server did not
start. Everything is bounded in time (``--time-limit-s``, per-request timeouts).

    python -m kv_offload.testing.soak --quick --json /tmp/soak.json   # 100 requests, ~2 min
    python -m kv_offload.testing.soak --json soak.json                # 2,000 requests
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kv_offload import OffloadConfig
from kv_offload.testing.engine import EngineError
from kv_offload.testing.openai_server import OpenAIServer, metric_samples

QUICK = {"requests": 100, "prefixes": 16, "kv_cache_mib": 16, "time_limit_s": 600.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help=f"short run: {QUICK['requests']} requests over {QUICK['prefixes']} "
                        f"prefixes, {QUICK['kv_cache_mib']} MiB vLLM KV cache (what the test "
                        "suite runs)")
    p.add_argument("--requests", type=int, default=2000, help="requests to send (2000)")
    p.add_argument("--concurrency", type=int, default=16, help="client threads (16)")
    p.add_argument("--prefixes", type=int, default=64, help="distinct shared prefixes (64)")
    p.add_argument("--zipf-s", type=float, default=1.1,
                   help="Zipf exponent of the prefix popularity (1.1)")
    p.add_argument("--prefix-tokens", type=int, default=512, help="tokens per prefix (512)")
    p.add_argument("--suffix-tokens", type=int, default=32,
                   help="unique tokens after the prefix, per request (32)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated (8)")
    p.add_argument("--model", default=None,
                   help="model path or name (default: the offline tiny random Llama)")
    p.add_argument("--cpu-size", default="32MiB", help="kv-offload CPU tier (32MiB)")
    p.add_argument("--disk-size", default="512MiB", help="kv-offload disk budget (512MiB)")
    p.add_argument("--chunk-tokens", type=int, default=128, help="kv-offload chunk (128)")
    p.add_argument("--disk-path", default=None,
                   help="store directory (default: a fresh temporary one, removed after)")
    p.add_argument("--kv-cache-mib", type=int, default=32,
                   help="vLLM's own KV cache in MiB; small, so that prefixes leave it (32)")
    p.add_argument("--warmup-fraction", type=float, default=0.25,
                   help="fraction of requests after which the baseline sample is taken")
    p.add_argument("--rss-growth-mib", type=float, default=256.0,
                   help="allowed RSS growth of the server processes after warm-up (256)")
    p.add_argument("--fd-growth", type=int, default=16,
                   help="allowed growth of their open file descriptors after warm-up (16)")
    p.add_argument("--time-limit-s", type=float, default=1800.0,
                   help="stop sending after this many seconds of load (1800)")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    p.add_argument("--server-log", default=None, help="write the server's log here")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    if args.requests < 1 or args.concurrency < 1 or args.prefixes < 1:
        p.error("--requests, --concurrency and --prefixes must be >= 1")
    return args


# ---- server ---------------------------------------------------------------------------

def start_server(args: argparse.Namespace, model: str, store: Path,
                 log_path: Path) -> OpenAIServer:
    """The OpenAI server with kv-offload (CPU and disk tiers) for this soak."""
    cfg = OffloadConfig(cpu_size=args.cpu_size, disk_path=str(store),
                        disk_size=args.disk_size, chunk_tokens=args.chunk_tokens)
    max_len = max(2048, args.prefix_tokens + args.suffix_tokens + args.max_tokens + 64)
    return OpenAIServer(model, [
        "--block-size", "32", "--max-model-len", str(max_len), "--enforce-eager",
        "--seed", str(args.seed), "--max-num-seqs", str(max(args.concurrency, 1)),
        "--kv-cache-memory-bytes", str(args.kv_cache_mib << 20),
        "--kv-transfer-config", cfg.to_json()], log_path=log_path, port=args.port)


def sample_processes(server: OpenAIServer) -> dict[str, float]:
    """RSS (MiB), open file descriptors and threads of the server and its children."""
    import psutil

    rss = fds = threads = 0
    procs = server.processes()
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            fds += proc.num_fds()
            threads += proc.num_threads()
        except psutil.NoSuchProcess:
            continue
    return {"processes": len(procs), "rss_mib": round(rss / 2**20, 1), "fds": fds,
            "threads": threads}


# ---- metrics --------------------------------------------------------------------------

KEPT_METRICS = ("kv_offload_", "vllm:prompt_tokens_cached_by_source", "vllm:prompt_tokens_total",
                "vllm:num_preemptions_total", "vllm:num_requests_running",
                "vllm:num_requests_waiting")
KEPT_LABELS = ("tier", "direction", "source")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="value",...}': value} for kv_offload_* and a few
    vllm: samples, summed over the labels other than tier, direction and source."""
    out: dict[str, float] = {}
    for sample in metric_samples(text):
        if not sample.name.startswith(KEPT_METRICS):
            continue
        name = sample.name
        if sample.labels:
            name += "{" + ",".join(f'{k}="{v}"' for k, v in sample.labels.items()
                                   if k in KEPT_LABELS) + "}"
        out[name] = out.get(name, 0.0) + sample.value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return m.get(f"{name}{{{want}}}", m.get(name, 0.0)) if want else m.get(
        name, m.get(name + "{}", 0.0))


def hit_rates(d: dict[str, float]) -> dict[str, float]:
    cpu = metric(d, "kv_offload_hit_tokens_total", tier="cpu")
    disk = metric(d, "kv_offload_hit_tokens_total", tier="disk")
    miss = metric(d, "kv_offload_miss_tokens_total")
    prompt = metric(d, "vllm:prompt_tokens_total")
    by_source = {s: metric(d, "vllm:prompt_tokens_cached_by_source_total", source=s)
                 for s in ("device", "host", "disk")}
    looked_up = cpu + disk + miss
    return {
        "kv_offload_hit_tokens_cpu": cpu, "kv_offload_hit_tokens_disk": disk,
        "kv_offload_miss_tokens": miss,
        "kv_offload_hit_rate": round((cpu + disk) / looked_up, 4) if looked_up else 0.0,
        "kv_offload_hit_rate_cpu": round(cpu / looked_up, 4) if looked_up else 0.0,
        "kv_offload_hit_rate_disk": round(disk / looked_up, 4) if looked_up else 0.0,
        "prompt_tokens": prompt,
        **{f"prompt_tokens_cached_{s}": v for s, v in by_source.items()},
        **{f"cached_fraction_{s}": round(v / prompt, 4) if prompt else 0.0
           for s, v in by_source.items()},
    }


# ---- workload -------------------------------------------------------------------------

def build_workload(args: argparse.Namespace, model_dir: str | None) -> list[str]:
    """Prompts: a Zipf-chosen shared prefix plus a unique suffix each."""
    from kv_offload.testing.tiny_model import make_prompt

    prefixes = [make_prompt(args.prefix_tokens, seed=10_000 + k, model_dir=model_dir)
                for k in range(args.prefixes)]
    rng = random.Random(args.seed)
    weights = [1.0 / (k + 1) ** args.zipf_s for k in range(args.prefixes)]
    chosen = rng.choices(range(args.prefixes), weights=weights, k=args.requests)
    return [prefixes[k] + make_prompt(args.suffix_tokens, seed=100_000 + i, model_dir=model_dir)
            for i, k in enumerate(chosen)]


@dataclass
class Tally:
    """What the client threads saw (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    skipped: int = 0  # not sent: the time limit had passed
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warm: threading.Event = field(default_factory=threading.Event)
    warm_sample: tuple[dict, dict] | None = None  # (processes, metrics) after warm-up
    seconds: float = 0.0


def run_load(args: argparse.Namespace, server: OpenAIServer, model: str, prompts: list[str]
             ) -> Tally:
    """Send every prompt from ``args.concurrency`` threads; sample the server once the
    warm-up fraction is done."""
    tally, warm_at = Tally(), max(1, int(len(prompts) * args.warmup_fraction))
    deadline = time.monotonic() + args.time_limit_s

    def one(prompt: str) -> None:
        error, start = None, time.monotonic()
        if start > deadline:
            error = "skipped"
        else:
            try:
                body = json.loads(server.post("/v1/completions", {
                    "model": model, "prompt": prompt, "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True}, timeout=args.request_timeout_s))
                if body["usage"]["completion_tokens"] != args.max_tokens:
                    error = f"unexpected answer: {str(body)[:200]}"
            except (OSError, ValueError, KeyError) as exc:  # HTTP, transport, timeout, JSON
                error = f"{type(exc).__name__}: {exc}"[:300]
        with tally.lock:
            if error == "skipped":
                tally.skipped += 1
            else:
                tally.sent += 1
                if error:
                    tally.errors.append(error)
                else:
                    tally.latencies.append(time.monotonic() - start)
            if tally.sent + tally.skipped == warm_at:
                tally.warm.set()

    start = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        tally.warm.wait()
        tally.warm_sample = (sample_processes(server),
                             parse_metrics(server.get("/metrics")))
        for f in futures:
            f.result()
    tally.seconds = time.monotonic() - start
    return tally


def wait_pending_zero(server: OpenAIServer, timeout_s: float = 60.0) -> tuple[float, dict]:
    """Poll /metrics until kv_offload_pending_jobs is 0; returns (last value, metrics)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = parse_metrics(server.get("/metrics"))
        pending = metric(m, "kv_offload_pending_jobs")
        if pending == 0 or time.monotonic() > deadline:
            return pending, m
        time.sleep(1)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def soak(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model
    model_dir = None
    if model is None:
        from kv_offload.testing.tiny_model import make_tiny_model

        model = model_dir = str(make_tiny_model())
    elif Path(model).is_dir():
        model_dir = model
    store_owned = args.disk_path is None
    store = Path(args.disk_path or tempfile.mkdtemp(prefix="kv-offload-soak-")) / "store"
    log_path = Path(args.server_log or Path(tempfile.gettempdir()) / "kv-offload-soak.log")
    prompts = build_workload(args, model_dir)
    server = start_server(args, model, store, log_path)
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()},
                              "server_log": str(log_path)}
    result["config"]["model"] = model
    try:
        try:
            server.wait_healthy(args.startup_timeout_s)
        except EngineError as exc:
            result["startup_error"] = str(exc)
            return result
        result["startup_s"] = round(server.startup_s or 0.0, 1)  # set once healthy
        before = parse_metrics(server.get("/metrics"))
        tally = run_load(args, server, model, prompts)
        seconds = tally.seconds
        if tally.warm_sample is None:  # run_load takes it before it returns
            raise RuntimeError("soak: no sample was taken after warm-up")
        warm_procs, warm_metrics = tally.warm_sample
        pending, after = wait_pending_zero(server)
        end_procs = sample_processes(server)
        d = delta(after, before)
        ok_latencies = tally.latencies
        rss_growth = end_procs["rss_mib"] - warm_procs["rss_mib"]
        fd_growth = end_procs["fds"] - warm_procs["fds"]
        result.update({
            "requests_sent": tally.sent,
            "requests_skipped_time_limit": tally.skipped,
            "errors": len(tally.errors), "error_samples": tally.errors[:5],
            "seconds": round(seconds, 1),
            "requests_per_s": round(len(ok_latencies) / seconds, 2) if seconds else 0.0,
            "latency_s": {"p50": round(percentile(ok_latencies, 0.5), 3),
                          "p90": round(percentile(ok_latencies, 0.9), 3),
                          "p99": round(percentile(ok_latencies, 0.99), 3),
                          "mean": round(statistics.fmean(ok_latencies), 3)
                          if ok_latencies else 0.0},
            "hits": hit_rates(d),
            "hits_after_warmup": hit_rates(delta(after, warm_metrics)),
            "kv_offload": {k: v for k, v in d.items() if k.startswith("kv_offload_")
                           and "pending" not in k and "bytes{" not in k},
            "gauges_end": {k: v for k, v in after.items() if k.startswith(
                ("kv_offload_pending_jobs", "kv_offload_cpu_", "kv_offload_disk_used",
                 "kv_offload_disk_capacity"))},
            "preemptions": metric(d, "vllm:num_preemptions_total"),
            "pending_jobs_end": pending,
            "processes_warm": warm_procs, "processes_end": end_procs,
            "rss_growth_mib": round(rss_growth, 1), "fd_growth": fd_growth,
        })
        rss_bound = max(args.rss_growth_mib, 0.1 * warm_procs["rss_mib"])
        result["bounds"] = {"rss_growth_mib": rss_bound, "fd_growth": args.fd_growth}
        result["checks"] = {
            "all_requests_ran": tally.sent == len(prompts),
            "no_errors": not tally.errors,
            "pending_jobs_back_to_zero": pending == 0,
            "rss_growth_within_bound": rss_growth <= rss_bound,
            "open_files_within_bound": fd_growth <= args.fd_growth,
            "kv_offload_served_hits": result["hits"]["kv_offload_hit_tokens_cpu"]
            + result["hits"]["kv_offload_hit_tokens_disk"] > 0,
            "server_alive": server.proc.poll() is None,
        }
        return result
    finally:
        server.stop()
        if store_owned:
            shutil.rmtree(store.parent, ignore_errors=True)


def summary(result: dict[str, Any]) -> str:
    if "startup_error" in result:
        return "server did not start:\n" + result["startup_error"]
    h = result["hits"]
    lines = [
        f"{result['requests_sent']} requests in {result['seconds']} s "
        f"({result['requests_per_s']} req/s), {result['errors']} errors, "
        f"{result['requests_skipped_time_limit']} skipped (time limit)",
        f"latency p50 {result['latency_s']['p50']} s, p99 {result['latency_s']['p99']} s",
        f"kv-offload hit rate {h['kv_offload_hit_rate']:.1%} (cpu {h['kv_offload_hit_rate_cpu']:.1%}"
        f", disk {h['kv_offload_hit_rate_disk']:.1%}); prompt tokens cached: device "
        f"{h['cached_fraction_device']:.1%}, host {h['cached_fraction_host']:.1%}, disk "
        f"{h['cached_fraction_disk']:.1%}",
        f"pending jobs at end {result['pending_jobs_end']:.0f}; RSS {result['processes_warm']['rss_mib']}"
        f" -> {result['processes_end']['rss_mib']} MiB, fds {result['processes_warm']['fds']} -> "
        f"{result['processes_end']['fds']} (bounds: +{result['bounds']['rss_growth_mib']:.0f} "
        f"MiB, +{result['bounds']['fd_growth']})",
        "checks: " + ", ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in result["checks"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a test's teardown, a CI timeout) unwinds like Ctrl-C: the server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = soak(args)
    print(summary(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True))
    if "startup_error" in result:
        return 2
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
