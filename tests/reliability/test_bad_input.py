"""Bad inputs not covered elsewhere (the full table, with the tests that cover each row,
is docs/bad-input.md): each gives an error that names the option or file and the fix,
and never a crash without a message."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
from reliability_support import REPO

from kv_offload import OffloadConfig
from kv_offload.disk import DiskIndex, StoreCorruptError
from kv_offload.layout import KVLayout

LAYOUT = KVLayout(model="m", model_fingerprint="f", dtype="float32", kv_cache_dtype="auto",
                  attention="full_attention", num_layers=4, page_bytes=128 << 10,
                  block_size=32, tokens_per_hash=32, chunk_tokens=64, tp_size=1, pp_size=1,
                  hash_algo="sha256")  # 1 MiB per chunk


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cpu_size": True}, "cpu_size: expected a size like '8GiB' or an integer, got True"),
    ({"cpu_size": 1.5}, "cpu_size: expected a size like '8GiB' or an integer, got float"),
    ({"disk_path": "/tmp/kvo-unused", "disk_size": 0}, "disk_size: must be > 0 when disk_path"),
    ({"disk_path": ""}, "disk_path: expected a directory path or None, got ''"),
    ({"disk_path": 123}, "disk_path: expected a directory path or None, got 123"),
    ({"chunk_tokens": True}, "chunk_tokens: expected an integer, got True"),
    ({"io_threads": "4"}, "io_threads: expected an integer, got '4'"),
    ({"disk_fsync": 1}, "disk_fsync: expected true or false, got 1"),
    ({"store_generated": "false"}, "store_generated: expected true or false, got 'false'"),
    ({"load_timeout_s": "30"}, "load_timeout_s: expected a positive number, got '30'"),
    ({"load_timeout_s": True}, "load_timeout_s: expected a positive number, got True"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_more_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as info:
        OffloadConfig(**kwargs)
    assert str(info.value).startswith(message)


def test_json_that_is_not_an_object_or_holds_a_bad_value():
    with pytest.raises(ValueError, match="kv-offload config JSON must be an object"):
        OffloadConfig.from_json("[1, 2]")
    nested = '{"kv_connector_extra_config": {"cpu_size": "1XB"}}'
    with pytest.raises(ValueError, match="cpu_size: cannot parse '1XB' as a size"):
        OffloadConfig.from_json(nested)


def test_cpu_tier_too_small_for_one_chunk_names_cpu_size():
    from kv_offload.plugin.connector import num_cpu_slots  # imports vLLM: only here

    with pytest.raises(ValueError, match=r"cpu_size: 100.0 KiB holds no chunk of this model "
                                         r"\(1.0 MiB per chunk of 64 tokens\); raise cpu_size"):
        num_cpu_slots(OffloadConfig(cpu_size="100KiB"), LAYOUT)


def test_disk_tier_too_small_for_one_chunk_names_disk_size(tmp_path):
    with pytest.raises(ValueError, match="disk_size"):
        DiskIndex.open(tmp_path, namespace_id="ab", descriptor={}, slot_bytes=LAYOUT.slot_bytes,
                       num_ranks=1, capacity_bytes=OffloadConfig(disk_size="100KiB").disk_size)


def open_index(root: Path) -> DiskIndex:
    return DiskIndex.open(root, namespace_id="ab", descriptor={}, slot_bytes=4096, num_ranks=1,
                          capacity_bytes=4096 * 2000)


def test_unreadable_format_version_tells_the_user_to_clear(tmp_path):
    open_index(tmp_path).close()
    env = lmdb.open(str(tmp_path / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"v1", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StoreCorruptError, match=f"no readable format version.*clear {tmp_path}"):
        open_index(tmp_path)


@pytest.mark.parametrize("keep_pages", [2, 3, "half"])
def test_truncated_index_file_is_a_clear_error_not_a_crash(tmp_path, keep_pages):
    index = open_index(tmp_path)
    keys = [i.to_bytes(8, "little") * 4 for i in range(1500)]
    index.commit([(k, s, (1,)) for k, s in zip(keys, index.allocate(keys))])
    index.close()
    data = tmp_path / "index" / "data.mdb"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:size // 2 if keep_pages == "half" else keep_pages * 4096])
    code = ("from kv_offload.disk import DiskIndex, StoreCorruptError\n"
            "try:\n"
            f"    DiskIndex.open({str(tmp_path)!r}, namespace_id='ab', descriptor={{}}, "
            "slot_bytes=4096, num_ranks=1, capacity_bytes=4096 * 2000)\n"
            "except StoreCorruptError as exc:\n"
            "    print('StoreCorruptError:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, f"the process died (exit {out.returncode}): {out.stderr[-500:]}"
    assert "StoreCorruptError:" in out.stdout and "kv-offload clear" in out.stdout


def _newest_meta(data) -> tuple[int, tuple]:
    from kv_offload.disk.env import _META_PAGE

    raw = data.read_bytes()
    metas = [(off, _META_PAGE.unpack_from(raw, off)) for off in (0, 4096)]
    return max(metas, key=lambda m: m[1][6])


def _rewrite_meta(data, offset: int, fields: tuple) -> None:
    from kv_offload.disk.env import _META_PAGE

    raw = bytearray(data.read_bytes())
    head = bytes(raw[offset:offset + _META_PAGE.size])
    packed = bytearray(_META_PAGE.pack(*fields))
    for start, end in ((0, 16), (24, 40), (44, 80), (88, 128)):  # the bytes it skips
        packed[start:end] = head[start:end]
    raw[offset:offset + _META_PAGE.size] = bytes(packed)
    data.write_bytes(bytes(raw))


def test_an_index_shorter_than_its_last_page_by_unwritten_free_pages_opens(tmp_path):
    """LMDB counts pages it allocated and freed again in one commit without writing them:
    a process killed after such a commit leaves data.mdb shorter than its last page. The
    store must open and serve (it was refused as cut short: the engine of
    test_engine_faults' restart after kill -9 exited with StoreCorruptError)."""
    index = open_index(tmp_path)
    keys = [i.to_bytes(8, "little") * 4 for i in range(200)]
    index.commit([(k, s, (1,)) for k, s in zip(keys, index.allocate(keys))])
    index.close()
    data = tmp_path / "index" / "data.mdb"
    offset, meta = _newest_meta(data)
    _rewrite_meta(data, offset, (*meta[:5], meta[5] + 3, meta[6]))
    index = open_index(tmp_path)
    assert len(index.find_prefix(keys)) == 200
    more = [i.to_bytes(8, "little") * 4 for i in range(200, 260)]
    assert all(index.commit([(k, s, (1,)) for k, s in zip(more, index.allocate(more))]))
    index.close()


def test_an_index_whose_root_lies_past_its_end_is_refused(tmp_path):
    index = open_index(tmp_path)
    index.close()
    data = tmp_path / "index" / "data.mdb"
    offset, meta = _newest_meta(data)
    _rewrite_meta(data, offset, (*meta[:4], meta[5] + 1, *meta[5:]))
    with pytest.raises(StoreCorruptError, match="cut short"):
        open_index(tmp_path)


def fake_engine(spec_kind: str = "FullAttentionSpec", *, groups: int = 1, pp: int = 1,
                dcp: int = 1, pcp: int = 1, sleep: bool = False, spec_method: str | None = None):
    """(vllm_config, kv_cache_config) stand-ins with what layout_from_vllm reads first."""
    from types import SimpleNamespace

    spec = type(spec_kind, (), {})()
    kv_cache_config = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.attn"])] * groups)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp,
                                        decode_context_parallel_size=dcp,
                                        prefill_context_parallel_size=pcp),
        model_config=SimpleNamespace(enable_sleep_mode=sleep),
        speculative_config=None if spec_method is None else SimpleNamespace(method=spec_method))
    return vllm_config, kv_cache_config


@pytest.mark.parametrize(("engine", "message"), [
    ({"spec_kind": "ChunkedLocalAttentionSpec"},
     "has a ChunkedLocalAttentionSpec KV cache group (chunked-local"),
    ({"spec_kind": "CrossAttentionSpec"}, "has a CrossAttentionSpec KV cache group"),
    ({"spec_kind": "SinkFullAttentionSpec"}, "has a SinkFullAttentionSpec KV cache group"),
    ({"spec_kind": "MambaSpec"}, "with mamba or linear-attention layers (MambaSpec)"),
    ({"spec_kind": "FullAttentionSpec", "pp": 2}, "does not support pipeline parallelism"),
    ({"dcp": 2}, "context parallelism (decode_context_parallel_size=2)"),
    ({"pcp": 2}, "context parallelism (prefill_context_parallel_size=2)"),
    ({"sleep": True}, "does not support sleep mode (--enable-sleep-mode)"),
    ({"spec_method": "eagle3"}, "speculative decoding with method 'eagle3'"),
    ({"spec_method": "mtp"}, "speculative decoding with method 'mtp'"),
    ({"spec_method": "draft_model"}, "Use a draft-free method (ngram, ngram_gpu, suffix)"),
], ids=["chunked-local", "cross-attention", "sink", "mamba", "pipeline-parallel", "decode-cp",
        "prefill-cp", "sleep-mode", "eagle3", "mtp", "draft-model"])
def test_unsupported_models_are_refused_at_start_up_with_the_reason(engine, message):
    from kv_offload.plugin.engine_info import UnsupportedEngineError, layout_from_vllm

    with pytest.raises(UnsupportedEngineError, match=re.escape(message)):
        layout_from_vllm(*fake_engine(**engine), OffloadConfig())


def test_draft_free_speculation_is_not_refused():
    """n-gram speculation keeps no draft KV; tests/e2e/test_spec_decode.py shows its tokens
    equal recompute through kv-offload."""
    from kv_offload.plugin.engine_info import _refuse_unsupported_features

    for method in ("ngram", "suffix", None):
        _refuse_unsupported_features(fake_engine(spec_method=method)[0])


def test_sleep_mode_is_refused_before_vllm_starts_it():
    """vLLM 0.33 asks the connector class before it builds anything."""
    from kv_offload.plugin.connector import KVOffloadConnector

    assert KVOffloadConnector.supports_sleep_mode(None) is False
