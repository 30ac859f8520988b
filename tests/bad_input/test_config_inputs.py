"""Bad configuration values, one row each: what the user sees.

Every row asserts the error type, that the message names the field and says the fix,
and, where the input holds a secret (a Redis password), that the secret appears in
neither the message nor the traceback. docs/bad-input.md quotes these messages.

Regression scenarios (issue 35): a password in ``remote_url`` had no other place to go,
so vLLM printed it with ``kv_connector_extra_config`` at start-up; a URL with a password
and a port that is not a number stopped start-up with ``Port could not be cast...``
(naming neither the field nor the fix) while the same URL without a password was
accepted and failed later; a database that is not a number was silently database 0;
``NaN`` and ``inf`` passed as time values; a chunk longer than ``max_model_len`` stored
nothing and said nothing; ``warm --config`` refused the full ``--kv-transfer-config``
JSON, and an extra config given as a string or a list ended in "dictionary update
sequence element #0".
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kv_offload import OffloadConfig
from kv_offload.layout import KVLayout

SECRET = "hunter2-Pa55"  # a Redis password; must never be shown
ENV = "KVO_TEST_REDIS_PASSWORD"
LAYOUT = KVLayout(model="m", model_fingerprint="f", dtype="float32", kv_cache_dtype="auto",
                  attention="full_attention", num_layers=2, page_bytes=4096, block_size=16,
                  tokens_per_hash=16, chunk_tokens=64, tp_size=1, pp_size=1,
                  hash_algo="sha256")


@dataclass(frozen=True)
class Case:
    """One bad input. ``build`` turns ``value`` into what is checked: a config (dict, through
    ``from_extra_config``), a JSON text (``from_json``) or a start-up (``remote_tier_for``)."""

    value: Any
    field: str  # named in the message
    fix: str  # a fragment of the fix, in the message
    secret: str | None = None  # must appear nowhere
    build: str = "config"
    error: type[Exception] = ValueError
    env: dict[str, str] = field(default_factory=dict)


def _start_up(extra: dict) -> Any:
    """What the connector does with the config at start-up (scheduler and workers)."""
    from kv_offload.remote import remote_tier_for

    return remote_tier_for(OffloadConfig.from_extra_config(extra), LAYOUT,
                           namespace="ab" * 16, who="test")


BUILDERS: dict[str, Callable[[Any], Any]] = {
    "config": OffloadConfig.from_extra_config,
    "json": OffloadConfig.from_json,
    "start-up": _start_up,
}

REMOTE = {"remote_url": "redis://cache:6379/0"}
WITH_ENV = {**REMOTE, "remote_password_env": ENV}

CASES: dict[str, Case] = {
    # -- remote_url: every URL redis-py would not connect to as written ---------------------
    "port-not-a-number-with-password": Case(
        {"remote_url": f"redis://:{SECRET}@cache:abc/0"}, "remote_url", "1 to 65535", SECRET),
    "port-not-a-number": Case({"remote_url": "redis://cache:abc/0"}, "remote_url", "1 to 65535"),
    "port-out-of-range": Case({"remote_url": "redis://cache:70000/0"}, "remote_url",
                              "1 to 65535"),
    "port-zero": Case({"remote_url": "redis://cache:0/0"}, "remote_url", "1 to 65535"),
    "password-with-a-raw-slash": Case(  # urlsplit then reads "hunter2" as the host's port
        {"remote_url": f"redis://:{SECRET}/x@cache:6379/0"}, "remote_url", "percent-encode",
        SECRET),
    "database-not-a-number": Case({"remote_url": "redis://cache:6379/zero"}, "remote_url",
                                  "database number"),
    "database-query-not-a-number": Case({"remote_url": "unix:///run/redis.sock?db=one"},
                                        "remote_url", "database number"),
    "no-host": Case({"remote_url": "redis://:6379/0"}, "remote_url", "unset shell variable"),
    "unix-socket-with-two-slashes": Case({"remote_url": "unix://run/redis.sock"}, "remote_url",
                                         "unix:///"),
    "unix-socket-without-path": Case({"remote_url": "unix://"}, "remote_url", "unix:///"),
    "trailing-newline": Case({"remote_url": "redis://cache:6379/0\n"}, "remote_url",
                             "remove it"),
    "wrong-scheme-with-password": Case({"remote_url": f"http://u:{SECRET}@cache:6379"},
                                       "remote_url", "redis://", SECRET),
    "password-written-as-user": Case({"remote_url": f"redis://{SECRET}@cache:6379/0"},
                                     "remote_url", "remote_password_env", SECRET),
    "cluster-node-bad-port-with-password": Case(
        {"remote_cluster_nodes": [f"redis://:{SECRET}@h:x"]}, "remote_cluster_nodes",
        "10.0.0.5:7000", SECRET),
    "cluster-node-port-out-of-range": Case({"remote_cluster_nodes": ["h:99999"]},
                                           "remote_cluster_nodes", "1 to 65535"),
    # -- where the password comes from: exactly one source, named right ---------------------
    "password-env-holds-the-password": Case({**REMOTE, "remote_password_env": "p@ss w0rd!"},
                                            "remote_password_env", "name of an environment",
                                            "p@ss w0rd!"),
    "password-env-without-server": Case({"remote_password_env": ENV}, "remote_password_env",
                                        "remote_url"),
    "password-env-and-file": Case({**WITH_ENV, "remote_password_file": "/run/secrets/pw"},
                                  "remote_password_file", "keep one"),
    "password-in-url-and-env": Case(
        {"remote_url": f"redis://:{SECRET}@cache:6379/0", "remote_password_env": ENV},
        "remote_url", "remove the password from remote_url", SECRET),
    "password-in-query-and-env": Case(
        {"remote_url": f"unix:///run/redis.sock?password={SECRET}", "remote_password_env": ENV},
        "remote_url", "remove the password from remote_url", SECRET),
    "password-in-cluster-node-and-env": Case(
        {"remote_cluster_nodes": [f"redis://:{SECRET}@h:7000"], "remote_password_env": ENV},
        "remote_cluster_nodes", "remove the password", SECRET),
    "password-file-relative": Case({**REMOTE, "remote_password_file": "secrets/pw"},
                                   "remote_password_file", "absolute path", "secrets/pw"),
    "password-file-not-a-string": Case({**REMOTE, "remote_password_file": 5},
                                       "remote_password_file", "absolute path"),
    # -- the password, read at start-up --------------------------------------------------------
    "password-env-unset": Case(WITH_ENV, "remote_password_env", f"export {ENV}",
                               build="start-up"),
    "password-env-empty": Case(WITH_ENV, "remote_password_env", "is empty", build="start-up",
                               env={ENV: ""}),
    "password-env-two-lines": Case(WITH_ENV, "remote_password_env", "alone", SECRET,
                                   build="start-up", env={ENV: f"{SECRET}\nmore"}),
    "password-file-missing": Case({**REMOTE, "remote_password_file": "{tmp}/nope"},
                                  "remote_password_file", "No such file", build="start-up"),
    "password-file-is-a-directory": Case({**REMOTE, "remote_password_file": "{tmp}"},
                                         "remote_password_file", "not a regular file",
                                         build="start-up"),
    "password-file-empty": Case({**REMOTE, "remote_password_file": "{tmp}/empty"},
                                "remote_password_file", "is empty", build="start-up"),
    "password-file-two-lines": Case({**REMOTE, "remote_password_file": "{tmp}/two-lines"},
                                    "remote_password_file", "one line", SECRET,
                                    build="start-up"),
    "password-file-huge": Case({**REMOTE, "remote_password_file": "{tmp}/huge"},
                               "remote_password_file", "larger than 4096 bytes", SECRET,
                               build="start-up"),
    "password-file-not-utf8": Case({**REMOTE, "remote_password_file": "{tmp}/binary"},
                                   "remote_password_file", "UTF-8", build="start-up"),
    # -- numbers: finite and in range ----------------------------------------------------------
    "load-timeout-nan": Case('{"load_timeout_s": NaN}', "load_timeout_s", "finite",
                             build="json"),
    "load-timeout-huge": Case({"load_timeout_s": 1e12}, "load_timeout_s", "at most 86400"),
    "remote-timeout-infinite": Case('{"remote_url": "redis://h:1", "remote_timeout_s": '
                                    'Infinity}', "remote_timeout_s", "finite", build="json"),
    "lookup-budget-nan": Case({**REMOTE, "remote_lookup_budget_ms": float("nan")},
                              "remote_lookup_budget_ms", "finite"),
    "lookup-budget-huge": Case({**REMOTE, "remote_lookup_budget_ms": 1e10},
                               "remote_lookup_budget_ms", "at most 86400000"),
    "max-backoff-infinite": Case({**REMOTE, "remote_max_backoff_s": float("inf")},
                                 "remote_max_backoff_s", "finite"),
    "ttl-beyond-the-server-limit": Case({**REMOTE, "remote_ttl_s": 10**16}, "remote_ttl_s",
                                        "leave it unset"),
    "cpu-size-infinite": Case('{"cpu_size": Infinity}', "cpu_size", "8GiB", build="json"),
    "cpu-size-rounds-to-zero": Case({"cpu_size": "0.5"}, "cpu_size", "must be > 0"),
    # -- the config's own form -----------------------------------------------------------------
    "extra-config-as-a-string": Case('{"kv_connector_extra_config": "{\\"cpu_size\\": 1}"}',
                                     "kv_connector_extra_config", "remove the quotes",
                                     build="json"),
    "extra-config-as-a-list": Case('{"kv_connector_extra_config": ["cpu_size", "1GiB"]}',
                                   "kv_connector_extra_config", '{"cpu_size": "8GiB"}',
                                   build="json"),
    "extra-config-not-a-dict": Case("cpu_size=1GiB", "kv_connector_extra_config",
                                    '{"cpu_size": "8GiB"}'),
    "another-connector": Case('{"kv_connector": "LMCacheConnectorV1", '
                              '"kv_connector_extra_config": {}}', "kv_connector",
                              "KVOffloadConnector", build="json"),
    "option-next-to-kv-connector": Case('{"kv_connector": "KVOffloadConnector", '
                                        '"cpu_size": "1GiB"}', "cpu_size",
                                        "inside kv_connector_extra_config", build="json"),
    "extra-config-key-misspelt": Case('{"kv_connector": "KVOffloadConnector", '
                                      '"kv_conector_extra_config": {"cpu_size": "1GiB"}}',
                                      "kv_conector_extra_config", "kv_connector_extra_config",
                                      build="json"),
    "transfer-field-inside-extra-config": Case({"kv_role": "kv_both"}, "kv_role",
                                               "--kv-transfer-config"),
}


@pytest.fixture
def secret_files(tmp_path) -> Path:
    (tmp_path / "empty").write_text("")
    (tmp_path / "two-lines").write_text(f"{SECRET}\nother\n")
    (tmp_path / "huge").write_text(SECRET * 1000)
    (tmp_path / "binary").write_bytes(b"\xff\xfe" + SECRET.encode())
    return tmp_path


def _with_tmp(value: Any, tmp: Path) -> Any:
    if isinstance(value, dict):
        return {k: v.replace("{tmp}", str(tmp)) if isinstance(v, str) else v
                for k, v in value.items()}
    return value


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_config_value(case: Case, secret_files, monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(case.error) as info:
        BUILDERS[case.build](_with_tmp(case.value, secret_files))
    message = str(info.value)
    assert case.field in message, message
    assert case.fix in message, message
    if case.secret is not None:
        shown = "".join(traceback.format_exception(info.value)) + caplog.text
        assert case.secret not in shown, shown


# -- chunks that no request can fill ---------------------------------------------------------


@pytest.mark.parametrize(("chunk_tokens", "block_size", "max_model_len", "fix"), [
    (512, 16, 256, "multiple of the block size 16 below 256, e.g. 128"),
    (None, 16, 256, "(the default)"),
    (256, 16, 256, "e.g. 128"),
    (None, 64, 64, "raise max_model_len"),
], ids=["chunk-longer-than-max-model-len", "default-chunk-too-long", "chunk-equal-to-it",
        "no-chunk-fits"])
def test_a_chunk_no_request_can_fill_is_refused(chunk_tokens, block_size, max_model_len, fix):
    """A request holds at most max_model_len tokens and a hit leaves its last one to
    compute: a chunk of max_model_len tokens or more is never stored, never loaded."""
    config = OffloadConfig(chunk_tokens=chunk_tokens)
    with pytest.raises(ValueError) as info:
        config.resolve_chunk_tokens(block_size, max_model_len=max_model_len)
    message = str(info.value)
    assert message.startswith("chunk_tokens: ") and f"max_model_len {max_model_len}" in message
    assert fix in message, message
    assert OffloadConfig().resolve_chunk_tokens(16, max_model_len=257) == 256


def test_the_connector_refuses_a_chunk_longer_than_max_model_len():
    """The check runs where the connector builds its layout from vLLM's config."""
    pytest.importorskip("vllm")
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from kv_offload.plugin.engine_info import layout_from_vllm
    from kv_offload.testing.tiny_model import make_tiny_model

    vllm_config = EngineArgs(model=str(make_tiny_model()), block_size=16,
                             max_model_len=128).create_engine_config()
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
        64 * spec.page_size_bytes)
    with pytest.raises(ValueError, match=r"chunk_tokens: .*max_model_len 128"):
        layout_from_vllm(vllm_config, kv_cache_config, OffloadConfig())
    layout = layout_from_vllm(vllm_config, kv_cache_config, OffloadConfig(chunk_tokens=64))
    assert layout.chunk_tokens == 64


# -- the documented way keeps the secret out of everything kv-offload shows ------------------


def documented_configs(tmp_path: Path) -> list[OffloadConfig]:
    """The README's way (the password in an environment variable), and a file."""
    path = tmp_path / "redis-password"
    path.write_text(SECRET + "\n")  # as `echo` writes it
    return [OffloadConfig(remote_url="redis://default@cache:6379/0", remote_password_env=ENV),
            OffloadConfig(remote_cluster_nodes=["10.0.0.5:7000", "10.0.0.6:7000"],
                          remote_password_file=str(path))]


def test_the_password_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, SECRET)
    by_env, by_file = documented_configs(tmp_path)
    assert by_env.remote_password() == SECRET
    assert by_file.remote_password() == SECRET, "the trailing newline is not part of it"
    (tmp_path / "crlf").write_bytes(SECRET.encode() + b"\r\n")
    assert OffloadConfig(remote_url="redis://h:1", remote_password_file=str(tmp_path / "crlf")
                         ).remote_password() == SECRET
    assert OffloadConfig(remote_url="redis://h:1").remote_password() is None


def test_the_secret_never_shows_when_the_documented_way_is_used(tmp_path, monkeypatch, caplog):
    from kv_offload.remote import RemoteTarget, remote_tier_for

    monkeypatch.setenv(ENV, SECRET)
    caplog.set_level(logging.DEBUG)
    for config in documented_configs(tmp_path):
        again = OffloadConfig.from_json(config.to_json())
        assert again == config
        shown = [repr(config), str(config), config.to_json(), json.dumps(
            config.to_extra_config()), repr(config.to_kv_transfer_config())]
        tier = remote_tier_for(config, LAYOUT, namespace="ab" * 16, who="test")
        assert tier.target.password == SECRET
        shown += [repr(tier.target), tier.target.describe(), tier.health.who]
        tier.health.record_failure(ConnectionError("refused"))  # the warning it logs
        tier.close()
        shown.append(caplog.text)
        for text in shown:
            assert SECRET not in text, text
    assert SECRET not in repr(RemoteTarget("redis://h:1", password=SECRET))


def test_a_password_in_remote_url_is_hidden_in_the_configs_repr():
    """Not the documented way, but kv-offload itself never prints it."""
    config = OffloadConfig(remote_url=f"redis://user:{SECRET}@cache:6379/0")
    nodes = OffloadConfig(remote_cluster_nodes=[f"redis://:{SECRET}@h:7000"])
    for text in (repr(config), str(config), repr(nodes)):
        assert SECRET not in text and "***" in text, text
    assert SECRET in config.to_json(), "the config itself keeps it"


def test_the_password_reaches_redis_py(tmp_path, monkeypatch):
    """connect_redis hands the password to the client (standalone and cluster)."""
    import redis
    from redis.cluster import RedisCluster

    from kv_offload.remote import RemoteTarget, connect_redis

    client = connect_redis(RemoteTarget("redis://default@cache:6379/0", password=SECRET), 1.0)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["password"], kwargs["username"]) == (SECRET, "default")
    seen: dict[str, Any] = {}

    def from_url(url: str, **kw: Any) -> None:
        seen.update(kw, url=url)

    monkeypatch.setattr(RedisCluster, "from_url", from_url)
    connect_redis(RemoteTarget(cluster_nodes=("10.0.0.5:7000",), password=SECRET), 1.0)
    assert seen["password"] == SECRET and SECRET not in seen["url"]
    assert isinstance(client, redis.Redis)


@pytest.fixture
def password_server(redis_server):
    """The module's Redis server, asking for SECRET; open again afterwards."""
    import redis

    redis.Redis.from_url(redis_server.url).config_set("requirepass", SECRET)
    yield redis_server
    redis.Redis.from_url(redis_server.url, password=SECRET).config_set("requirepass", "")


def test_a_server_with_a_password_serves_the_documented_config(password_server, monkeypatch,
                                                                 caplog):
    """The password from the environment logs in; a wrong one fails as a remote failure
    whose warning shows neither password."""
    from kv_offload.remote import remote_tier_for

    caplog.set_level(logging.DEBUG)
    config = OffloadConfig(remote_url=password_server.url, remote_password_env=ENV)
    monkeypatch.setenv(ENV, SECRET)
    tier = remote_tier_for(config, LAYOUT, namespace="ab" * 16, who="test")
    key = b"k" * 32
    assert tier.write(key, 0, memoryview(bytes(LAYOUT.slot_bytes)))
    assert tier.lookup([key]) == 1
    tier.close()
    monkeypatch.setenv(ENV, "wrong-" + SECRET[::-1])
    tier = remote_tier_for(config, LAYOUT, namespace="ab" * 16, who="test")
    assert not tier.write(key, 0, memoryview(bytes(LAYOUT.slot_bytes)))
    assert "failed" in caplog.text
    assert SECRET not in caplog.text and SECRET[::-1] not in caplog.text
    tier.close()


# -- `kv-offload warm --config`: the extra config or the whole --kv-transfer-config ------------


@pytest.fixture
def warm_inputs(tmp_path, monkeypatch):
    """A fake model dir and a missing prompt file: warm parses its config, then stops at
    the prompts (vLLM made unimportable: nothing past validation may start an engine)."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return tmp_path, model


def warm(capsys, tmp: Path, model: Path, config: Any) -> tuple[int, str]:
    from kv_offload.tools.cli import main

    path = tmp / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    code = main(["warm", "--model", str(model), "--prompts", str(tmp / "nope.jsonl"),
                 "--config", str(path)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_warm_accepts_the_full_kv_transfer_config_and_its_extra_config(warm_inputs, capsys):
    tmp, model = warm_inputs
    extra = OffloadConfig(disk_path=str(tmp / "store"), chunk_tokens=64).to_extra_config()
    full = json.loads(OffloadConfig.from_extra_config(extra).to_json())
    bare_full = {"kv_connector": "KVOffloadConnector", "kv_role": "kv_both",
                 "kv_connector_module_path": "kv_offload.connector"}
    for config in (extra, full, {**bare_full, "kv_connector_extra_config": extra}):
        code, err = warm(capsys, tmp, model, config)
        assert code == 2 and "prompt file" in err and "does not exist" in err, err
    code, err = warm(capsys, tmp, model, bare_full)
    assert code == 2 and "needs a disk path" in err, err


@pytest.mark.parametrize(("config", "expected"), [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"},
     "kv_connector: this --kv-transfer-config is for 'NixlConnector'"),
    ({"kv_connector_extra_config": "disk_path=/x"},
     "kv_connector_extra_config: expected an object of kv-offload options"),
    ({"kv_connector_extra_config": ["disk_path", "/x"]},
     "kv_connector_extra_config: expected an object of kv-offload options"),
    ([1, 2], "kv-offload config JSON must be an object"),
], ids=["another-connector", "extra-config-string", "extra-config-list", "a-list"])
def test_warm_config_of_the_wrong_form_is_a_clear_error(warm_inputs, capsys, config, expected):
    tmp, model = warm_inputs
    code, err = warm(capsys, tmp, model, config)
    assert code == 2 and err.startswith("kv-offload warm: error: --config ") and expected in err


def test_a_password_written_in_the_config_is_noticed():
    """The connector warns at start-up when the password is in the config that vLLM prints."""
    assert OffloadConfig(remote_url=f"redis://:{SECRET}@h:1/0").remote_password_in_config
    assert OffloadConfig(remote_url=f"unix:///r.sock?password={SECRET}"
                         ).remote_password_in_config
    assert OffloadConfig(remote_cluster_nodes=[f"redis://u:{SECRET}@h:7000"]
                         ).remote_password_in_config
    assert not OffloadConfig(remote_url="redis://default@h:1/0",
                             remote_password_env=ENV).remote_password_in_config
    assert not OffloadConfig().remote_password_in_config


def test_warm_refuses_a_chunk_longer_than_its_max_model_len(warm_inputs, capsys):
    """Before any engine starts: warm knows the block size and max_model_len it was given."""
    from kv_offload.tools.cli import main

    tmp, model = warm_inputs
    (tmp / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    code = main(["warm", "--model", str(model), "--prompts", str(tmp / "prompts.jsonl"),
                 "--disk-path", str(tmp / "store"), "--block-size", "16",
                 "--max-model-len", "128"])
    err = capsys.readouterr().err
    assert code == 2 and "chunk_tokens: a chunk of 256 tokens (the default)" in err, err
    assert "max_model_len 128" in err and "e.g. 64" in err
