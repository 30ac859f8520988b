"""Chunk keys: which of vLLM's chained block hashes names each chunk of a request."""

from __future__ import annotations

from collections.abc import Sequence

ChunkKey = bytes
"""The vLLM block hash of a chunk's last block. Hashes are chained, so it names the
whole prefix up to the end of the chunk (tokens, cache_salt, LoRA, multimodal)."""


def chunk_keys(
    block_hashes: Sequence[bytes],
    *,
    tokens_per_hash: int,
    chunk_tokens: int,
    max_tokens: int | None = None,
) -> list[ChunkKey]:
    """Keys of the full chunks covered by ``block_hashes`` (and by ``max_tokens``).

    Pure: reads nothing but its arguments. ``chunk_tokens`` must be a multiple of
    ``tokens_per_hash``. Chunk ``i`` covers tokens ``[i*chunk_tokens, (i+1)*chunk_tokens)``.
    """
    hashes_per_chunk = chunk_tokens // tokens_per_hash
    num_tokens = len(block_hashes) * tokens_per_hash
    if max_tokens is not None:
        num_tokens = min(num_tokens, max_tokens)
    num_chunks = num_tokens // chunk_tokens
    return [bytes(block_hashes[(i + 1) * hashes_per_chunk - 1]) for i in range(num_chunks)]
