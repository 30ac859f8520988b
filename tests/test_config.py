"""OffloadConfig: round trips and every bad input, each with a message that says the fix."""

import json
import os

import pytest

from kv_offload import OffloadConfig
from kv_offload.config import parse_size
from kv_offload.disk import DiskIndex, StorePathError


def test_sizes_accept_units_and_integers():
    assert parse_size("8GiB", name="x") == 8 * 2**30
    assert parse_size("500MB", name="x") == 500 * 10**6
    assert parse_size("1.5 KiB", name="x") == 1536
    assert parse_size(4096, name="x") == 4096
    assert OffloadConfig(cpu_size="1GiB").cpu_size == 2**30


def test_round_trip_through_extra_config_and_json(tmp_path):
    cfg = OffloadConfig(cpu_size="256MiB", disk_path=str(tmp_path / "store"), disk_size="2GB",
                        chunk_tokens=64, io_threads=2, namespace_salt="tenant-a")
    assert OffloadConfig.from_extra_config(cfg.to_extra_config()) == cfg
    assert OffloadConfig.from_json(cfg.to_json()) == cfg
    data = json.loads(cfg.to_json())
    assert data["kv_connector"] == "KVOffloadConnector"
    assert data["kv_connector_module_path"] == "kv_offload.connector"
    assert data["kv_role"] == "kv_both"
    assert data["kv_load_failure_policy"] == "recompute"


def test_to_kv_transfer_config_is_vllms_object():
    ktc = OffloadConfig(cpu_size="64MiB").to_kv_transfer_config()
    assert type(ktc).__name__ == "KVTransferConfig"
    assert ktc.kv_connector == "KVOffloadConnector"
    assert ktc.kv_connector_module_path == "kv_offload.connector"
    assert ktc.kv_connector_extra_config["cpu_size"] == 64 * 2**20


def test_disk_tier_is_off_without_path():
    assert not OffloadConfig().disk_enabled
    assert OffloadConfig(disk_path="/tmp/kvo-x").disk_enabled


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cpu_size": "-1GiB"}, "cpu_size"),
        ({"cpu_size": -5}, "must not be negative"),
        ({"cpu_size": "lots"}, "cannot parse 'lots'"),
        ({"cpu_size": "8 parsecs"}, "units"),
        ({"cpu_size": 0}, "cpu_size: must be > 0"),
        ({"disk_size": [1]}, "disk_size"),
        ({"chunk_tokens": 0}, "chunk_tokens: must be >= 1"),
        ({"chunk_tokens": "256"}, "chunk_tokens: expected an integer"),
        ({"io_threads": 0}, "io_threads"),
        ({"eviction_policy": "random"}, "choose one of lru, fifo"),
        ({"connector_reset": "disk"}, "connector_reset: 'disk' is not supported; choose one of all, cpu"),
        ({"verify_checksums": "yes"}, "verify_checksums: expected true or false"),
        ({"load_timeout_s": 0}, "load_timeout_s"),
        ({"namespace_salt": 3}, "namespace_salt"),
    ],
)
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig(**kwargs)


def test_validation_touches_no_file_system(tmp_path, monkeypatch):
    """A config is a value: a disk_path that is a file is accepted here and refused where
    the store is opened, with the same message."""
    f = tmp_path / "file"
    f.write_text("x")

    def no_fs(*args, **kwargs):
        raise AssertionError("OffloadConfig touched the file system")

    for name in ("exists", "isdir", "isfile"):
        monkeypatch.setattr(os.path, name, no_fs)
    monkeypatch.setattr(os, "stat", no_fs)
    cfg = OffloadConfig(disk_path=str(f))
    monkeypatch.undo()
    assert cfg.disk_path == str(f)
    with pytest.raises(StorePathError, match="disk_path: .* is a file, not a directory"):
        DiskIndex.open(cfg.disk_path, namespace_id="ab", descriptor={}, slot_bytes=64,
                       num_ranks=1, capacity_bytes=cfg.disk_size)


def test_unknown_key_names_key_valid_keys_and_closest_match():
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_extra_config({"cpu_sise": "1GiB"})
    text = str(info.value)
    assert "'cpu_sise'" in text and "Did you mean 'cpu_size'" in text and "disk_path" in text


def test_chunk_tokens_must_be_multiple_of_block_size():
    assert OffloadConfig(chunk_tokens=256).resolve_chunk_tokens(128) == 256
    assert OffloadConfig().resolve_chunk_tokens(128) == 256
    assert OffloadConfig().resolve_chunk_tokens(16) == 256
    assert OffloadConfig().resolve_chunk_tokens(96) == 288
    with pytest.raises(ValueError, match="not a multiple of vLLM's block size 128; use 128 or 256"):
        OffloadConfig(chunk_tokens=200).resolve_chunk_tokens(128)


def test_bad_json_is_a_clear_error():
    with pytest.raises(ValueError, match="not valid JSON"):
        OffloadConfig.from_json("{cpu_size: 1}")


@pytest.mark.parametrize("kwargs, message", [
    ({"remote_url": "http://cache:6379"}, "remote_url: expected a URL starting with"),
    ({"remote_url": 6379}, "remote_url"),
    ({"remote_url": "redis://a:1", "remote_cluster_nodes": ["b:2"]}, "both set"),
    ({"remote_cluster_nodes": []}, "remote_cluster_nodes: expected a list of seed nodes"),
    ({"remote_cluster_nodes": ["no-port"]}, "remote_cluster_nodes"),
    ({"remote_timeout_s": 0}, "remote_timeout_s: expected a positive number"),
    ({"remote_lookup_budget_ms": -1}, "remote_lookup_budget_ms"),
    ({"remote_max_value_size": "lots"}, "remote_max_value_size: cannot parse"),
    ({"remote_key_prefix": "has space"}, "remote_key_prefix"),
    ({"remote_key_prefix": "a{b}"}, "remote_key_prefix"),
    ({"remote_ttl_s": 0}, "remote_ttl_s: must be >= 1"),
])
def test_remote_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig(**kwargs)


def test_remote_options_round_trip_through_json():
    cfg = OffloadConfig(remote_cluster_nodes="10.0.0.5:7000, redis://:pw@10.0.0.6:7000",
                        remote_max_value_size="64MiB")
    assert cfg.remote_enabled and cfg.remote_max_value_size == 64 * 2**20
    assert cfg.remote_cluster_nodes == ["10.0.0.5:7000", "redis://:pw@10.0.0.6:7000"]
    assert OffloadConfig.from_json(cfg.to_json()) == cfg
    assert not OffloadConfig().remote_enabled
    assert OffloadConfig(remote_url="valkey://cache:6379/1").remote_enabled


def test_a_chunk_larger_than_the_value_limit_fails_at_start_with_the_fix():
    from kv_offload.layout import KVLayout
    from kv_offload.remote import remote_tier_for

    layout = KVLayout(model="m", model_fingerprint="f", dtype="bfloat16", kv_cache_dtype="auto",
                      attention="full_attention", num_layers=32, page_bytes=2 * 2**20,
                      block_size=16, tokens_per_hash=16, chunk_tokens=256, tp_size=1,
                      pp_size=1, hash_algo="sha256")
    cfg = OffloadConfig(remote_url="redis://cache:6379", remote_max_value_size="64MiB")
    with pytest.raises(ValueError, match="remote_max_value_size: a chunk of this model is "
                       "1.0 GiB.*raise remote_max_value_size.*or lower chunk_tokens"):
        remote_tier_for(cfg, layout, namespace="ab" * 16, who="test")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"copy_mode": "memcpy"}, "copy_mode: 'memcpy' is not supported; choose one of auto, dma, kernel"),
    ({"audit_rate": -0.1}, "audit_rate: expected a fraction from 0 \\(off\\) to 1"),
    ({"audit_rate": 1.5}, "audit_rate"),
    ({"audit_rate": float("nan")}, "audit_rate"),
    ({"audit_rate": float("inf")}, "audit_rate"),
    ({"audit_rate": True}, "audit_rate"),
    ({"audit_rate": "0.01"}, "audit_rate"),
])
def test_copy_options_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig(**kwargs)


def test_copy_options_default_to_dma_and_a_small_audit_and_round_trip():
    config = OffloadConfig()
    assert (config.copy_mode, config.audit_rate) == ("auto", 0.01)
    again = OffloadConfig.from_json(OffloadConfig(copy_mode="kernel", audit_rate=0).to_json())
    assert (again.copy_mode, again.audit_rate) == ("kernel", 0)


@pytest.mark.parametrize("bad", [-1, "20", float("nan"), 20_000, True])
def test_sync_load_budget_ms_must_be_a_number_of_milliseconds_or_zero(bad):
    with pytest.raises(ValueError, match="sync_load_budget_ms"):
        OffloadConfig(sync_load_budget_ms=bad)
    assert OffloadConfig(sync_load_budget_ms=0).sync_load_budget_ms == 0
