"""KVLayout: what one chunk of KV looks like on one rank, and the namespace it names.

Pure values: no vLLM, no torch. The fingerprint covers everything that makes stored
bytes unusable for another engine (invariant 4): model identity, dtypes, per-layer
page bytes, block/chunk/hash geometry, tensor-parallel size and the hash algorithm.
The physical byte order inside a block (``page_order``) is part of it too: vLLM lays a
block out per attention backend (heads before tokens, or tokens before heads, split into
kernel blocks or not), and two engines whose blocks hold the same tokens in another
order must never share chunks. The rank is not part of it: all ranks share one index,
and each rank's bytes live in its own slab file (``rank<r>-of-<n>.slab``) and remote
key, so ranks never read each other's data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kv_offload.config import OffloadConfig, format_size
from kv_offload.groups import ChunkMap, KVGroup

LAYOUT_VERSION = 3
"""Version of the descriptor below; a new field that changes namespaces bumps it."""
SLOT_FORMAT_VERSION = 1
"""Version of how a chunk is laid out in a host slot, a slab slot and a remote value
(layer after layer, each layer's block pages in order, pages as the engine holds them)."""
PAGE_DIMS = {"H": "heads", "N": "tokens", "C": "content bytes", "S": "kernel blocks"}
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
    page_order: str = ""  # byte order inside one block of one layer, see page_order()
    kernel_format: str = ""  # platform, backend, fp8 type, CPU ISA: engine_info._kernel_format
    groups: tuple[KVGroup, ...] = ()
    """The KV cache groups of a hybrid engine (vLLM's hybrid KV cache manager on), in
    vLLM's order; empty for one full-attention or MLA group (the namespace of such an
    engine is what it was before groups existed). ``num_layers`` then counts the engine's
    KV tensors, which the layers of all groups share."""

    @property
    def chunk_map(self) -> ChunkMap:
        """Which engine blocks of each group make up a stored chunk (``groups.py``)."""
        groups = self.groups or (KVGroup(self.attention, self.num_layers, self.block_size),)
        return ChunkMap(groups, self.chunk_tokens)

    @property
    def blocks_per_chunk(self) -> int:
        """Engine blocks of one chunk in a slot, every group together (a copy engine's
        ``blocks_per_chunk``)."""
        if not self.groups:
            return self.chunk_tokens // self.block_size
        return self.chunk_map.positions

    @property
    def slot_bytes(self) -> int:
        """Bytes of one chunk on one rank: every KV tensor's pages of its blocks."""
        return self.num_layers * self.page_bytes * self.blocks_per_chunk

    def descriptor(self) -> dict:
        """Readable JSON-serialisable description (stored with the namespace)."""
        fields = asdict(self)
        if not self.groups:
            del fields["groups"]  # single-group namespaces predate the field
        for group in fields.get("groups", ()):
            if not group["state"]:
                del group["state"]  # only mamba groups have one: others predate it
        return {"layout_version": LAYOUT_VERSION, "slot_format": SLOT_FORMAT_VERSION,
                **fields}

    def fingerprint(self) -> str:
        """Namespace id: 32 hex chars of sha256 over the canonical descriptor."""
        text = json.dumps(self.descriptor(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def hashes_reproducible(self, python_hash_seed: str | None) -> bool:
        """Whether vLLM's block hashes of this engine match across processes (invariant 8)."""
        return self.hash_algo not in NON_REPRODUCIBLE_HASH_ALGOS or python_hash_seed is not None


def num_cpu_slots(config: OffloadConfig, layout: KVLayout) -> int:
    """CPU-tier slots per rank; ValueError naming ``cpu_size`` when not even one fits."""
    slots = config.cpu_bytes // layout.slot_bytes
    if slots < 1:
        raise ValueError(
            f"cpu_size: {format_size(config.cpu_bytes)} holds no chunk of this model "
            f"({format_size(layout.slot_bytes)} per chunk of {layout.chunk_tokens} tokens); "
            f"raise cpu_size or lower chunk_tokens"
        )
    return slots


def page_order(dims: Sequence[tuple[str, int]]) -> str:
    """Canonical name of the byte order inside one block's page of one layer.

    ``dims``: the page's dims from the outermost to the innermost in memory, each a
    (name, size) with the names of ``PAGE_DIMS``: "H" heads, "N" tokens, "C" content
    bytes (a token's K and V of one head), "S" kernel blocks (vLLM split the block into
    S kernel blocks; S is the outer part of the token index). Two pages with the same
    name hold every byte at the same offset: dims of size 1 move no byte and are dropped,
    and an "S" directly outside "N" is one token dim (token = s * n_kernel + n). Example:
    ``[("H", 8), ("N", 16), ("C", 256)]`` -> ``"H8.N16.C256"``. Pure.
    """
    kept = [(name, int(size)) for name, size in dims if int(size) != 1]
    for name, size in kept:
        if name not in PAGE_DIMS or size < 1:
            raise ValueError(f"bad page dim {name}{size}; dims are {', '.join(PAGE_DIMS)}")
    merged: list[tuple[str, int]] = []
    for name, size in kept:
        if name == "N" and merged and merged[-1][0] == "S":
            size *= merged.pop()[1]
        merged.append((name, size))
    return ".".join(f"{name}{size}" for name, size in merged)
