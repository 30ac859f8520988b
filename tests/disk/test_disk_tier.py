"""DiskTier: whatever the disk index raises turns the tier off; nothing reaches vLLM."""

import logging

import pytest

from kv_offload.disk.errors import StorePathError
from kv_offload.disk.tier import DiskTier


class BrokenIndex:
    """A disk index whose every call raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise self.error
        return fail


@pytest.mark.parametrize("error", [StorePathError("read-only file system"),
                                   KeyError("a bug")], ids=["store_error", "unexpected"])
def test_a_failing_index_turns_the_tier_off_and_answers_nothing(error, caplog):
    tier = DiskTier(BrokenIndex(error))
    with caplog.at_level(logging.ERROR, logger="kv_offload"):
        assert tier.stats() is None  # the metrics poll found it first
    assert not tier.enabled and "disabled for this run" in caplog.text
    assert tier.find("r", [b"k"]) == [] and tier.reserve([b"k"]) == [None]
    assert tier.num_pending_accesses() == 0
    tier.commit([(b"k", 1, (2,))])
    tier.close()  # what jobs in flight queued is tried, and fails quietly
