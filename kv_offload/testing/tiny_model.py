"""Random-weight Llama and Gemma 3 models with a real offline tokenizer, for tests/benchmarks.

`make_tiny_model(...)` writes (once, cached) an HF model directory that vLLM loads offline:
config.json (LlamaForCausalLM), model.safetensors and a byte-level BPE fast tokenizer.
`make_tiny_hybrid_model(...)` does the same for a Gemma-3-style text model
(Gemma3ForCausalLM, "gemma3_text") whose layers mix sliding-window and full attention, so
vLLM's hybrid KV cache manager gives it one KV cache group per attention kind.
Weights use a large init scale so greedy output depends on every prompt token (the usual
std 0.02 makes a random model repeat one token, so token comparisons could never fail).
`make_prompt(n, seed)` returns English-like text of exactly n tokens for that tokenizer.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer

FORMAT_VERSION = 2  # bump whenever the generated files change for the same parameters
SUPPORTED_HEAD_DIMS = (64, 128)  # the vLLM CPU attention backend refuses e.g. 16
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
# Measured in vLLM (defaults: 4 layers, std 0.15): changing 1 of the first 50 tokens of a
# 1024-token prompt changed the 16 greedy tokens in 74/75 trials (2 layers, std 0.1: 50/75).
DEFAULT_INIT_STD = 0.15
LAYER_TYPES = ("sliding_attention", "full_attention")  # Gemma 3 `layer_types` values
# Gemma 3 RMS-normalises q and k per head and each sublayer's output, so the init scale alone
# leaves attention soft and its output small beside the embedding: a changed early token of a
# 600-token prompt changed the 16 greedy tokens in only ~70% of trials. Sharper attention
# (query_pre_attn_scalar = head_dim / 16: logits std ~4) and attention outputs scaled 3x
# (post_attention_layernorm weight 2, Gemma norms scale by 1 + weight) made it 60/60 early and
# 20/20 mid-prompt changes (vLLM CPU, float32, 4 layers S F S F, window 64).
HYBRID_QUERY_SCALAR_DIVISOR = 16
HYBRID_POST_ATTN_NORM_WEIGHT = 2.0
# A larger model where prefill dominates on a 2-core CPU (~90M params, ~0.36 GB float32).
BENCH_MODEL_KWARGS = dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4,
                          head_dim=64, intermediate_size=2816, max_position=16384)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
_WORDS = """\
the of and to in is was for on that with as by at from his her are were it an be this which or had
not but have one all their they you we more also has been there who new would when can after other
first two some into time over only year then may state most made about between out years city
world number part these many each three such what during while under up so people water name long
place little work must where great through back much before line right too mean old any same tell
boy follow came want show around form small set put end does another well large need big high such
turn here why ask went men read land different home us move try kind hand picture again change off
play spell air away animal house point page letter mother answer found study still learn plant
cover food sun four thought let keep eye never last door between city tree cross farm hard start
might story saw far sea draw left late run while press close night real life few stop open seem
together next white children begin got walk example ease paper often always music those both mark
book carry took science eat room friend began idea fish mountain north once base hear horse cut
sure watch color face wood main enough plain girl usual young ready above ever red list though
feel talk bird soon body dog family direct pose leave song measure product black short numeral
class wind question happen complete ship area half rock order fire south problem piece told knew
pass farm top whole king size heard best hour better true during hundred remember step early hold
west ground interest reach fast five sing listen six table travel less morning ten simple several
vowel toward war lay against pattern slow center love person money serve appear road map science
rule govern pull cold notice voice fall power town fine certain fly unit lead cry dark machine
note wait plan figure star box noun field rest correct able pound done beauty drive stood contain
front teach week final gave green quick develop sleep warm free minute strong special mind behind
clear tail produce fact street inch lot nothing course stay wheel full force blue object decide
surface deep moon island foot yet busy test record boat common gold possible plane age dry wonder
laugh thousand ago ran check game shape yes hot miss brought heat snow bed bring sit perhaps fill
east weight language
"""
WORDS = tuple(dict.fromkeys(_WORDS.split()))  # ordered, unique, letters only


def _byte_chars() -> list[str]:
    """GPT-2 byte -> printable unicode character map, indexed by byte value."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _bpe_merges(count: int) -> list[tuple[str, str]]:
    """Deterministic BPE merges learned from WORDS (Zipf-weighted), letters and spaces only."""
    enc = _byte_chars()
    words: Counter[tuple[str, ...]] = Counter()
    for rank, w in enumerate(WORDS):
        words[tuple(enc[b] for b in (" " + w).encode())] += 1000 // (rank + 10) + 1
    merges: list[tuple[str, str]] = []
    while len(merges) < count:
        pairs: Counter[tuple[str, str]] = Counter()
        for sym, f in words.items():
            for pair in zip(sym, sym[1:]):
                pairs[pair] += f
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for sym, f in words.items():
            out, i = [], 0
            while i < len(sym):
                if sym[i : i + 2] == best:
                    out.append(sym[i] + sym[i + 1])
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            merged[tuple(out)] += f
        words = merged
    return merges


@functools.lru_cache(maxsize=8)
def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` ids; lossless, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in _byte_chars():
        vocab[ch] = len(vocab)
    merges = _bpe_merges(vocab_size - len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    while len(vocab) < vocab_size:  # corpus exhausted: unreachable filler ids
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _unprintable_ids(vocab_size: int) -> list[int]:
    """Specials, fillers and non-printable byte tokens: greedy output is plain ASCII, never eos."""
    vocab = build_tokenizer(vocab_size).get_vocab()
    printable = {_byte_chars()[b] for b in range(32, 127)}
    merged = {t for t in vocab if len(t) > 1 and set(t) <= printable and "<" not in t}
    return sorted(i for t, i in vocab.items() if t not in printable and t not in merged)


def _check(num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int,
           head_dim: int, vocab_size: int, dtype: str) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported by the vLLM CPU backend; "
                         f"use one of {SUPPORTED_HEAD_DIMS}")
    if min(num_layers, hidden_size, num_heads, num_kv_heads) < 1 or num_heads % num_kv_heads:
        raise ValueError("need positive sizes and num_heads divisible by num_kv_heads, got "
                         f"num_heads={num_heads}, num_kv_heads={num_kv_heads}")
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size={vocab_size} < {len(SPECIAL_TOKENS) + 256} (bytes+specials)")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")


def _weights(p: dict) -> dict:
    """All tensors as float32 numpy arrays, drawn in a fixed order from one seeded PCG64."""
    rng = np.random.default_rng(p["seed"])
    h, d, inter = p["hidden_size"], p["head_dim"], p["intermediate_size"]

    def randn(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(p["init_std"]))

    # Gemma's RMSNorm scales by (1 + weight): zeros there are Llama's ones (identity scale).
    norm = np.zeros if p.get("kind") == "gemma3_text" else np.ones
    w = {"model.embed_tokens.weight": randn(p["vocab_size"], h)}
    for i in range(p["num_layers"]):
        pre = f"model.layers.{i}."
        w[pre + "self_attn.q_proj.weight"] = randn(p["num_heads"] * d, h)
        w[pre + "self_attn.k_proj.weight"] = randn(p["num_kv_heads"] * d, h)
        w[pre + "self_attn.v_proj.weight"] = randn(p["num_kv_heads"] * d, h)
        w[pre + "self_attn.o_proj.weight"] = randn(h, p["num_heads"] * d)
        w[pre + "mlp.gate_proj.weight"] = randn(inter, h)
        w[pre + "mlp.up_proj.weight"] = randn(inter, h)
        w[pre + "mlp.down_proj.weight"] = randn(h, inter)
        w[pre + "input_layernorm.weight"] = norm(h, np.float32)
        w[pre + "post_attention_layernorm.weight"] = norm(h, np.float32)
        if p.get("kind") == "gemma3_text":
            w[pre + "post_attention_layernorm.weight"] += np.float32(HYBRID_POST_ATTN_NORM_WEIGHT)
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                w[pre + name + ".weight"] = norm(h, np.float32)
            for name in ("q_norm", "k_norm"):
                w[pre + "self_attn." + name + ".weight"] = norm(d, np.float32)
    w["model.norm.weight"] = norm(h, np.float32)
    w["lm_head.weight"] = randn(p["vocab_size"], h)
    w["lm_head.weight"][_unprintable_ids(p["vocab_size"])] = 0.0  # logit 0: never the argmax
    return w


def _write(p: dict, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {k: torch.from_numpy(v).to(getattr(torch, p["dtype"]))
               for k, v in _weights(p).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": p["hidden_size"], "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_layers"], "num_attention_heads": p["num_heads"],
        "num_key_value_heads": p["num_kv_heads"], "head_dim": p["head_dim"],
        "vocab_size": p["vocab_size"], "max_position_embeddings": p["max_position"],
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": p["init_std"], "torch_dtype": p["dtype"],
        "bos_token_id": 1, "eos_token_id": 2, "kv_offload_params": p,
    }
    if p.get("kind") == "gemma3_text":
        for key in ("hidden_act", "rope_theta", "mlp_bias"):
            del config[key]
        config.update({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": p["head_dim"] // HYBRID_QUERY_SCALAR_DIVISOR,
            "sliding_window": p["sliding_window"], "layer_types": p["layer_types"],
            "pad_token_id": 0,
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        })
    (out / "config.json").write_text(json.dumps(config, indent=2))
    build_tokenizer(p["vocab_size"]).save(str(out / "tokenizer.json"))
    specials = dict(zip(("unk_token", "bos_token", "eos_token"), SPECIAL_TOKENS))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    tok_config = dict(specials, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False,
                      add_eos_token=False, clean_up_tokenization_spaces=False,
                      model_max_length=p["max_position"], chat_template=CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def default_cache_dir() -> Path:
    """$KV_OFFLOAD_CACHE_DIR if set, else ~/.cache/kv-offload/models."""
    env = os.environ.get("KV_OFFLOAD_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kv-offload" / "models"


def make_tiny_model(*, num_layers: int = 4, hidden_size: int = 256, num_heads: int = 4,
                    num_kv_heads: int = 2, head_dim: int = 64, vocab_size: int = 512,
                    intermediate_size: int | None = None, max_position: int = 8192, seed: int = 0,
                    init_std: float = DEFAULT_INIT_STD, dtype: str = "float32",
                    cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of a random Llama model with these parameters, creating it once.

    Same parameters -> same directory and byte-identical files. The directory appears
    atomically (temp dir + rename), so concurrent or interrupted calls never expose half a
    model. Raises ValueError for parameters the vLLM CPU backend cannot run.
    """
    _check(num_layers, hidden_size, num_heads, num_kv_heads, head_dim, vocab_size, dtype)
    p = dict(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
             num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
             intermediate_size=intermediate_size or 2 * hidden_size, max_position=max_position,
             seed=seed, init_std=float(init_std), dtype=dtype, format=FORMAT_VERSION)
    return _cached(p, f"llama-l{num_layers}-h{hidden_size}-d{head_dim}-s{seed}", cache_dir)


def hybrid_layer_types(num_layers: int, sliding_window_pattern: int) -> list[str]:
    """Gemma 3's rule: every `sliding_window_pattern`-th layer is full attention, the rest
    sliding-window (pattern 2: S F S F ...; pattern 6: 5 sliding then 1 full)."""
    return [LAYER_TYPES[(i + 1) % sliding_window_pattern == 0] for i in range(num_layers)]


def make_tiny_hybrid_model(*, sliding_window: int = 64, sliding_window_pattern: int = 2,
                           layer_types: Sequence[str] | None = None, num_layers: int = 4,
                           hidden_size: int = 256, num_heads: int = 4, num_kv_heads: int = 2,
                           head_dim: int = 64, vocab_size: int = 512,
                           intermediate_size: int | None = None, max_position: int = 8192,
                           seed: int = 0, init_std: float = DEFAULT_INIT_STD,
                           dtype: str = "float32",
                           cache_dir: str | os.PathLike | None = None) -> Path:
    """Like `make_tiny_model`, for a Gemma-3-style text model (Gemma3ForCausalLM) whose layers
    mix sliding-window (`sliding_window` tokens) and full attention.

    `layer_types` ("sliding_attention"/"full_attention" per layer) overrides
    `sliding_window_pattern` (see `hybrid_layer_types`); the default alternates S F S F.
    Same tokenizer, caching and init scale as `make_tiny_model`.
    """
    _check(num_layers, hidden_size, num_heads, num_kv_heads, head_dim, vocab_size, dtype)
    if sliding_window_pattern < 1:
        raise ValueError(f"sliding_window_pattern={sliding_window_pattern} must be >= 1")
    types = (list(layer_types) if layer_types is not None
             else hybrid_layer_types(num_layers, sliding_window_pattern))
    if len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types must be {num_layers} values from {LAYER_TYPES}, "
                         f"got {types}")
    if sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1")
    p = dict(kind="gemma3_text", num_layers=num_layers, hidden_size=hidden_size,
             num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
             vocab_size=vocab_size, intermediate_size=intermediate_size or 2 * hidden_size,
             max_position=max_position, seed=seed, init_std=float(init_std), dtype=dtype,
             sliding_window=sliding_window, layer_types=types, format=FORMAT_VERSION)
    pattern = "".join(t[0].upper() for t in types)  # e.g. "SFSF"
    name = f"gemma3-{pattern}-w{sliding_window}-h{hidden_size}-d{head_dim}-s{seed}"
    return _cached(p, name, cache_dir)


def _cached(p: dict, name: str, cache_dir: str | os.PathLike | None) -> Path:
    """The cache directory for parameters `p` (named `name`-<hash of p>), written once."""
    key = hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"{name}-{key}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by killed runs; an hour is far beyond any write
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        _write(p, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # a concurrent writer did not win either: real error
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def make_prompt(num_tokens: int, seed: int = 0, *, vocab_size: int = 512,
                model_dir: str | os.PathLike | None = None) -> str:
    """Deterministic English-like text of exactly `num_tokens` tokens (no BOS is added).

    Every piece starts with a space or is '.', so prompts concatenate additively:
    tokens(make_prompt(a, s) + make_prompt(b, t)) == tokens(first) + tokens(second).
    """
    if model_dir is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    else:
        tok = build_tokenizer(vocab_size)
    rng = random.Random(seed)
    sizes: dict[str, int] = {}
    parts, n, sentence = [], 0, rng.randint(6, 16)
    while True:
        piece = "." if sentence == 0 else " " + rng.choice(WORDS)
        if piece not in sizes:
            sizes[piece] = len(tok.encode(piece, add_special_tokens=False).ids)
        if n + sizes[piece] > num_tokens:
            break
        parts.append(piece)
        n += sizes[piece]
        sentence = rng.randint(6, 16) if sentence == 0 else sentence - 1
    parts.append("." * (num_tokens - n))  # '.' never merges: one token each
    return "".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Create (or find) a cached random model.")
    hybrid_only = [n for n in inspect.signature(make_tiny_hybrid_model).parameters
                   if n not in inspect.signature(make_tiny_model).parameters]
    for name, prm in inspect.signature(make_tiny_model).parameters.items():
        kind = {"init_std": float, "dtype": str, "cache_dir": str}.get(name, int)
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=prm.default)
    parser.add_argument("--bench", action="store_true", help="use BENCH_MODEL_KWARGS")
    parser.add_argument("--hybrid", action="store_true",
                        help="Gemma-3-style sliding-window + full attention model")
    parser.add_argument("--sliding-window", type=int, help="with --hybrid (default 64)")
    parser.add_argument("--sliding-window-pattern", type=int,
                        help="with --hybrid: every Nth layer is full attention (default 2)")
    parser.add_argument("--layer-types", type=lambda v: v.split(","),
                        help="with --hybrid: comma-separated sliding_attention/full_attention")
    args = vars(parser.parse_args(argv))
    if args.pop("bench"):
        args.update(BENCH_MODEL_KWARGS)
    hybrid = {n: args.pop(n) for n in hybrid_only}
    if args.pop("hybrid"):
        print(make_tiny_hybrid_model(**args, **{n: v for n, v in hybrid.items() if v is not None}))
        return
    if any(v is not None for v in hybrid.values()):
        parser.error("--sliding-window, --sliding-window-pattern and --layer-types need --hybrid")
    print(make_tiny_model(**args))


if __name__ == "__main__":
    main()
