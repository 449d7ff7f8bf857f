"""How a run cuts an epoch into loader windows (pure logic).

A window (``window_blocks`` blocks of the file's ``block_samples`` rows) is
both the loader's shuffle buffer and, under dynamic shares, the chunk a
worker draws from the shared counter. The training run and the simulator
size it by the same rule, so a simulated run draws what a real one does.
"""

from __future__ import annotations

__all__ = ["window_blocks_for", "window_samples_for"]


def window_blocks_for(length: int, block_samples: int, workers: int) -> int:
    """Blocks per loader window for a fresh run of ``workers`` workers.

    Windows (the shuffle buffer and the dynamic chunk) of up to 8 blocks,
    but at least 8 windows per worker and epoch so that shares can balance.
    A resumed run keeps its checkpoint's value instead: the epoch's sample
    order, which saved positions refer to, depends on it.
    """
    blocks = -(-length // block_samples)
    return max(1, min(8, blocks // (8 * workers)))


def window_samples_for(length: int, block_samples: int, workers: int) -> int:
    """Samples of a full window (a dynamic chunk) for a fresh run."""
    return window_blocks_for(length, block_samples, workers) * block_samples
