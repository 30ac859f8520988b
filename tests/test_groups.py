"""Which engine blocks of each KV cache group make up a stored chunk (``groups.py``).

The rule is proven against vLLM 0.32's allocation of a loaded request's sliding-window
blocks (``SlidingWindowManager``: the blocks before token T - W + 1 of a hit of T tokens
are its null block, the rest are real and must hold the right KV): for windows shorter
than, equal to and longer than a chunk, every real block a load gets is written from a
stored chunk, exactly once, and nothing else is. A mamba group ("align" mode) stores one
block, the state handed over for the chunk's end, and a load writes it only into the last
entry of the table vLLM allocates for the hit (``MambaManager.allocate_new_blocks``: null
blocks, then one real block for the state at the hit's end).
"""

import pytest

from kv_offload.groups import NULL_BLOCK, ChunkMap, KVGroup, UnservableChunkError
from kv_offload.jobs import SKIP_BLOCK

BS, CHUNK = 16, 64  # 4 blocks a chunk


def _sw(window: int) -> KVGroup:
    return KVGroup("sliding_window", 2, BS, window)


def _vllm_window_table(first_id: int, total_tokens: int, window: int) -> list[int]:
    """A loaded request's sliding-window table as vLLM allocates it for a hit of
    ``total_tokens``: null below the window of the next token, fresh blocks above."""
    skipped = max(0, total_tokens - window + 1) // BS
    return [NULL_BLOCK] * skipped + list(range(first_id, first_id + total_tokens // BS - skipped))


@pytest.mark.parametrize("window", [2, 17, 33, 48, 64, 65, 66, 100, 129, 200, 4096])
@pytest.mark.parametrize(("chunks", "local"), [(c, n) for c in (1, 2, 5) for n in (0, 16, 64, 96)
                                               if n < c * CHUNK])
def test_a_load_writes_every_block_vllm_allocates_and_only_those(window, local, chunks):
    cmap = ChunkMap((KVGroup("full_attention", 2, BS), _sw(window)), CHUNK)
    total = chunks * CHUNK
    full = list(range(1000, 1000 + total // BS))
    sliding = _vllm_window_table(2000, total, window)
    written: list[int] = []
    for c in range(local // CHUNK, chunks):
        row = cmap.load_blocks((full, sliding), c, skip_before=local)
        assert len(row) == cmap.positions
        written += [b for b in row if b != SKIP_BLOCK]
    expect = [b for i, b in enumerate(full) if i * BS >= local]
    expect += [b for i, b in enumerate(sliding) if i * BS >= local and b != NULL_BLOCK]
    assert sorted(written) == sorted(expect), "a real block left unwritten or one written twice"


@pytest.mark.parametrize("window,stored", [(17, 1), (64, 4), (65, 4), (66, 4), (129, 4),
                                           (33, 2), (49, 3)])
def test_a_window_group_stores_only_the_chunk_tail(window, stored):
    assert _sw(window).stored_blocks(CHUNK) == stored
    cmap = ChunkMap((KVGroup("full_attention", 2, BS), _sw(window)), CHUNK)
    full, sliding = list(range(10, 18)), list(range(20, 28))
    assert cmap.store_blocks((full, sliding), 1) == (14, 15, 16, 17, *sliding[8 - stored:])
    assert cmap.released_positions == tuple((p, 1) for p in range(4, 4 + stored))


def test_a_chunk_whose_window_block_was_freed_is_not_stored():
    cmap = ChunkMap((KVGroup("full_attention", 2, BS), _sw(33)), CHUNK)
    full = list(range(10, 18))
    sliding = [NULL_BLOCK] * 6 + [26, 27]  # chunk 1's tail is blocks 6 and 7: there
    assert cmap.store_blocks((full, sliding), 1) is not None
    sliding[6] = NULL_BLOCK  # freed before the store was planned
    assert cmap.store_blocks((full, sliding), 1) is None
    assert cmap.store_blocks((full, sliding[:6]), 1) is None, "past the table"


def test_a_load_into_a_block_no_chunk_holds_is_refused():
    cmap = ChunkMap((KVGroup("full_attention", 2, BS), _sw(17)), CHUNK)
    full = list(range(10, 14))
    with pytest.raises(UnservableChunkError, match="no stored chunk holds"):
        cmap.load_blocks((full, [20, 21, 22, 23]), 0, skip_before=0)
    assert cmap.load_blocks((full, [20, 21, 22, 23]), 0, skip_before=48) == (
        SKIP_BLOCK, SKIP_BLOCK, SKIP_BLOCK, 13, 23), "blocks computed already are skipped"


def test_one_full_group_keeps_the_layout_of_stores_made_before_groups():
    cmap = ChunkMap((KVGroup("full_attention", 4, BS),), CHUNK)
    assert cmap.positions == 4 and not cmap.hybrid and cmap.released_positions == ()
    table = [0, 1, 2, 3, 4, 5, 6, 7]  # block 0 is an ordinary block of a full group
    assert cmap.store_blocks((table,), 0) == (0, 1, 2, 3)
    assert cmap.load_blocks((table,), 1, skip_before=80) == (SKIP_BLOCK, 5, 6, 7)


def test_groups_validate_their_fields():
    with pytest.raises(ValueError, match="window"):
        KVGroup("sliding_window", 1, BS)
    with pytest.raises(ValueError, match="kind"):
        KVGroup("linear", 1, BS)
    with pytest.raises(ValueError, match="state layout"):
        KVGroup("mamba", 1, BS)
    with pytest.raises(ValueError, match="state layout"):
        KVGroup("full_attention", 1, BS, state="ssm(4,4)float32")
    with pytest.raises(ValueError, match="multiple"):
        ChunkMap((KVGroup("full_attention", 1, 48),), CHUNK)
    with pytest.raises(ValueError, match="tables"):
        ChunkMap((KVGroup("full_attention", 1, BS),), CHUNK).store_blocks(([1], [2]), 0)


MAMBA = KVGroup("mamba", 2, BS, state="conv(3,8)float32+ssm(2,4,4)float32")


def _vllm_mamba_table(total_tokens: int, local: int, *, state_id: int, local_id: int
                      ) -> list[int]:
    """A loaded request's mamba table as vLLM's align mode allocates it for a hit of
    ``total_tokens`` after a local hit of ``local``: the local hit's state block at its
    boundary, null blocks, and one real block at the end for the loaded state."""
    table = [NULL_BLOCK] * (total_tokens // BS)
    if local:
        table[local // BS - 1] = local_id
    table[-1] = state_id
    return table


@pytest.mark.parametrize(("chunks", "local"), [(c, n) for c in (1, 2, 5) for n in (0, 16, 64, 96)
                                               if n < c * CHUNK])
def test_a_load_writes_the_state_only_into_the_block_vllm_allocated_for_its_end(chunks, local):
    cmap = ChunkMap((KVGroup("full_attention", 2, BS), MAMBA), CHUNK)
    total = chunks * CHUNK
    full = list(range(1000, 1000 + total // BS))
    mamba = _vllm_mamba_table(total, local, state_id=77, local_id=55)
    rows = [cmap.load_blocks((full, mamba), c, skip_before=local, ends_load=c == chunks - 1)
            for c in range(local // CHUNK, chunks)]
    assert all(len(row) == cmap.positions == 5 for row in rows)
    states = [row[-1] for row in rows]
    assert states == [SKIP_BLOCK] * (len(rows) - 1) + [77], "the state of the load's end only"
    written = [b for row in rows for b in row[:-1] if b != SKIP_BLOCK]
    assert written == [b for i, b in enumerate(full) if i * BS >= local]


def test_a_state_block_the_load_would_leave_unwritten_fails_the_chunk():
    cmap = ChunkMap((KVGroup("full_attention", 2, BS), MAMBA), CHUNK)
    full = list(range(10, 18))
    mamba = _vllm_mamba_table(2 * CHUNK, 0, state_id=77, local_id=0)
    with pytest.raises(UnservableChunkError, match="no block for the state"):
        cmap.load_blocks((full, mamba), 0, skip_before=0, ends_load=True)  # ends at 64
    with pytest.raises(UnservableChunkError, match="no stored state fills"):
        cmap.load_blocks((full, mamba), 1, skip_before=0, ends_load=False)
    assert cmap.load_blocks((full, mamba), 1, skip_before=0, ends_load=True)[-1] == 77


def test_a_chunk_is_stored_only_with_the_state_handed_over_for_its_end():
    cmap = ChunkMap((KVGroup("full_attention", 2, BS), MAMBA), CHUNK)
    assert cmap.state_groups == (1,) and cmap.hybrid
    full = list(range(10, 18))
    mamba = [NULL_BLOCK] * 3 + [40] + [NULL_BLOCK] * 3 + [41]
    assert cmap.store_blocks((full, mamba), 0) is None, "no hand-off: not stored"
    assert cmap.store_blocks((full, mamba), 0, {1: 41}) is None, "another boundary's state"
    assert cmap.store_blocks((full, mamba), 0, {1: 40}) == (10, 11, 12, 13, 40)
    assert cmap.store_blocks((full, mamba), 1, {1: 41}) == (14, 15, 16, 17, 41)
    mamba[7] = NULL_BLOCK  # vLLM freed it before the store was planned
    assert cmap.store_blocks((full, mamba), 1, {1: 41}) is None
    assert cmap.released_positions == ((4, 1),), "the fence watches the state block"


def test_the_namespace_names_a_mamba_group_with_its_state_layout_and_no_other_group_changes():
    from kv_offload.layout import KVLayout

    def layout(*groups: KVGroup) -> KVLayout:
        return KVLayout(model="m", model_fingerprint="f", dtype="float32",
                        kv_cache_dtype="auto", attention="full_attention", num_layers=4,
                        page_bytes=256, block_size=BS, tokens_per_hash=BS,
                        chunk_tokens=CHUNK, tp_size=1, pp_size=1, hash_algo="sha256",
                        groups=groups)

    full = KVGroup("full_attention", 2, BS)
    sliding = layout(full, _sw(33)).descriptor()["groups"]
    assert all("state" not in g for g in sliding), "pre-mamba namespaces keep their names"
    other = KVGroup("mamba", 2, BS, state="conv(3,8)float32+ssm(2,4,8)float32")
    assert layout(full, MAMBA).fingerprint() != layout(full, other).fingerprint()
    assert layout(full, MAMBA).descriptor()["groups"][1]["state"] == MAMBA.state
