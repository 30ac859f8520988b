"""kv-offload with vLLM's offline API: the second run of long prompts loads their KV.

    python examples/offline_inference.py [--model MODEL] [--disk-path DIR]

The first generate() computes the shared document and kv-offload stores its KV (CPU tier,
and the disk tier under --disk-path). reset_prefix_cache() then empties vLLM's own prefix
cache, so the second generate() gets the document from kv-offload instead of recomputing
it. Run the script twice with the same --disk-path and the first run of the second process
already hits the disk tier. Without --model it uses a tiny random model, generated offline.
At the end it prints kv-offload's own counters (``read_metrics``: vLLM's ``get_metrics()``
returns only its ``vllm:`` metrics).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from kv_offload import OffloadConfig
from kv_offload.plugin.metrics import read_metrics
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model

SHOWN = ("hit_tokens_cpu", "hit_tokens_disk", "miss_tokens", "chunks_stored_cpu",
         "chunks_stored_disk", "load_errors", "hook_errors")
QUESTIONS = ["Summarize the text above in one sentence.",
             "Which word appears most often in the text above?",
             "List three nouns from the text above."]


def external_hit_tokens(llm) -> int:
    """Prompt tokens loaded by the KV connector so far (vLLM's own metric)."""
    return int(sum(m.value for m in llm.get_metrics()
                   if m.name == "vllm:external_prefix_cache_hits"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory or hub name (default: tiny model)")
    parser.add_argument("--disk-path", help="disk store directory (default: a new temp dir)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    # The tiny model is float32; keep it so (vLLM would pick bfloat16 on CPU), which makes
    # greedy output independent of how prompts are batched and split.
    model, dtype = (args.model, "auto") if args.model else (str(make_tiny_model()), "float32")
    config = OffloadConfig(cpu_size="1GiB",
                           disk_path=args.disk_path or tempfile.mkdtemp(prefix="kv-offload-"),
                           disk_size="8GiB")
    engine = {}
    if current_platform.is_cpu():
        # The CPU backend keeps the KV cache in host RAM; vLLM's default share of it (92%)
        # fails on small machines. Eager mode skips compilation for a quick start.
        engine = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True}
    llm = LLM(model=model, kv_transfer_config=config.to_kv_transfer_config(),
              dtype=dtype, disable_log_stats=False, **engine)

    document = make_prompt(1500, seed=1)  # stands in for a long RAG document
    prompts = [f"{document}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    runs = []
    for name in ("first run", "second run"):
        before, start = external_hit_tokens(llm), time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        runs.append([o.outputs[0].text for o in outputs])
        print(f"{name}: {seconds:.2f} s, {external_hit_tokens(llm) - before} prompt tokens "
              "loaded by kv-offload")
        llm.reset_prefix_cache()  # forget vLLM's own cache: the next run asks kv-offload
    for question, text in zip(QUESTIONS, runs[1]):
        print(f"{question!r} -> {text!r}")
    print("same text in both runs:", "yes" if runs[0] == runs[1] else "no")
    counters = read_metrics()  # this process's kv_offload_* metrics, by counter name
    print("kv-offload counters:", " ".join(f"{n}={counters.get(n, 0):.0f}" for n in SHOWN))
    print("store:", config.disk_path)


if __name__ == "__main__":
    main()
