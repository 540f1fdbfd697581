"""Seeds derived from names and numbers, the same on every machine and in every process."""
from __future__ import annotations

import hashlib
from typing import Any


def derive_seed(*parts: Any) -> int:
    """A stable 32-bit seed from any printable parts (not Python's salted hash)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "big")


def restore_random(draws, state) -> None:
    """Put a `random.Random` back in the state `draws.getstate()` gave, after a checkpoint's round trip (which may turn
    the state's inner tuple into a list: `setstate` takes only the tuple)."""
    version, internal, gauss = state
    draws.setstate((version, tuple(internal), gauss))
