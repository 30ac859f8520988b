"""Tests for kv_offload.testing.tiny_model: determinism, caching, tokenizer, engine behaviour."""

import gc
import threading

import pytest

from kv_offload.testing import tiny_model
from kv_offload.testing.tiny_model import (
    BENCH_MODEL_KWARGS,
    build_tokenizer,
    main,
    make_prompt,
    make_tiny_hybrid_model,
    make_tiny_model,
)

# Small enough to write in well under a second; the defaults are used by the engine tests.
SMALL = dict(num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=1, vocab_size=300)
ENGLISH = "The quick brown fox jumps over the lazy dog. Hello, world! Caf\u00e9 na\u00efve 123.\n"


def test_same_params_same_bytes_and_cached(tmp_path, monkeypatch):
    first = make_tiny_model(cache_dir=tmp_path / "a", **SMALL)
    writes = []
    write = tiny_model._write
    monkeypatch.setattr(tiny_model, "_write", lambda *a: writes.append(a) or write(*a))
    again = make_tiny_model(cache_dir=tmp_path / "a", **SMALL)
    assert again == first and writes == [], "found in the cache, not written again"
    fresh = make_tiny_model(cache_dir=tmp_path / "b", **SMALL)  # regenerated, not cached
    assert len(writes) == 1
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (fresh / name).read_bytes() == (first / name).read_bytes(), name
    assert not list((tmp_path / "a").glob(".tmp-*")), "temp dir left behind"


def test_different_seed_or_scale_gives_different_weights(tmp_path):
    base = make_tiny_model(cache_dir=tmp_path, **SMALL)
    for change in ({"seed": 1}, {"init_std": 0.05}):
        other = make_tiny_model(cache_dir=tmp_path, **SMALL, **change)
        assert other != base
        assert (other / "model.safetensors").read_bytes() != (base / "model.safetensors").read_bytes()


def test_concurrent_creation_yields_one_complete_dir(tmp_path):
    results, errors = [], []

    def worker():
        try:
            results.append(make_tiny_model(cache_dir=tmp_path, **SMALL))
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]


@pytest.mark.parametrize(
    "bad, match",
    [({"head_dim": 16}, "head_dim"), ({"head_dim": 96}, "head_dim"),
     ({"num_heads": 4, "num_kv_heads": 3}, "divisible"), ({"vocab_size": 100}, "vocab_size"),
     ({"dtype": "float16"}, "dtype")],
)
def test_bad_params_raise(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        make_tiny_model(cache_dir=tmp_path, **bad)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_config_describes_the_weights(tmp_path):
    import json

    from safetensors import safe_open

    model = make_tiny_model(cache_dir=tmp_path, **SMALL)
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 64
    with safe_open(str(model / "model.safetensors"), "np") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
        assert emb.shape == (300, 128) and str(emb.dtype) == "float32"
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (64, 128)
        assert abs(float(emb.std()) - config["initializer_range"]) < 0.01


def test_tokenizer_loads_with_transformers_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    model = make_tiny_model(cache_dir=tmp_path, **SMALL)
    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    assert len(tok) == 300
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok(ENGLISH)["input_ids"]
    assert len(ids) >= len(ENGLISH.split()) and 0 not in ids  # lossless: no <unk>
    assert tok.decode(ids) == ENGLISH
    chat = tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<s>user: hi there\nassistant:"


def test_default_tokenizer_splits_english_into_word_sized_pieces():
    ids = build_tokenizer(512).encode("the world is a place where people work").ids
    assert 8 <= len(ids) <= 16


@pytest.mark.parametrize("n", [0, 1, 7, 16, 129, 1000, 3000])
def test_make_prompt_has_exact_token_count(n):
    text = make_prompt(n, seed=n)
    assert len(build_tokenizer(512).encode(text).ids) == n
    assert make_prompt(n, seed=n) == text
    if n > 10:
        assert make_prompt(n, seed=n + 1) != text


def test_make_prompts_concatenate_additively(tmp_path):
    model = make_tiny_model(cache_dir=tmp_path, **SMALL)
    tok = build_tokenizer(300)
    a = make_prompt(333, seed=1, model_dir=model)
    b = make_prompt(45, seed=2, vocab_size=300)
    assert tok.encode(a + b).ids == tok.encode(a).ids + tok.encode(b).ids
    assert len(tok.encode(a).ids) == 333


def test_cli_prints_path(tmp_path, capsys):
    args = ["--cache-dir", str(tmp_path), "--num-layers", "1", "--hidden-size", "128",
            "--num-heads", "2", "--num-kv-heads", "1", "--vocab-size", "300"]
    main(args)
    assert capsys.readouterr().out.strip() == str(make_tiny_model(cache_dir=tmp_path, **SMALL))


def test_hybrid_model_config_has_both_layer_types_and_loads_with_autoconfig(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    small = dict(SMALL, num_layers=2)
    model = make_tiny_hybrid_model(cache_dir=tmp_path, **small, sliding_window=48)
    config = AutoConfig.from_pretrained(str(model), local_files_only=True)
    assert type(config).__name__ == "Gemma3TextConfig" and config.model_type == "gemma3_text"
    assert config.architectures == ["Gemma3ForCausalLM"] and config.sliding_window == 48
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert not config.tie_word_embeddings and config.head_dim == 64
    assert set(config.rope_parameters) == {"sliding_attention", "full_attention"}
    with safe_open(str(model / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert "model.layers.1.self_attn.k_norm.weight" in names and "lm_head.weight" in names
    assert make_tiny_hybrid_model(cache_dir=tmp_path, **small, sliding_window=48) == model
    assert model != make_tiny_model(cache_dir=tmp_path, **small)


def test_hybrid_layer_patterns(tmp_path):
    import json

    five_to_one = make_tiny_hybrid_model(cache_dir=tmp_path, **dict(SMALL, num_layers=6),
                                         sliding_window_pattern=6)
    types = json.loads((five_to_one / "config.json").read_text())["layer_types"]
    assert types == ["sliding_attention"] * 5 + ["full_attention"]
    explicit = make_tiny_hybrid_model(cache_dir=tmp_path, **dict(SMALL, num_layers=6),
                                      layer_types=types)
    assert explicit == five_to_one  # the same model however the layer types were given
    for bad in (["full_attention"], ["local", "global"]):
        with pytest.raises(ValueError, match="layer_types"):
            make_tiny_hybrid_model(cache_dir=tmp_path, **dict(SMALL, num_layers=2),
                                   layer_types=bad)
    with pytest.raises(ValueError, match="head_dim"):
        make_tiny_hybrid_model(cache_dir=tmp_path, **dict(SMALL, head_dim=16))


def test_cli_hybrid(tmp_path, capsys):
    args = ["--cache-dir", str(tmp_path), "--num-layers", "1", "--hidden-size", "128",
            "--num-heads", "2", "--num-kv-heads", "1", "--vocab-size", "300"]
    main([*args, "--hybrid", "--layer-types", "sliding_attention,full_attention",
          "--num-layers", "2", "--sliding-window", "32"])
    expected = make_tiny_hybrid_model(cache_dir=tmp_path, **dict(SMALL, num_layers=2),
                                      sliding_window=32)
    assert capsys.readouterr().out.strip() == str(expected)
    with pytest.raises(SystemExit):
        main([*args, "--sliding-window", "32"])  # hybrid-only option without --hybrid


def test_bench_kwargs_are_valid():
    assert BENCH_MODEL_KWARGS["head_dim"] in (64, 128) and BENCH_MODEL_KWARGS["num_layers"] >= 8


# ---------------------------------------------------------------- real vLLM engine (CPU backend)


@pytest.fixture(scope="module")
def engine():
    from vllm import LLM

    llm = LLM(model=str(make_tiny_model()), enforce_eager=True, max_model_len=4096,
              kv_cache_memory_bytes=256 << 20, seed=0)
    yield llm
    # Stop the engine processes now rather than at interpreter exit (pytest keeps `llm` alive).
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm
    gc.collect()


def _greedy(llm, prompts, max_tokens=16):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.engine
def test_engine_greedy_is_deterministic_and_varied(engine):
    ids = build_tokenizer(512).encode(make_prompt(1024, seed=7)).ids
    first, second = _greedy(engine, [ids]), _greedy(engine, [ids])
    assert first == second and len(first[0]) == 16
    assert len(set(first[0])) >= 8, f"degenerate output {first[0]}"


@pytest.mark.engine
@pytest.mark.parametrize("position", [0, 3, 40, 300])
def test_engine_output_depends_on_one_early_token(engine, position):
    ids = build_tokenizer(512).encode(make_prompt(1100, seed=11)).ids
    changed = list(ids)
    changed[position] = 3 + (changed[position] + 100) % 500
    base, other = _greedy(engine, [ids, changed])
    differing = sum(x != y for x, y in zip(base, other))
    assert differing > 0, f"changing token {position} of {len(ids)} did not change {base}"


@pytest.mark.engine
def test_engine_text_prompt_and_chat(engine):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = engine.generate([make_prompt(100, seed=1)], params, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 100  # no BOS is added to plain prompts
    assert out.outputs[0].text.isascii() and len(out.outputs[0].token_ids) == 8
    chat = engine.chat([{"role": "user", "content": "hello"}], params, use_tqdm=False)[0]
    assert chat.prompt_token_ids[0] == 1 and len(chat.outputs[0].token_ids) == 8
