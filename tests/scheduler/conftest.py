"""Fixtures of the planner tests."""

import pytest


@pytest.fixture
def disk_index(tmp_path):
    from kv_offload.disk import DiskIndex

    index = DiskIndex.open(tmp_path / "store", namespace_id="ab" * 16,
                           descriptor={"test": True}, slot_bytes=64, num_ranks=2,
                           capacity_bytes=64 * 2 * 8)
    yield index
    index.close()
