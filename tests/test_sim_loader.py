"""hybridagg.sim.loader: the simulated draws of dynamic shares, against the
training loader's own."""

from __future__ import annotations

import threading
import time

import pytest

from hybridagg.data.shares import LocalCounter
from hybridagg.sim.job import LOADER_CLAIM_AHEAD, LOADER_WINDOWS_AHEAD
from hybridagg.sim.loader import Chunks, WorkerLoader


def model_draws(samples: int, chunk: int, batch: int, steps: int) -> list[int]:
    """Chunks drawn after each of ``steps`` batches, by the model."""
    chunks = Chunks(1, samples, chunk)
    loader = WorkerLoader(chunks, batch, LOADER_CLAIM_AHEAD, LOADER_WINDOWS_AHEAD)
    out = []
    for _ in range(steps):
        assert loader.next_batch() == batch
        out.append(chunks.drawn)
    return out


class _Spy(LocalCounter):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.lock = threading.Lock()

    def fetch_add(self) -> int:
        with self.lock:
            self.count += 1
        return super().fetch_add()


def loader_draws(path, window_blocks: int, batch: int, steps: int) -> list[int]:
    """Chunks the training loader has drawn after each of ``steps`` batches,
    once its read-ahead threads stand still (their queues full)."""
    from hybridagg.data import HDF5Loader

    spy = _Spy()
    loader = HDF5Loader(
        path, batch_size=batch, shares="dynamic", chunk_counter=spy,
        window_blocks=window_blocks,
    )  # fmt: skip
    assert loader.threaded
    out = []
    try:
        batches = iter(loader)
        for _ in range(steps):
            next(batches)
            deadline, seen = time.monotonic() + 10.0, -1
            while time.monotonic() < deadline:  # settled: no draw for 0.2 s
                with spy.lock:
                    now = spy.count
                if now == seen:
                    break
                seen = now
                time.sleep(0.2)
            out.append(seen)
    finally:
        loader.close()
    return out


@pytest.mark.parametrize("window_blocks", [2, 8])
def test_the_model_draws_what_the_training_loader_draws(digits_file, window_blocks):
    # digits: blocks of 16 rows; windows of 2 blocks are one batch of 32,
    # of 8 blocks four batches (a fast worker's loader, never waiting)
    real = loader_draws(digits_file, window_blocks, 32, 12)
    chunk = 16 * window_blocks
    assert model_draws(1438, chunk, 32, 12) == real
    if window_blocks == 2:  # one batch computed, 5 cut, 3 windows drawn ahead
        assert real[0] == 1 + LOADER_CLAIM_AHEAD + LOADER_WINDOWS_AHEAD


@pytest.fixture(scope="module")
def digits_file(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("digits") / "digits.h5"
    convert_digits(path)
    return path


def test_a_pass_cuts_across_chunks_and_ends_with_the_rest():
    chunks = Chunks(1, 70, 32)  # windows of 32, 32 and 6
    loader = WorkerLoader(chunks, 24, 0, 0)
    assert [loader.next_batch() for _ in range(5)] == [24, 24, 22, 0, 0]
    assert loader.next_epoch()  # the run's one epoch is done


def test_a_draw_of_a_later_epoch_waits_for_it():
    chunks = Chunks(3, 64, 32)  # two chunks an epoch: 0-1, 2-3, 4-5
    slow = WorkerLoader(chunks, 32, 0, 0)
    fast = WorkerLoader(chunks, 32, 0, 0)
    assert slow.next_batch() == 32  # chunk 0
    assert fast.next_batch() == 32  # chunk 1
    assert fast.next_batch() == 0  # drew chunk 2, epoch 1's: its pass ends
    assert not fast.next_epoch()
    assert fast.next_batch() == 32  # chunk 2, kept for epoch 1
    assert fast.next_batch() == 32  # chunk 3
    assert slow.next_batch() == 0  # drew chunk 4, epoch 2's
    assert not slow.next_epoch()
    assert slow.next_batch() == 0  # epoch 1's chunks are gone: an empty pass
    assert not slow.next_epoch()
    assert slow.next_batch() == 32  # chunk 4, kept for epoch 2
    assert not fast.next_epoch()
    assert fast.next_batch() == 32  # chunk 5
    assert fast.next_batch() == 0  # chunk 6 is beyond the run
    assert fast.next_epoch() and slow.next_batch() == 0 and slow.next_epoch()
    # a draw of an epoch the worker has left is skipped (never computed)
    late = WorkerLoader(Chunks(2, 64, 32), 32, 0, 0)
    late.epoch = 1
    assert late.next_batch() == 32 and late.chunks.drawn == 3


def test_chunks_refuse_empty_counts():
    for args, name in (((0, 10, 5), "epochs"), ((1, 0, 5), "samples"),
                       ((1, 10, 0), "chunk")):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            Chunks(*args)
