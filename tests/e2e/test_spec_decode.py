"""n-gram speculative decoding through kv-offload: tokens equal recompute.

n-gram speculation proposes tokens from the prompt itself (no draft model, no draft KV),
so vLLM's scheduler runs with ``scheduled_spec_decode_tokens`` and computes KV for draft
tokens that may be rejected. The connector must store only verified tokens' KV (its
``build_connector_meta`` subtracts the drafts) and load only what was stored. With
``store_generated`` on, chunks that end in generated tokens (written while drafts were in
flight) are stored and then loaded by prompts that continue those outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_offload.testing.engine import EngineProcess, offload_transfer
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model

pytestmark = pytest.mark.engine

# min 1: a draft whenever the last token appeared before, so most steps carry drafts and
# most drafts are rejected (their KV was computed but must never be stored).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
OUTPUT_TOKENS = 96


def prompts() -> list[str]:
    """Prompts that repeat themselves, so the n-gram proposer finds drafts."""
    out = []
    for i in range(3):
        part = make_prompt(90 + 13 * i, seed=70 + i)
        out.append(part + part + make_prompt(20, seed=80 + i))
    return out


@pytest.fixture(scope="module")
def model() -> Path:
    return make_tiny_model()


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict:
    """vLLM alone, no speculation: the outputs, then prompts continuing them (as ids)."""
    with EngineProcess(model, log_path=tmp_path_factory.mktemp("ref") / "engine.log",
                       in_process=True) as engine:
        first = engine.generate(prompts(), max_tokens=OUTPUT_TOKENS)
        ids = continued(model, first["tokens"])
        second = engine.generate(ids, max_tokens=16)
    return {"first": first["tokens"], "ids": ids, "second": second["tokens"]}


def continued(model: Path, outputs: list[list[int]]) -> list[dict]:
    """Each prompt's token ids (as vLLM tokenizes it) plus its first 80 generated tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return [{"prompt_token_ids": tokenizer(p).input_ids + list(t[:80])}
            for p, t in zip(prompts(), outputs)]


@pytest.fixture(scope="module")
def speculative(model, reference, tmp_path_factory) -> dict:
    transfer = offload_transfer({"cpu_size": "64MiB", "chunk_tokens": 32,
                                 "store_generated": True})
    with EngineProcess(model, log_path=tmp_path_factory.mktemp("spec") / "engine.log",
                       in_process=True, transfer=transfer,
                       engine={"speculative_config": NGRAM}) as engine:
        cold = engine.generate(prompts(), max_tokens=OUTPUT_TOKENS)
        engine.drain()
        assert engine.reset(connector=False)
        warm = engine.generate(prompts(), max_tokens=OUTPUT_TOKENS)
        engine.drain()
        assert engine.reset(connector=False)
        second = engine.generate(reference["ids"], max_tokens=16)
    return {"cold": cold, "warm": warm, "second": second}


def test_ngram_speculation_tokens_equal_recompute(reference, speculative):
    assert speculative["cold"]["metrics"]["spec_drafts"] >= 30  # drafts in most steps
    assert speculative["cold"]["tokens"] == reference["first"]
    assert speculative["warm"]["tokens"] == reference["first"]
    assert speculative["warm"]["metrics"]["external_hits"] > 0  # loaded, not recomputed


def test_chunks_stored_during_speculation_load_back_right(reference, speculative):
    """Continuations hit chunks that ended in generated tokens, stored while drafts
    were being verified."""
    second = speculative["second"]
    assert second["tokens"] == reference["second"]
    prompt_tokens = [len(i["prompt_token_ids"]) for i in reference["ids"]]
    assert second["metrics"]["external_hits"] >= sum(prompt_tokens) - 3 * 64
