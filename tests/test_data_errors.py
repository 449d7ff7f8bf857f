"""Every bad input gives a clear error naming the file and dataset, on every rank."""

import os

import h5py
import numpy as np
import pytest

from hybridagg.data import HDF5Dataset, HDF5Loader, convert_arrays


def good_file(path, n=200):
    x = np.random.default_rng(0).random((n, 4)).astype(np.float32)
    return convert_arrays(
        x, np.arange(n) % 5, path, num_classes=5, val_fraction=0.0, block_samples=16
    )


def raw_file(path, *, samples, labels, attrs=None, split="train", names=None):
    names = names or ("samples", "labels")
    with h5py.File(path, "w") as f:
        g = f.create_group(split)
        g.create_dataset(names[0], data=samples)
        g.create_dataset(names[1], data=labels)
        f.attrs.update(attrs or {})
    return path


def make_bad(kind, tmp):
    """Write a bad input of the given kind; return (path, error type, message regex)."""
    p = tmp / f"{kind}.h5"
    if kind == "missing":
        return p, FileNotFoundError, "does not exist"
    if kind == "directory":
        p.mkdir(exist_ok=True)
        return p, ValueError, "is a directory"
    if kind == "empty":
        p.write_bytes(b"")
        return p, ValueError, r"is empty \(0 bytes\)"
    if kind == "not-hdf5":
        p.write_text("label,pixel0\n1,0\n")
        return p, ValueError, "not an HDF5 file"
    if kind == "truncated":
        good_file(p, n=2000)
        size = p.stat().st_size
        with open(p, "r+b") as f:
            f.truncate(size // 2)
        return p, ValueError, "truncated or corrupted"
    if kind == "corrupted":
        good_file(p)
        with open(p, "r+b") as f:
            f.seek(96)  # the root group's object header, after the superblock
            f.write(os.urandom(2048))
        return p, ValueError, "corrupted"
    if kind == "missing-dataset":
        with h5py.File(p, "w") as f:
            f.create_dataset("train/samples", data=np.zeros((4, 2)))
        return (
            p,
            ValueError,
            r"dataset 'train/labels' does not exist \(found: train/samples\)",
        )
    if kind == "misnamed":
        raw_file(p, samples=np.zeros((4, 2)), labels=np.zeros(4, int), names=("x", "y"))
        return (
            p,
            ValueError,
            r"'train/samples' does not exist \(found: train/x, train/y\)",
        )
    if kind == "no-split":
        raw_file(p, samples=np.zeros((4, 2)), labels=np.zeros(4, int), split="training")
        return p, ValueError, r"has no split 'train' \(found: training\)"
    if kind == "length-mismatch":
        raw_file(p, samples=np.zeros((5, 2)), labels=np.zeros(4, int))
        return p, ValueError, "'train/samples' has 5 samples but 'train/labels' has 4"
    if kind == "label-range":
        raw_file(
            p,
            samples=np.zeros((4, 2)),
            labels=np.array([0, 1, 9, 2]),
            attrs={"num_classes": 3},
        )
        return p, ValueError, r"'train/labels' has label 9 at index 2, outside the 3"
    if kind == "negative-label":
        raw_file(p, samples=np.zeros((4, 2)), labels=np.array([0, -1, 1, 2]))
        return p, ValueError, "label -1 at index 1"
    if kind == "non-numeric":
        raw_file(p, samples=np.array([b"a", b"b"]), labels=np.zeros(2, int))
        return p, TypeError, "'train/samples' has dtype |S1; samples must be numeric"
    if kind == "text-labels":  # (float labels are regression targets: --loss mse)
        raw_file(p, samples=np.zeros((2, 2)), labels=np.array([b"a", b"b"]))
        return p, TypeError, "'train/labels' has dtype |S1; labels must be integers"
    if kind == "empty-split":
        raw_file(p, samples=np.zeros((0, 2)), labels=np.zeros(0, int))
        return p, ValueError, r"split 'train' \('train/samples'\) is empty"
    if kind == "share-too-large":
        good_file(p, n=50)
        return (
            p,
            ValueError,
            r"larger than split 'train' .* \(50 samples in 'train/samples'\)",
        )
    raise AssertionError(kind)


KINDS = [
    "missing",
    "directory",
    "empty",
    "not-hdf5",
    "truncated",
    "corrupted",
    "missing-dataset",
    "misnamed",
    "no-split",
    "length-mismatch",
    "label-range",
    "negative-label",
    "non-numeric",
    "text-labels",
    "empty-split",
    "share-too-large",
]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_single_process(tmp_path, kind):
    path, etype, pattern = make_bad(kind, tmp_path)
    with pytest.raises(etype, match=pattern) as info:
        HDF5Loader(path, batch_size=64)
    assert str(path) in str(info.value)
    if kind != "share-too-large":
        with pytest.raises(etype, match=pattern):
            HDF5Dataset(path)


def test_bad_arguments(tmp_path):
    path = good_file(tmp_path / "g.h5")
    raw = raw_file(
        tmp_path / "raw.h5", samples=np.zeros((8, 2)), labels=np.zeros(8, int)
    )
    with pytest.raises(ValueError, match="records no norm_mean"):
        HDF5Loader(raw, batch_size=4, normalize=True)
    for kwargs, etype, pattern in [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"batch_size": 2.5}, TypeError, "batch_size must be an int"),
        ({"batch_size": 4, "shares": "greedy"}, ValueError, "shares must be"),
        ({"batch_size": 4, "seed": -1}, ValueError, "seed must be >= 0"),
        ({"batch_size": 4, "driver": "mpio"}, ValueError, "mpio"),
        ({"batch_size": 4, "split": "val"}, ValueError, "has no split 'val'"),
        ({"batch_size": 4, "batch_sizes": [4, 4]}, ValueError, "one entry per worker"),
    ]:
        with pytest.raises(etype, match=pattern):
            HDF5Loader(path, **kwargs)
    with pytest.raises(TypeError, match="file name or a non-empty list"):
        HDF5Loader([], batch_size=4)


def test_files_of_a_list_must_share_one_layout(tmp_path):
    a = good_file(tmp_path / "a.h5")
    b = convert_arrays(
        np.zeros((30, 3), np.float32),
        np.arange(30) % 5,
        tmp_path / "b.h5",
        val_fraction=0.0,
    )
    with pytest.raises(ValueError, match=r"b\.h5 .* does not match .*a\.h5"):
        HDF5Loader([a, b], batch_size=4)
    with HDF5Loader([a, a], batch_size=8, window_blocks=2) as ld:
        assert ld.total == 400 and sum(len(y) for _, y in ld) == 400


ERROR_KINDS = [
    "missing",
    "not-hdf5",
    "truncated",
    "misnamed",
    "length-mismatch",
    "label-range",
    "non-numeric",
    "empty-split",
    "share-too-large",
]


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_bad_input_is_the_same_error_on_every_rank(mpi_tmp_path):
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    for kind in ERROR_KINDS:
        made = make_bad(kind, mpi_tmp_path) if comm.rank == 0 else None
        comm.barrier()
        path, etype, pattern = comm.bcast(made)
        with pytest.raises(etype, match=pattern) as info:
            HDF5Loader(path, batch_size=30, comm=comm)
        assert str(path) in str(info.value), kind
        # the same message everywhere: one rank's error (prefixed with that
        # rank), or a check every rank made on data they agreed on
        assert len(set(comm.allgather(str(info.value)))) == 1, kind
    comm.free()


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_one_rank_with_a_bad_path_fails_every_rank(mpi_tmp_path):
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    good = mpi_tmp_path / "good.h5"
    other = mpi_tmp_path / "other.h5"
    if comm.rank == 0:
        good_file(good, n=200)
        good_file(other, n=120)
    comm.barrier()
    odd = comm.size - 1
    # one rank was given a path that does not exist
    path = mpi_tmp_path / "typo.h5" if comm.rank == odd else good
    with pytest.raises(
        FileNotFoundError, match=rf"\[rank {odd}\] data file .*typo\.h5"
    ):
        HDF5Loader(path, batch_size=4, comm=comm)
    # one rank was given another (valid) data set
    path = other if comm.rank == odd else good
    with pytest.raises(
        ValueError, match=f"worker {odd} sees split 'train' of .*other.h5"
    ):
        HDF5Loader(path, batch_size=4, comm=comm)
    # one rank's batch size makes the global batch larger than the file
    batch = 230 - 15 * (comm.size - 1) if comm.rank == odd else 15
    with pytest.raises(ValueError, match=r"global batch of 230 samples"):
        HDF5Loader(good, batch_size=batch, comm=comm)
    # and the job goes on: a good loader works afterwards on every rank
    with HDF5Loader(good, batch_size=4, comm=comm) as ld:
        n = sum(len(y) for _, y in ld)
    assert sum(comm.allgather(n)) == 200
    comm.free()
