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
    """Hashes of every full page of token_ids, extending the already known prefix."""
    hashes = list(known or [])
    for start in range(len(hashes) * page_size, len(token_ids) - page_size + 1, page_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_page(parent, token_ids[start : start + page_size]))
    return hashes
