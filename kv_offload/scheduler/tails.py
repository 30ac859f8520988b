"""Request tails: the tokens of a request past its last whole chunk, served again.

A chunk key names a whole chunk (``keys.py``). What a request computed past its last
chunk boundary B, up to its last computed token, is its *tail*: stored when the request
finishes, in a CPU slot of its own (the positions past the tail's last block untouched),
under a *tail key*. vLLM's block hashes cover full blocks only, so a tail is found
another way: by its *parent* (the key of the chunk that ends at B, chained over every
token, salt and LoRA before it; for B = 0 a seed from the request's ``cache_salt`` and
LoRA) and its token ids. A later request whose whole-chunk hit reaches B is served the
longest common prefix of its next tokens and a stored tail of that parent: the KV of a
token depends only on the tokens up to it, so any common prefix is right, whatever
followed it in the request that stored the tail.

``TailIndex`` keeps, per parent, the tails stored under it (key, tokens), newest last,
at most ``MAX_TAILS_PER_PARENT``; a new tail that extends an older one (the next turn of
a conversation) supersedes it. Entries whose slot the CPU tier evicted are dropped as
they are met (``is_live``). Requests whose token ids do not determine their KV
(multimodal inputs, prompt embeddings) have no tails (``tail_seed``).

Pure: no vLLM, no torch. Scheduler thread only.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kv_offload.groups import ChunkMap
from kv_offload.keys import ChunkKey, chunk_keys

MAX_TAILS_PER_PARENT = 8
"""Tails kept per parent: conversations that share a system prompt each store theirs
under the same parent. Past the cap the oldest is dropped (its slot is discarded)."""

_TAG = b"kv-offload tail v1\0"


class TailMatch(NamedTuple):
    key: ChunkKey
    num_tokens: int  # tokens of the tail that the request shares (>= 1)


def tail_seed(request: Any) -> bytes | None:
    """The parent of a tail that starts at token 0: the request's ``cache_salt`` and
    LoRA adapter (name and path), which vLLM hashes into a request's first block. None
    when the request's token ids do not determine its KV (multimodal inputs, prompt
    embeddings) or it has no token ids: such a request neither stores nor loads tails."""
    if getattr(request, "all_token_ids", None) is None:
        return None
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    if lora is None:
        return hashlib.sha256(_TAG + repr((salt, None)).encode()).digest()
    # vLLM hashes the adapter's path with its name (a name re-pointed at another adapter
    # shares no KV); the path is hashed here even where a vLLM hashes the name only.
    adapter = (getattr(lora, "lora_name", None), getattr(lora, "lora_path", None))
    return hashlib.sha256(_TAG + repr((salt, *adapter)).encode()).digest()


def tail_key(parent: bytes, tokens: Sequence[int]) -> ChunkKey:
    """A tail's key: SHA-256 over the parent and the token ids, tagged so that it never
    equals one of vLLM's block hashes. Reproducible across processes (no
    ``PYTHONHASHSEED``), as keys of persistent tiers must be."""
    digest = hashlib.sha256(_TAG + parent)
    digest.update(len(tokens).to_bytes(4, "little"))
    digest.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    return digest.digest()


class TailStore(NamedTuple):
    """A finishing request's tail to store: under ``parent``, ``tokens`` (their KV in
    the engine ``blocks``, ``SKIP_BLOCK`` past its last one), as ``key``."""

    parent: bytes
    key: ChunkKey
    tokens: tuple[int, ...]
    blocks: tuple[int, ...]


def tail_to_store(request: Any, tables: Sequence[Sequence[int]], chunk_map: ChunkMap, *,
                  tokens_per_hash: int) -> TailStore | None:
    """The tail of a request's prompt, once computed: the prompt's tokens past its last
    whole chunk, read from ``tables`` (vLLM's blocks of the running request) after the
    forward that computed them, like a chunk. The last block may be only partly the
    prompt's: the slots past it are copied too, but no load reports them (a decode step
    may write them while the copy runs). None when the prompt ends with a whole chunk
    and for a request without tails (``tail_seed``)."""
    limit = request.num_prompt_tokens
    chunk = chunk_map.chunk_tokens
    start = limit // chunk * chunk
    seed = tail_seed(request)
    if limit <= start or seed is None:
        return None
    keys = chunk_keys(request.block_hashes, tokens_per_hash=tokens_per_hash,
                      chunk_tokens=chunk, max_tokens=start)
    if len(keys) < start // chunk:
        return None
    tokens = tuple(int(t) for t in request.all_token_ids[start:limit])
    parent = keys[-1] if keys else seed
    blocks = chunk_map.store_blocks(tables, start // chunk, end=limit)
    if blocks is None:
        return None
    return TailStore(parent, tail_key(parent, tokens), tokens, blocks)


def offer_tail(tails: TailIndex, cpu: Any, request: Any, tables: Sequence[Sequence[int]],
               chunk_map: ChunkMap, *, tokens_per_hash: int) -> TailStore | None:
    """The request's tail (``tail_to_store``) to store, listed in ``tails``; None when
    there is none or the CPU tier (``cpu``, a ``CpuIndex``) holds it already (then it is
    touched). The tails it supersedes are discarded from the CPU tier (a pinned one at
    its last unpin); evicted tails are forgotten once they outnumber the slots."""
    tail = tail_to_store(request, tables, chunk_map, tokens_per_hash=tokens_per_hash)
    if tail is None or tail.key in cpu:
        cpu.touch([tail.key] if tail is not None else [])
        return None
    for superseded in tails.add(tail.parent, tail.key, tail.tokens):
        cpu.discard(superseded)
    if len(tails) > 2 * cpu.num_slots:
        tails.prune(cpu.__contains__)
    return tail


def longest_shared(tails: Sequence[tuple[ChunkKey, Sequence[int]]], tokens: Sequence[int]
                   ) -> TailMatch | None:
    """Of ``tails`` (key, token ids), the one that shares the longest prefix with
    ``tokens`` (at least one token); the last on a tie."""
    best: TailMatch | None = None
    for key, tail in tails:
        shared = len(os.path.commonprefix([tuple(tail), tuple(tokens[:len(tail)])]))
        if shared and (best is None or shared >= best.num_tokens):
            best = TailMatch(key, shared)
    return best


class _Tail(NamedTuple):
    key: ChunkKey
    tokens: tuple[int, ...]


class TailIndex:
    """Per parent key, the tails stored under it (see the module docstring)."""

    def __init__(self, max_per_parent: int = MAX_TAILS_PER_PARENT) -> None:
        self.max_per_parent = max_per_parent
        self._by_parent: dict[bytes, list[_Tail]] = {}
        self._parent_of: dict[ChunkKey, bytes] = {}

    def __len__(self) -> int:
        return len(self._parent_of)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._parent_of

    def add(self, parent: bytes, key: ChunkKey, tokens: Sequence[int]) -> list[ChunkKey]:
        """Record a tail (its slot was just reserved). Returns the keys it supersedes:
        older tails of the parent whose tokens it extends, and the oldest beyond the cap;
        the caller discards their slots."""
        tails = self._by_parent.setdefault(parent, [])
        new = _Tail(key, tuple(int(t) for t in tokens))
        dropped = [t for t in tails if t.key != key and new.tokens[:len(t.tokens)] == t.tokens]
        tails[:] = [t for t in tails if t.key != key and t not in dropped] + [new]
        while len(tails) > self.max_per_parent:
            dropped.append(tails.pop(0))
        for tail in dropped:
            self._parent_of.pop(tail.key, None)
        self._parent_of[key] = parent
        return [t.key for t in dropped]

    def best(self, parent: bytes, tokens: Sequence[int],
             is_live: Callable[[ChunkKey], bool]) -> TailMatch | None:
        """The tail of ``parent`` that shares the longest prefix with ``tokens`` (at least
        one token), among those ``is_live`` (loadable now); the newest on a tie. Tails no
        longer in the CPU index (``is_live`` false and not stored) are forgotten."""
        return longest_shared([t for t in self._by_parent.get(parent, ()) if is_live(t.key)],
                              tokens)

    def forget(self, keys: Sequence[ChunkKey] | set[ChunkKey]) -> None:
        """Drop these tails (their slots were evicted or discarded)."""
        for key in keys:
            parent = self._parent_of.pop(key, None)
            if parent is None:
                continue
            tails = [t for t in self._by_parent.get(parent, ()) if t.key != key]
            if tails:
                self._by_parent[parent] = tails
            else:
                self._by_parent.pop(parent, None)

    def prune(self, is_present: Callable[[ChunkKey], bool]) -> int:
        """Forget every tail whose entry left the CPU index; returns how many."""
        gone = [key for key in self._parent_of if not is_present(key)]
        self.forget(gone)
        return len(gone)

    def entries(self) -> list[tuple[bytes, ChunkKey, tuple[int, ...]]]:
        """(parent, key, tokens) of every tail (for checks and ``inspect``)."""
        return [(parent, tail.key, tail.tokens)
                for parent, tails in self._by_parent.items() for tail in tails]
