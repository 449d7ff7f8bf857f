"""Direct chunk reads (``os.preadv`` at HDF5's chunk addresses) against h5py's reads."""

import h5py
import numpy as np
import pytest
import torch

from hybridagg.data import HDF5Loader, convert_arrays
from hybridagg.data.reader import ChunkMap


def make(path, n=1001, block=64, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3, 5)).astype(dtype)
    y = rng.integers(0, 4, size=n)
    return convert_arrays(
        x, y, path, num_classes=4, val_fraction=0.1, block_samples=block
    )


def epoch(paths, **kw):
    with HDF5Loader(paths, batch_size=37, window_blocks=3, seed=5, **kw) as ld:
        direct = [d is not None for d in ld.reader.direct]
        batches = [(x.clone(), y.clone()) for x, y in ld]
    return direct, batches


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.float64])
def test_direct_reads_give_the_same_batches_as_h5py(tmp_path, monkeypatch, dtype):
    paths = [
        str(make(tmp_path / f"f{i}.h5", n=1001 + 37 * i, seed=i, dtype=dtype))
        for i in range(2)
    ]
    direct, fast = epoch(paths)
    assert direct == [True, True]
    monkeypatch.setenv("HYBRIDAGG_DATA_DIRECT_READ", "0")
    direct, slow = epoch(paths)
    assert direct == [False, False]
    assert len(fast) == len(slow) > 10
    for (xf, yf), (xs, ys) in zip(fast, slow, strict=True):
        assert torch.equal(xf, xs) and torch.equal(yf, ys)


def test_every_row_range_matches_h5py(tmp_path):
    path = make(tmp_path / "rows.h5", n=300, block=16)
    with h5py.File(path, "r") as f:
        d = f["train/samples"]
        cmap = ChunkMap(str(path), d)
        full = d[()]
        try:
            rng = np.random.default_rng(1)
            for _ in range(50):
                s = int(rng.integers(0, len(full)))
                c = int(rng.integers(s, len(full) + 1))
                out = np.empty((c - s, *full.shape[1:]), full.dtype)
                cmap.read(s, c, memoryview(out.reshape(-1).view(np.uint8)))
                np.testing.assert_array_equal(out, full[s:c])
        finally:
            cmap.close()


def test_compressed_chunks_fall_back_to_h5py(tmp_path):
    path = make(tmp_path / "gz.h5")
    with h5py.File(path, "r+") as f:
        g = f["train"]
        data, chunks = g["samples"][()], g["samples"].chunks
        del g["samples"]
        g.create_dataset("samples", data=data, chunks=chunks, compression="gzip")
        with pytest.raises(ValueError, match="filtered"):
            ChunkMap(str(path), g["samples"])
    direct, batches = epoch([str(path)])
    assert direct == [False]
    assert sum(len(y) for _, y in batches) == len(data)


def test_chunks_past_the_end_of_the_file_are_refused(tmp_path):
    path = make(tmp_path / "cut.h5", n=2000)
    with h5py.File(path, "r") as f:
        d = f["train/samples"]
        cmap = ChunkMap(str(path), d)  # whole: accepted
        cmap.close()
        with open(path, "r+b") as raw:  # cut inside the last chunk
            raw.truncate(int(cmap.offsets.max()) + 10)
        with pytest.raises(ValueError, match="past the end"):
            ChunkMap(str(path), d)


def test_a_file_cut_short_while_open_is_a_clear_error(tmp_path):
    path = make(tmp_path / "short.h5", n=4000)
    with HDF5Loader(
        str(path), batch_size=50, window_blocks=2, seed=0, prefetch=0
    ) as ld:
        assert ld.reader.direct[0] is not None
        with open(path, "r+b") as raw:
            raw.truncate(path.stat().st_size // 3)
        with pytest.raises(ValueError, match="truncated or corrupted"):
            for _ in ld:
                pass
