"""Named random streams: every posterior draw comes from a generator seeded by what it is for."""

from __future__ import annotations

import hashlib

__all__ = ["derived_seed"]


def derived_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed for the stream named by ``labels`` (rank, block, parameter name, ...):
    streams are independent of each other and of how many other streams were drawn."""
    text = "\x00".join(str(x) for x in (int(seed), *labels))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & (2**63 - 1)
