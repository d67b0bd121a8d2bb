"""Named random streams: every posterior draw comes from a generator seeded by what it is for."""

from __future__ import annotations

import hashlib
import numbers

import torch

__all__ = ["StreamGenerators", "derived_seed", "process_rank", "resolve_seed"]


def resolve_seed(seed: int | None) -> int:
    """``seed`` as an int; ``None`` takes one from torch's global RNG, so ``torch.manual_seed``
    reproduces it. Anything but an integer is refused: ``int(1.7)`` would be seed 1, silently."""
    if seed is None:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer (or None); got {seed!r}")
    return int(seed)


def derived_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed for the stream named by ``labels`` (rank, block, parameter name, ...):
    streams are independent of each other and of how many other streams were drawn."""
    text = "\x00".join(str(x) for x in (int(seed), *labels))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def process_rank() -> int:
    """This process's rank in the default process group (0 outside one): each rank draws its own noise."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class StreamGenerators:
    """One ``torch.Generator`` per device, reseeded only when the stream it serves changes.

    EVON makes one for each ``sampled_params`` block: a block's draws start at its stream's seed
    also where its label is one an earlier block drew from (a state loaded into the optimizer that
    drew past it: a resume on the trainer that trained)."""

    def __init__(self) -> None:
        self._seeded: dict[torch.device, tuple[tuple, torch.Generator]] = {}

    def get(self, device: torch.device, *stream: object) -> torch.Generator:
        """The generator of ``stream`` (e.g. seed, rank, block, device) on ``device``."""
        seeded, gen = self._seeded.get(device, (None, None))
        if gen is None:
            gen = torch.Generator(device=device)
        if seeded != stream:
            gen.manual_seed(derived_seed(*stream))
            self._seeded[device] = (stream, gen)
        return gen
