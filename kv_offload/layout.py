"""KVLayout: what one chunk of KV looks like on one rank, and the namespace it names.

Pure values: no vLLM, no torch. The fingerprint covers everything that makes stored
bytes unusable for another engine (invariant 4): model identity, dtypes, per-layer
page bytes, block/chunk/hash geometry, tensor-parallel size and the hash algorithm.
The rank is not part of it: all ranks share one index, and each rank's bytes live in
its own slab file (``rank<r>-of-<n>.slab``), so ranks never read each other's data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

LAYOUT_VERSION = 1
NON_REPRODUCIBLE_HASH_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry and identity of the KV cache of one engine, per rank."""

    model: str
    model_fingerprint: str  # hash of the model's config (architecture and sizes)
    dtype: str
    kv_cache_dtype: str
    attention: str  # e.g. "full_attention", "mla_attention"
    num_layers: int
    page_bytes: int  # bytes of one block of one layer on one rank
    block_size: int
    tokens_per_hash: int
    chunk_tokens: int
    tp_size: int
    pp_size: int
    hash_algo: str
    salt: str = ""

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def slot_bytes(self) -> int:
        """Bytes of one chunk on one rank: every layer's pages of its blocks."""
        return self.num_layers * self.page_bytes * self.blocks_per_chunk

    def descriptor(self) -> dict:
        """Readable JSON-serialisable description (stored with the namespace)."""
        return {"layout_version": LAYOUT_VERSION, **asdict(self)}

    def fingerprint(self) -> str:
        """Namespace id: 32 hex chars of sha256 over the canonical descriptor."""
        text = json.dumps(self.descriptor(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def hashes_reproducible(self, python_hash_seed: str | None) -> bool:
        """Whether vLLM's block hashes of this engine match across processes (invariant 8)."""
        return self.hash_algo not in NON_REPRODUCIBLE_HASH_ALGOS or python_hash_seed is not None
