"""Fixtures of the planner tests; the ``vllm_kernels`` marker of the vllm-next lane."""

import os

import pytest

LANE_VERSION = os.environ.get("KV_OFFLOAD_VLLM_NEXT")  # set by make test-vllm-next


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "vllm_kernels: needs vLLM's compiled kernels; skipped, with the reason, "
        "in make test-vllm-next (vLLM's pure-Python modules only)")


def pytest_collection_modifyitems(config, items):
    """In the vllm-next lane, a test marked ``vllm_kernels`` is skipped and says why; an
    unmarked test that needs a kernel fails there (ModuleNotFoundError: vllm._C)."""
    if LANE_VERSION is None:
        return
    skip = pytest.mark.skip(reason=f"needs vLLM's compiled kernels: make test-vllm-next runs "
                                   f"vLLM {LANE_VERSION}'s pure-Python modules only")
    for item in items:
        if item.get_closest_marker("vllm_kernels"):
            item.add_marker(skip)


@pytest.fixture
def disk_index(tmp_path):
    from kv_offload.disk import DiskIndex

    index = DiskIndex.open(tmp_path / "store", namespace_id="ab" * 16,
                           descriptor={"test": True}, slot_bytes=64, num_ranks=2,
                           capacity_bytes=64 * 2 * 8)
    yield index
    index.close()
