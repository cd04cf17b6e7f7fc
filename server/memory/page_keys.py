"""Keys of full KV pages: a hash chain over the adapter's content identity and the pages' tokens.

A page's K/V depend on every token before it and on the adapter (its k/v projections may carry LoRA), so a
page's key hashes its ``block_size`` tokens together with the key of the page before it, and the chain starts
from the adapter's identity (a digest of its weights and scales, or :data:`BASE_IDENTITY`). A page computed
under one adapter is never found under another, and an adapter re-uploaded with other weights has another
identity. An optional salt (e.g. a tenant id) separates callers who must not learn of each other's prompts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BASE_IDENTITY = b"base-model"
KEY_BYTES = 32


def chain_root(identity: bytes, salt: str | None = None) -> bytes:
    """Where a sequence's key chain starts: its adapter identity, and the salt when there is one."""
    h = hashlib.blake2b(b"loraplex-kv\0", digest_size=KEY_BYTES)
    h.update(len(identity).to_bytes(4, "little") + identity)
    if salt is not None:
        h.update(b"\0salt\0" + salt.encode())
    return h.digest()


def page_key(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full page holding ``tokens``, after the page whose key is ``previous`` (or the root)."""
    h = hashlib.blake2b(previous, digest_size=KEY_BYTES)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_keys(keys: list[bytes], root: bytes, token_ids: Sequence[int], num_pages: int, block_size: int) -> None:
    """Append to ``keys`` (the chain's first pages) until it holds the keys of the first ``num_pages`` pages."""
    previous = keys[-1] if keys else root
    for i in range(len(keys), num_pages):
        previous = page_key(previous, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(previous)
