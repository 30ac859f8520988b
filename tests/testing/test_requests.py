"""The one fake vLLM request (kv_offload/testing/requests.py) that the planner tests, the
reliability rig and the step loop share: chained hashes for any token id, growth, and
vLLM's optional attributes only where given."""

import pytest

from kv_offload.scheduler.lookup import hits_discarded
from kv_offload.testing.requests import FakeRequest


def test_block_hashes_chain_over_whole_blocks_of_any_token_id():
    """Regression: the planner tests hashed ``bytes(tokens)``, which raises for ids > 255."""
    req = FakeRequest("r", [1, 2, 300, 70_000, 5, 6, 7], block_size=4)
    assert len(req.block_hashes) == 1 and req.num_tokens == req.num_prompt_tokens == 7
    other = FakeRequest("o", [1, 2, 300, 70_001, 5, 6, 7, 8], block_size=4)
    assert other.block_hashes[0] != req.block_hashes[0]
    same_first = FakeRequest("s", [1, 2, 300, 70_000, 9, 9, 9, 9], block_size=4)
    assert same_first.block_hashes[0] == req.block_hashes[0]
    assert same_first.block_hashes[1] != other.block_hashes[1]  # chained on the parent


def test_appending_tokens_hashes_the_blocks_they_complete():
    grown = FakeRequest("g", [1, 2, 3], block_size=4)
    grown.append(4)
    grown.append(5, 6, 7, 8, 9)
    fresh = FakeRequest("f", list(range(1, 10)), block_size=4)
    assert grown.block_hashes == fresh.block_hashes and len(grown.block_hashes) == 2
    assert grown.all_token_ids == grown.tokens == list(range(1, 10))
    assert grown.num_tokens == 9 and grown.num_prompt_tokens == 3  # the prompt stays


def test_optional_vllm_attributes_exist_only_where_given():
    plain = FakeRequest("p", range(8), block_size=4)
    assert not hasattr(plain, "skip_reading_external_kv")  # an older vLLM's request
    skipping = plain.with_attributes(skip_reading_prefix_cache=True)
    assert hits_discarded(skipping) and not hits_discarded(plain)
    assert skipping.block_hashes == plain.block_hashes
    skipping.append(9)
    assert plain.num_tokens == 8, "a copy shares no list with its original"
    with pytest.raises(ValueError, match="not attributes"):
        FakeRequest("x", [1], block_size=4, skip_reading_everything=True)
    with pytest.raises(ValueError, match="block_size"):
        FakeRequest("x", [1], block_size=0)
