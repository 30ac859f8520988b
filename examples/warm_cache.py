"""Warm a kv-offload disk store from Python: `kv-offload warm`, as a library call.

    python examples/warm_cache.py --disk-path DIR [--prompts FILE] [--model MODEL]

Prefills every prompt once so that its KV is on disk before a server starts. Re-running
it is cheap: chunks already in the store are reported as already present, not rewritten.
The engine settings that name the namespace (model string, dtype, block size, chunk
tokens, TP size) must be those of the server. Without --prompts it warms a small demo
workload; without --model it uses a tiny random model, generated offline.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kv_offload import OffloadConfig
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model
from kv_offload.tools.warm import WarmError, WarmOptions, run_warm


def demo_prompts() -> Path:
    """A .jsonl workload: three questions about one long document, and a chat."""
    document = make_prompt(1000, seed=1)
    lines = [{"prompt": f"{document}\n\nQuestion: {q}\nAnswer:"}
             for q in ("What is it about?", "Who wrote it?", "Summarize it.")]
    lines.append({"messages": [{"role": "system", "content": document},
                               {"role": "user", "content": "What is it about?"}]})
    path = Path(tempfile.mkdtemp(prefix="kv-offload-prompts-")) / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--disk-path", required=True, help="store directory")
    parser.add_argument("--prompts", help=".jsonl, .txt or a directory of .txt files")
    parser.add_argument("--model", help="model directory or hub name (default: tiny model)")
    parser.add_argument("--block-size", type=int, help="the server's block size")
    parser.add_argument("--chunk-tokens", type=int, help="the server's chunk_tokens")
    parser.add_argument("--dtype", help="the server's dtype")
    parser.add_argument("--max-model-len", type=int)
    args = parser.parse_args()

    options = WarmOptions(
        model=args.model or str(make_tiny_model()),
        prompts=Path(args.prompts) if args.prompts else demo_prompts(),
        offload=OffloadConfig(cpu_size="1GiB", disk_path=args.disk_path, disk_size="8GiB",
                              chunk_tokens=args.chunk_tokens),
        # None means vLLM's default. Warming is a one-off prefill: skip graph compilation.
        engine={"block_size": args.block_size, "dtype": args.dtype,
                "max_model_len": args.max_model_len, "enforce_eager": True},
    )
    try:
        summary = run_warm(options)  # progress on stderr
    except (ValueError, WarmError) as exc:
        print(f"warm failed: {exc}", file=sys.stderr)
        return 1
    print("\n".join(summary.lines()))
    return 0 if summary.complete else 1


if __name__ == "__main__":
    sys.exit(main())
