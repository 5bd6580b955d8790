"""Chained hashes of full pages: a page's hash covers every token before it."""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = b"batchgen-root"


def hash_page(parent: bytes, tokens: list[int]) -> bytes:
    """Hash of a full page given its parent's hash (ROOT_HASH for the first page)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def hash_full_pages(
    token_ids: list[int], page_size: int, known: list[bytes] | None = None
) -> list[bytes]:
    """Hashes of every full page of token_ids, extending the already known prefix (the
    same digests as hash_page, chained; the new pages' tokens are packed once)."""
    hashes = list(known or [])
    start = len(hashes) * page_size
    end = len(token_ids) // page_size * page_size
    if end <= start:
        return hashes
    data = memoryview(array("q", token_ids[start:end]).tobytes())
    step = 8 * page_size
    parent = hashes[-1] if hashes else ROOT_HASH
    blake2b = hashlib.blake2b
    for offset in range(0, len(data), step):
        h = blake2b(parent, digest_size=16)
        h.update(data[offset : offset + step])
        parent = h.digest()
        hashes.append(parent)
    return hashes
