"""The identities boards and the daemon compare: which model, which data set.

``Hello`` reports both and ``SelectDataset`` names the data set by them (SPEC sections
3 and 5): a 64-bit value, the first 8 bytes of a SHA-256 digest read little-endian.
"""

from __future__ import annotations

import hashlib

__all__ = ["dataset_hash64", "model_hash64"]


def _hash64(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little")


def model_hash64(blob: bytes) -> int:
    """A model blob's identity: SHA-256 of the blob, first 8 bytes, little-endian.

    Args:
        blob: the model blob ``LoadModel`` carries.

    Returns:
        The 64-bit hash (0 is never a valid blob's; boards report 0 for no model).
    """
    return _hash64(hashlib.sha256(blob).digest())


def dataset_hash64(content_hash: str) -> int:
    """A data set's identity: its SHA-256 content hash (hex), first 8 bytes, little-endian.

    Args:
        content_hash: the data set's ``content_hash`` (64 hex digits).

    Returns:
        The 64-bit hash.
    """
    return _hash64(bytes.fromhex(content_hash))
