"""A fake vLLM request for tests and drivers without vLLM: what kv-offload's scheduler side
reads of vLLM's ``Request`` (ids, token ids, lengths, chained block hashes), growable as a
decode step grows one.

Block hashes chain as vLLM's do (each hashes its parent and its block's tokens), over the
tokens as int64 bytes, so any token id hashes (``bytes(tokens)`` stops at 255). Needs the
standard library only: the step loop runs it where vLLM, numpy's friends and lmdb are
missing.
"""

from __future__ import annotations

import copy
import hashlib
from array import array
from collections.abc import Iterable
from typing import Any

ROOT_HASH = b"root"  # the parent of a request's first block
# Attributes of vLLM's Request that some versions have and kv-offload reads with getattr:
# a FakeRequest has one only where it was given (a missing one is an older vLLM's request).
OPTIONAL_ATTRIBUTES = frozenset({
    "skip_reading_external_kv",  # vLLM 0.34: the connector's hits are discarded
    "skip_reading_prefix_cache",  # vLLM 0.32 and 0.33: the same, by another name
    "lora_request", "cache_salt", "mm_features", "prompt_embeds",
})


def block_hash(parent: bytes, tokens: Iterable[int]) -> bytes:
    """The hash of one block: sha256 of its parent's hash and its token ids (int64)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class FakeRequest:
    """A vLLM ``Request`` as kv-offload reads it.

    ``all_token_ids`` (also ``tokens``) is the prompt, then each appended token;
    ``block_hashes`` holds one hash per whole block of ``block_size`` tokens, kept up to
    date by ``append``. ``num_prompt_tokens`` defaults to the length of ``tokens``.
    ``attributes`` sets the ``OPTIONAL_ATTRIBUTES`` given (ValueError for any other).
    The token list is the caller's no longer: the request owns it and appends to it.
    """

    def __init__(self, request_id: str, tokens: Iterable[int], *, block_size: int,
                 num_prompt_tokens: int | None = None, **attributes: Any) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        unknown = set(attributes) - OPTIONAL_ATTRIBUTES
        if unknown:
            raise ValueError(f"not attributes of vLLM's Request: {sorted(unknown)}")
        self.request_id = request_id
        self.block_size = block_size
        self.all_token_ids: list[int] = list(tokens)
        self.num_prompt_tokens = (len(self.all_token_ids) if num_prompt_tokens is None
                                  else num_prompt_tokens)
        self.block_hashes: list[bytes] = []
        for name, value in attributes.items():
            setattr(self, name, value)
        self.rehash()

    @property
    def tokens(self) -> list[int]:
        """The token ids (``all_token_ids``)."""
        return self.all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append(self, *tokens: int) -> None:
        """Append ``tokens`` (a decode step) and hash the blocks they complete."""
        self.all_token_ids.extend(tokens)
        self.rehash()

    def rehash(self) -> None:
        """Hash every whole block not hashed yet (after ``all_token_ids`` grew)."""
        size = self.block_size
        while len(self.block_hashes) < len(self.all_token_ids) // size:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            tokens = self.all_token_ids[i * size:(i + 1) * size]
            self.block_hashes.append(block_hash(parent, tokens))

    def with_attributes(self, **attributes: Any) -> FakeRequest:
        """A copy with ``attributes`` (``OPTIONAL_ATTRIBUTES``) set; its lists are copies."""
        unknown = set(attributes) - OPTIONAL_ATTRIBUTES
        if unknown:
            raise ValueError(f"not attributes of vLLM's Request: {sorted(unknown)}")
        out = copy.copy(self)
        out.all_token_ids, out.block_hashes = list(self.all_token_ids), list(self.block_hashes)
        for name, value in attributes.items():
            setattr(out, name, value)
        return out

    def __repr__(self) -> str:
        return (f"FakeRequest({self.request_id!r}, {self.num_tokens} tokens, "
                f"{len(self.block_hashes)} blocks)")
