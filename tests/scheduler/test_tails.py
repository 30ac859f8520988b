"""Request tails (scheduler/tails.py): keys, the per-parent index, what a finishing
request stores. Pure: no vLLM."""

from __future__ import annotations

from types import SimpleNamespace

from kv_offload.groups import ChunkMap, KVGroup
from kv_offload.jobs import SKIP_BLOCK
from kv_offload.scheduler.tails import (
    MAX_TAILS_PER_PARENT,
    TailIndex,
    TailMatch,
    tail_key,
    tail_seed,
    tail_to_store,
)

P = b"p" * 32


def live(_key: bytes) -> bool:
    return True


def test_the_longest_common_prefix_is_served_newest_first_on_a_tie():
    tails = TailIndex()
    tails.add(P, b"a", [1, 2, 3, 4])
    tails.add(P, b"b", [1, 2, 9])
    assert tails.best(P, [1, 2, 3, 7, 7], live) == TailMatch(b"a", 3)
    assert tails.best(P, [1, 2, 8], live) == TailMatch(b"b", 2)  # tie: the newest
    assert tails.best(P, [5], live) is None  # nothing shared
    assert tails.best(b"other", [1, 2, 3], live) is None  # another parent


def test_a_request_shorter_than_the_tail_is_served_what_it_has():
    tails = TailIndex()
    tails.add(P, b"a", list(range(100)))
    assert tails.best(P, list(range(7)), live) == TailMatch(b"a", 7)


def test_tails_not_loadable_are_skipped():
    tails = TailIndex()
    tails.add(P, b"a", [1, 2, 3, 4])
    tails.add(P, b"b", [1, 2])
    assert tails.best(P, [1, 2, 3, 4, 5], lambda k: k != b"a") == TailMatch(b"b", 2)


def test_a_longer_tail_of_the_same_sequence_supersedes_the_shorter():
    tails = TailIndex()
    assert tails.add(P, b"turn1", [1, 2, 3]) == []
    assert tails.add(P, b"other", [1, 5]) == []
    assert tails.add(P, b"turn2", [1, 2, 3, 4, 5]) == [b"turn1"]
    assert len(tails) == 2 and b"turn1" not in tails


def test_past_the_cap_the_oldest_tail_of_a_parent_goes():
    tails = TailIndex()
    for i in range(MAX_TAILS_PER_PARENT):
        assert tails.add(P, bytes([i]), [100 + i]) == []
    assert tails.add(P, b"new", [7]) == [bytes([0])]
    assert len(tails) == MAX_TAILS_PER_PARENT


def test_prune_forgets_tails_that_left_the_cpu_tier():
    tails = TailIndex()
    tails.add(P, b"a", [1])
    tails.add(b"q" * 32, b"b", [2])
    assert tails.prune(lambda k: k == b"b") == 1
    assert tails.entries() == [(b"q" * 32, b"b", (2,))]


def test_keys_depend_on_parent_and_every_token():
    assert tail_key(P, [1, 2, 3]) == tail_key(P, (1, 2, 3))
    assert tail_key(P, [1, 2, 3]) != tail_key(P, [1, 2, 4])
    assert tail_key(P, [1, 2, 3]) != tail_key(b"q" * 32, [1, 2, 3])
    assert tail_key(P, [1, 2]) != tail_key(P, [1, 2, 0])


def _request(tokens, *, prompt=None, computed=None, **extra):
    prompt = len(tokens) if prompt is None else prompt
    return SimpleNamespace(
        all_token_ids=list(tokens), num_tokens=len(tokens), num_prompt_tokens=prompt,
        num_computed_tokens=len(tokens) - 1 if computed is None else computed,
        block_hashes=[bytes([i]) * 32 for i in range(len(tokens) // 4)], **extra)


def test_a_seed_separates_salts_and_adapters_and_refuses_multimodal_requests():
    plain = tail_seed(_request([1, 2]))
    assert plain is not None
    assert tail_seed(_request([1, 2], cache_salt="x")) != plain
    assert tail_seed(_request([1, 2], lora_request=SimpleNamespace(lora_name="a"))) != plain
    assert tail_seed(_request([1, 2], mm_features=[object()])) is None
    assert tail_seed(_request([1, 2], prompt_embeds=object())) is None
    assert tail_seed(SimpleNamespace()) is None  # no token ids


def test_a_prompt_stores_its_tokens_past_its_last_whole_chunk():
    chunk_map = ChunkMap((KVGroup("full_attention", 1, 4),), 8)  # 2 blocks a chunk
    request = _request(list(range(30)), prompt=21)  # 21 prompt tokens, then output
    table = list(range(100, 108))
    tail = tail_to_store(request, [table], chunk_map, tokens_per_hash=4)
    assert tail is not None
    assert tail.tokens == tuple(range(16, 21))  # chunk 2 starts at 16
    assert tail.parent == request.block_hashes[3]  # the key of chunk 1
    assert tail.blocks == (104, 105)  # tokens 16-19 and 20 (its block, partly)
    assert tail.key == tail_key(tail.parent, tail.tokens)
    short = _request(list(range(17)))  # the tail 16-16: one token, in one block
    tail = tail_to_store(short, [table], chunk_map, tokens_per_hash=4)
    assert tail is not None and tail.tokens == (16,) and tail.blocks == (104, SKIP_BLOCK)
    first = _request(list(range(5)))  # no whole chunk: the tail's parent is the seed
    tail = tail_to_store(first, [table], chunk_map, tokens_per_hash=4)
    assert tail is not None and tail.parent == tail_seed(first)


def test_no_tail_for_a_prompt_ending_with_a_chunk_or_with_multimodal_inputs():
    chunk_map = ChunkMap((KVGroup("full_attention", 1, 4),), 8)
    whole = _request(list(range(16)))  # two whole chunks, nothing after
    assert tail_to_store(whole, [list(range(8))], chunk_map, tokens_per_hash=4) is None
    images = _request(list(range(21)), mm_features=[object()])
    assert tail_to_store(images, [list(range(8))], chunk_map, tokens_per_hash=4) is None
