"""The data format, converter and share logic, in the pytest process (no MPI)."""

from collections import Counter

import h5py
import numpy as np
import pytest
import torch

from hybridagg import cli
from hybridagg.data import (
    EpochPlan,
    HDF5Dataset,
    HDF5Loader,
    convert_arrays,
    convert_digits,
    convert_npy,
    convert_npz,
    convert_synthetic,
    resplit_static,
    split_static,
)
from hybridagg.data.shares import LocalCounter, drop_prefix, intervals_length


def indexed_file(path, n=500, block=16, classes=7, val_fraction=0.0):
    """A file whose sample i holds the value i, so tests can tell samples apart."""
    x = np.repeat(np.arange(n, dtype=np.float32)[:, None], 4, axis=1)
    y = np.arange(n, dtype=np.int64) % classes
    return convert_arrays(
        x, y, path, num_classes=classes, val_fraction=val_fraction, block_samples=block
    )


# ------------------------------------------------------------------ converter
def test_digits_round_trip_with_attributes_and_chunking(tmp_path):
    from sklearn.datasets import load_digits

    out = convert_digits(tmp_path / "d.h5", val_fraction=0.25, seed=3, block_samples=32)
    digits = load_digits()
    with h5py.File(out) as f:
        assert f.attrs["hybridagg_format"] == "hybridagg.hdf5"
        assert f.attrs["num_classes"] == 10 and f.attrs["block_samples"] == 32
        assert tuple(f.attrs["sample_shape"]) == (64,)
        xt, yt = f["train/samples"][:], f["train/labels"][:]
        xv, yv = f["val/samples"][:], f["val/labels"][:]
        assert f["train/samples"].chunks == (32, 64)
        assert len(xv) == round(0.25 * len(digits.data))
        assert len(xt) + len(xv) == len(digits.data)
        np.testing.assert_allclose(f.attrs["norm_mean"], [xt.mean()], rtol=1e-4)
    # every original (sample, label) pair is in exactly one split
    rows = Counter(
        (tuple(r), int(t))
        for r, t in zip(digits.data.astype(np.float32), digits.target, strict=True)
    )
    written = Counter(
        (tuple(r), int(t))
        for r, t in zip(np.concatenate([xt, xv]), np.concatenate([yt, yv]), strict=True)
    )
    assert rows == written


def test_split_is_deterministic_from_seed(tmp_path):
    a = convert_digits(tmp_path / "a.h5", seed=1)
    b = convert_digits(tmp_path / "b.h5", seed=1)
    c = convert_digits(tmp_path / "c.h5", seed=2)
    with h5py.File(a) as fa, h5py.File(b) as fb, h5py.File(c) as fc:
        assert np.array_equal(fa["val/samples"][:], fb["val/samples"][:])
        assert not np.array_equal(fa["val/samples"][:], fc["val/samples"][:])


def test_npy_and_npz_sources(tmp_path):
    x = np.random.default_rng(0).random((50, 2, 3)).astype(np.float32)
    y = np.arange(50) % 5
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.savez(tmp_path / "d.npz", images=x, targets=y)
    a = convert_npy(
        tmp_path / "x.npy", tmp_path / "y.npy", tmp_path / "a.h5", val_fraction=0.0
    )
    b = convert_npz(
        tmp_path / "d.npz",
        tmp_path / "b.h5",
        x_key="images",
        y_key="targets",
        val_fraction=0.0,
    )
    for out in (a, b):
        with h5py.File(out) as f:
            np.testing.assert_array_equal(f["train/samples"][:], x)
            np.testing.assert_array_equal(f["train/labels"][:], y)
    with pytest.raises(ValueError, match=r"d\.npz has no array 'x'"):
        convert_npz(tmp_path / "d.npz", tmp_path / "c.h5")
    with pytest.raises(FileNotFoundError, match=r"nope\.npy"):
        convert_npy(tmp_path / "nope.npy", tmp_path / "y.npy", tmp_path / "c.h5")


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_synthetic_is_image_shaped_and_learnable(tmp_path, dtype):
    out = convert_synthetic(
        tmp_path / "s.h5",
        samples=600,
        shape=(3, 8, 8),
        dtype=dtype,
        num_classes=4,
        val_fraction=0.2,
    )
    with h5py.File(out) as f:
        x, y = f["train/samples"][:].astype(np.float32), f["train/labels"][:]
        assert f["train/samples"].dtype == np.dtype(dtype)
        assert x.shape == (480, 3, 8, 8) and set(y) == {0, 1, 2, 3}
        assert f.attrs["norm_mean"].shape == (3,)
    # nearest class mean classifies far better than chance: the labels are learnable
    means = np.stack([x[y == c].mean(0) for c in range(4)])
    pred = np.argmin(((x[:, None] - means[None]) ** 2).sum((2, 3, 4)), axis=1)
    assert (pred == y).mean() > 0.9


def test_converter_refuses_bad_arrays(tmp_path):
    with pytest.raises(TypeError, match="need numbers"):
        convert_arrays(np.array([["a"], ["b"]]), np.array([0, 1]), tmp_path / "o.h5")
    with pytest.raises(ValueError, match="3 samples but 2 labels"):
        convert_arrays(np.zeros((3, 2)), np.array([0, 1]), tmp_path / "o.h5")
    with pytest.raises(ValueError, match="outside the 2 classes"):
        convert_arrays(
            np.zeros((3, 2)), np.array([0, 1, 2]), tmp_path / "o.h5", num_classes=2
        )
    with pytest.raises(ValueError, match="validation split empty"):
        convert_arrays(
            np.zeros((3, 2)), np.array([0, 1, 1]), tmp_path / "o.h5", val_fraction=0.1
        )
    with pytest.raises(ValueError, match="is a directory"):
        convert_digits(tmp_path)
    assert not list(tmp_path.glob("*.partial"))


def test_cli_convert(tmp_path, capsys):
    out = tmp_path / "syn.h5"
    rc = cli.main(
        [
            "convert",
            "--from",
            "synthetic",
            "--samples",
            "100",
            "--shape",
            "1,4,4",
            "--dtype",
            "float32",
            "--classes",
            "3",
            "--out",
            str(out),
            "--val-fraction",
            "0.1",
            "--seed",
            "5",
            "--quiet",
        ]
    )
    assert rc == 0 and "wrote" in capsys.readouterr().out
    with h5py.File(out) as f:
        assert f["train/samples"].shape == (90, 1, 4, 4) and f.attrs["num_classes"] == 3
    rc = cli.main(["convert", "--from", "npy", "only-one.npy", "--out", str(out)])
    assert rc == 2 and "two files" in capsys.readouterr().err
    assert cli.main(["convert", "--from", "digits", "--out", str(out), "--quiet"]) == 0


# ----------------------------------------------------------------- share logic
def test_epoch_plan_is_a_permutation_deterministic_from_seed_and_epoch():
    lengths = [100, 37, 64]
    plan = EpochPlan(lengths, block_samples=8, window_blocks=3, seed=4, epoch=2)
    rows = plan.rows([(0, plan.total)])
    assert plan.total == 201 and len(rows) == 201
    assert len({tuple(r) for r in rows.tolist()}) == 201  # each (file, row) once
    assert set(rows[:, 0].tolist()) == {0, 1, 2}
    again = EpochPlan(lengths, 8, 3, seed=4, epoch=2).rows([(0, 201)])
    other = EpochPlan(lengths, 8, 3, seed=4, epoch=3).rows([(0, 201)])
    assert np.array_equal(rows, again) and not np.array_equal(rows, other)
    ordered = EpochPlan(lengths, 8, 3, seed=4, epoch=2, shuffle=False).rows([(0, 201)])
    assert ordered[:100, 1].tolist() == list(range(100))
    # a window reads whole blocks that never cross files
    for g in range(plan.n_windows):
        for f, s, c in plan.window_blocks(g).tolist():
            assert 0 < c - s <= 8 and c <= lengths[f]


def test_pieces_split_intervals_at_window_borders():
    plan = EpochPlan([64], block_samples=8, window_blocks=2, seed=0, epoch=0)
    assert list(plan.pieces([(10, 40)])) == [(0, 10, 16), (1, 0, 16), (2, 0, 8)]
    with pytest.raises(ValueError, match="outside the stream"):
        list(plan.pieces([(0, 65)]))


@pytest.mark.parametrize(
    "total,sizes",
    [
        (1000, [32]),
        (1000, [3, 5, 7]),
        (10, [4, 4, 4]),
        (997, [1, 64, 2, 9, 30]),
        (5, [1, 1, 1, 1, 1]),
        (7, [2, 2, 2, 2, 2]),
    ],
)
def test_static_split_covers_everything_once_with_equal_steps(total, sizes):
    shares, steps = split_static([(0, total)], sizes)
    covered = sorted(i for s in shares for a, b in s for i in range(a, b))
    assert covered == list(range(total))
    for share, b in zip(shares, sizes, strict=True):
        n = intervals_length(share)
        assert -(-n // b) <= steps  # no worker needs more steps than the others
        assert n >= (steps - 1) * b  # every full step is full
    assert steps == -(-total // sum(sizes))


def test_static_split_is_proportional_and_drop_last_drops_the_tail():
    shares, steps = split_static([(0, 1000)], [10, 30])
    assert [intervals_length(s) for s in shares] == [250, 750] and steps == 25
    shares, steps = split_static([(0, 1005)], [10, 30], drop_last=True)
    assert sum(intervals_length(s) for s in shares) == 1000 and steps == 25


def test_resplit_mid_epoch_keeps_exactly_once():
    shares, _ = split_static([(0, 1000)], [8, 16, 24])
    consumed = [3 * 8, 3 * 16, 3 * 24]
    read = []
    for s, k in zip(shares, consumed, strict=True):
        flat = [i for a, b in s for i in range(a, b)]
        read += flat[:k]
    new, steps = resplit_static(shares, consumed, [40, 4, 20])
    rest = [i for s in new for a, b in s for i in range(a, b)]
    assert sorted(read + rest) == list(range(1000))
    assert steps == -(-len(rest) // 64)
    assert drop_prefix([(0, 5), (10, 20)], 7) == [(12, 20)]
    with pytest.raises(ValueError, match="one each per worker"):
        resplit_static(shares, consumed[:2], [1, 2, 3])


def test_a_parked_worker_gets_an_empty_share_and_the_same_steps():
    """--cost-budget parks a group with a batch size of 0 mid-epoch."""
    shares, _ = split_static([(0, 1000)], [8, 24])
    consumed = [5 * 8, 5 * 24]
    read = []
    for s, k in zip(shares, consumed, strict=True):
        read += [i for a, b in s for i in range(a, b)][:k]
    new, steps = resplit_static(shares, consumed, [32, 0])
    assert new[1] == [] and steps == -(-(1000 - 160) // 32)
    rest = [i for s in new for a, b in s for i in range(a, b)]
    assert sorted(read + rest) == list(range(1000))  # every sample once
    back, _ = resplit_static(new, [64, 0], [24, 8])  # brought back
    assert intervals_length(back[1]) > 0
    with pytest.raises(ValueError, match="at least one >= 1"):
        split_static([(0, 10)], [0, 0])
    with pytest.raises(ValueError, match="at least one >= 1"):
        split_static([(0, 10)], [-1, 4])


def test_local_counter():
    c = LocalCounter()
    assert [c.fetch_add() for _ in range(3)] == [0, 1, 2]
    c.reset()
    assert c.fetch_add() == 0


# ------------------------------------------------- loader and dataset, no MPI
def test_single_process_loader_static_and_dynamic(tmp_path):
    path = indexed_file(tmp_path / "i.h5", n=500)
    for shares in ("static", "dynamic"):
        with HDF5Loader(
            path, batch_size=32, shares=shares, window_blocks=3, seed=1
        ) as ld:
            ids = torch.cat([x[:, 0] for x, _ in ld]).long()
            assert sorted(ids.tolist()) == list(range(500))
            assert ld.epoch == 1 and ld.stats.samples == 500
            assert ld.stats.bytes_read == 500 * 16
            ids2 = torch.cat([x[:, 0] for x, _ in ld]).long()
            assert sorted(ids2.tolist()) == list(range(500))
            assert ids.tolist() != ids2.tolist()  # epoch 1 has another order
    with HDF5Loader(path, batch_size=32, window_blocks=3, seed=1, prefetch=0) as ld:
        inline = torch.cat([x[:, 0] for x, _ in ld]).long()
    assert inline.tolist() == ids.tolist()  # same order with or without the thread
    assert len(HDF5Loader(path, batch_size=32)) == 16


def test_labels_travel_with_their_samples(tmp_path):
    path = indexed_file(tmp_path / "i.h5", n=300, classes=7)
    with HDF5Loader(path, batch_size=50, seed=9) as ld:
        for x, y in ld:
            assert torch.equal(y, x[:, 0].long() % 7)
            assert y.dtype == torch.int64 and x.dtype == torch.float32


def test_normalize_uses_recorded_statistics(tmp_path):
    path = convert_synthetic(
        tmp_path / "s.h5",
        samples=400,
        shape=(3, 4, 4),
        dtype="uint8",
        val_fraction=0.0,
        block_samples=20,
    )
    with HDF5Loader(path, batch_size=400, normalize=True) as ld:
        x, _ = next(iter(ld))
    assert x.dtype == torch.float32
    torch.testing.assert_close(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-3, rtol=0)
    torch.testing.assert_close(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-2, rtol=0)


def test_map_style_dataset_with_a_dataloader(tmp_path):
    path = indexed_file(tmp_path / "i.h5", n=120)
    ds = HDF5Dataset(path)
    assert len(ds) == 120 and ds[7][0][0].item() == 7.0 and ds[-1][1] == 119 % 7
    with pytest.raises(IndexError, match="out of range"):
        ds[120]
    dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2)
    ids = torch.cat([x[:, 0] for x, _ in dl]).long()
    assert sorted(ids.tolist()) == list(range(120))


def test_close_stops_the_reader_thread(tmp_path):
    import gc
    import threading

    path = indexed_file(tmp_path / "i.h5", n=500)

    def readers():
        return [t for t in threading.enumerate() if t.name.startswith("hybridagg-data")]

    ld = HDF5Loader(path, batch_size=8, prefetch=2)
    it = iter(ld)
    next(it)
    assert readers() and readers()[0].is_alive()
    ld.close()
    assert not readers()
    with HDF5Loader(path, batch_size=8, prefetch=2) as ld:
        for i, _ in enumerate(ld):
            if i == 3:
                break  # leaving the loop early stops the thread too
        assert not readers()
    ld = HDF5Loader(path, batch_size=8, prefetch=2)
    it = iter(ld)
    next(it)
    del it, ld
    gc.collect()
    assert not readers()
