"""The vLLM connector API kv-offload is written against is the one installed.

If a vLLM release renames or reshapes a hook, the connector's method would silently
never be called (or be called with arguments it does not take). This fails instead.
"""

from __future__ import annotations

import inspect
import os

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kv_offload.plugin.connector import KVOffloadConnector

# README "Tested with", pyproject's vllm bounds. 0.32: the whole suite (the CPU wheel);
# 0.34: this file and the scheduler-level tests on its pure-Python modules
# (make test-vllm-next); 0.33: hook signatures read from its source.
TESTED_VLLM = ("0.32", "0.33", "0.34")
NEWER_HOOKS = {"supports_sleep_mode": "0.33", "unregister_kv_caches": "0.33",
               "restore_kv_caches": "0.33",
               "may_load_async": "0.34"}  # implemented ahead of the 0.32 base class


def _version() -> tuple[int, int]:
    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


def overridden_hooks() -> list[str]:
    """Public names the connector defines: each one overrides a vLLM hook."""
    return sorted(name for name in vars(KVOffloadConnector) if not name.startswith("_"))


def test_installed_vllm_is_a_tested_version():
    assert ".".join(vllm.__version__.split(".")[:2]) in TESTED_VLLM
    # make test-vllm-next names the vLLM it puts ahead of the CPU wheel's: a path that
    # missed would run the lane on the CPU wheel's vLLM without a word.
    lane = os.environ.get("KV_OFFLOAD_VLLM_NEXT")
    assert lane is None or vllm.__version__ == lane, (
        f"the lane should import vLLM {lane}, got {vllm.__version__} from {vllm.__file__}")


def test_the_cuda_extras_admit_every_tested_vllm_and_no_later_one():
    """A user who installs kv-offload beside the newest tested vLLM is not refused, and
    one beside an untested release is told so by pip."""
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    newest = max(tuple(int(p) for p in v.split(".")) for v in TESTED_VLLM)
    for extra in ("cuda12", "cuda13"):
        (spec,) = [Requirement(r).specifier for r in extras[extra]
                   if Requirement(r).name == "vllm"]
        for version in TESTED_VLLM:
            assert spec.contains(f"{version}.0"), f"[{extra}] refuses vLLM {version}: {spec}"
        assert not spec.contains(f"{newest[0]}.{newest[1] + 1}.0"), (
            f"[{extra}] admits vLLM {newest[0]}.{newest[1] + 1}, which is not tested: {spec}")


@pytest.mark.parametrize("name", overridden_hooks())
def test_every_hook_exists_in_vllm_with_a_compatible_signature(name):
    since = NEWER_HOOKS.get(name)
    base = SupportsHMA if hasattr(SupportsHMA, name) else KVConnectorBase_V1
    if not hasattr(base, name):
        assert since is not None, f"{name} is not a KVConnectorBase_V1 hook in vLLM {vllm.__version__}"
        assert _version() < tuple(int(p) for p in since.split(".")), (
            f"vLLM {vllm.__version__} should have {name} (added in {since})")
        return
    ours, theirs = getattr(KVOffloadConnector, name), getattr(base, name)
    if isinstance(inspect.getattr_static(base, name), property):
        assert isinstance(inspect.getattr_static(KVOffloadConnector, name), property)
        return
    assert_compatible(name, inspect.signature(ours), inspect.signature(theirs))


def assert_compatible(name: str, ours: inspect.Signature, theirs: inspect.Signature) -> None:
    """Every argument vLLM passes (by the base signature) is accepted, and nothing else is
    required."""
    params = ours.parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    takes_args = any(p.kind is p.VAR_POSITIONAL for p in params.values())
    for p in theirs.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in params:
            assert params[p.name].kind in (p.kind, p.POSITIONAL_OR_KEYWORD), (
                f"{name}: parameter {p.name} is {params[p.name].kind}, vLLM's is {p.kind}")
        else:
            assert takes_kwargs or (takes_args and p.kind is p.POSITIONAL_ONLY), (
                f"{name}: vLLM passes {p.name}, the connector does not take it")
    for p in params.values():
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            assert p.name in theirs.parameters, (
                f"{name}: the connector requires {p.name}, which vLLM does not pass")


def test_the_check_catches_a_renamed_argument():
    def base(self, request, num_computed_tokens): ...

    def renamed(self, request, num_tokens): ...

    with pytest.raises(AssertionError, match="num_computed_tokens"):
        assert_compatible("hook", inspect.signature(renamed), inspect.signature(base))
