"""A user's own data: image folders, plain HDF5 files, channels last, given splits.

Tiny image folders written with Pillow, tiny HDF5 files written with h5py;
the converter in the pytest process, the statistics computed by several
workers and ``hybridagg train --normalize`` under real MPI.
"""

import h5py
import numpy as np
import pytest
import torch
from train_helpers import output, run_train, summary

from hybridagg import cli
from hybridagg.data import (
    HDF5Dataset,
    HDF5Loader,
    compute_statistics,
    convert_arrays,
    convert_folder,
    convert_hdf5,
    convert_npy,
    load_split_info,
    resolve_layout,
)

Image = pytest.importorskip("PIL.Image")

# Three classes, created out of order: labels must follow the sorted names.
CLASSES = ("zebra", "ant", "cat")


def image_array(label: int, k: int, size=(6, 5), channels=3) -> np.ndarray:
    """A recognisable image: its pixels encode the class and the image's number."""
    h, w = size
    base = np.arange(h * w * channels, dtype=np.int64).reshape(h, w, channels)
    return ((base * 7 + label * 50 + k * 3) % 256).astype(np.uint8)


def write_folder(root, per_class=4, size=(6, 5), classes=CLASSES, grey=False, start=0):
    """``root/<class>/<k>.png``; returns {(class name, k): HWC array}."""
    written = {}
    for name in classes:
        label = sorted(CLASSES).index(name)
        (root / name).mkdir(parents=True, exist_ok=True)
        for k in range(start, start + per_class):
            a = image_array(label, k, size, 1 if grey else 3)
            img = Image.fromarray(a[..., 0] if grey else a, "L" if grey else "RGB")
            img.save(root / name / f"{k:03d}.png")
            written[(name, k)] = a
    return written


def read_split(path, split):
    with h5py.File(path) as f:
        return f[f"{split}/samples"][:], f[f"{split}/labels"][:]


# ---------------------------------------------------------------- image folders
def test_folder_converts_with_sorted_class_names_and_exact_pixels(tmp_path):
    written = write_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "ant" / "notes.txt").write_text("not an image")
    out = convert_folder(tmp_path / "imgs", tmp_path / "d.h5", val_fraction=0.25)
    info = load_split_info([out], "train")[0]
    assert info.class_names == sorted(CLASSES) == ["ant", "cat", "zebra"]
    assert info.sample_shape == (3, 6, 5) and info.dtype == np.uint8
    xt, yt = read_split(out, "train")
    xv, yv = read_split(out, "val")
    assert len(xt) + len(xv) == 12 and len(xv) == 3
    # every image is in exactly one split, channels first, under its class's label
    expected = sorted(
        (sorted(CLASSES).index(c), a.transpose(2, 0, 1).tobytes())
        for (c, _), a in written.items()
    )
    got = sorted(
        (int(y), x.tobytes())
        for x, y in zip(np.concatenate([xt, xv]), np.concatenate([yt, yv]), strict=True)
    )
    assert got == expected
    # statistics per real channel, over the training split
    with h5py.File(out) as f:
        np.testing.assert_allclose(
            f.attrs["norm_mean"], xt.astype(np.float64).mean(axis=(0, 2, 3)), rtol=1e-5
        )
        assert f.attrs["num_classes"] == 3


def test_folder_grey_images_are_one_channel_and_size_resizes(tmp_path):
    write_folder(tmp_path / "g", grey=True, size=(6, 5))
    out = convert_folder(tmp_path / "g", tmp_path / "g.h5", val_fraction=0.0)
    assert load_split_info([out], "train")[0].sample_shape == (1, 6, 5)
    # one image of another size: refused, naming --size; resized with it
    Image.fromarray(image_array(0, 9, (9, 9), 1)[..., 0], "L").save(
        tmp_path / "g" / "ant" / "big.png"
    )
    with pytest.raises(ValueError, match=r"differ in size.*--size HxW"):
        convert_folder(tmp_path / "g", tmp_path / "g2.h5")
    out = convert_folder(tmp_path / "g", tmp_path / "g2.h5", size=(4, 3))
    x, _ = read_split(out, "train")
    assert x.shape[1:] == (1, 4, 3)


def test_folder_given_validation_and_test_folders_are_kept(tmp_path):
    write_folder(tmp_path / "train", per_class=4)
    # validation lacks a class: labels still follow the training classes
    val = write_folder(
        tmp_path / "val", per_class=2, classes=("zebra", "cat"), start=10
    )
    write_folder(tmp_path / "test", per_class=1, start=20)
    out = convert_folder(
        tmp_path / "train",
        tmp_path / "d.h5",
        val_from=tmp_path / "val",
        test_from=tmp_path / "test",
    )
    xt, _ = read_split(out, "train")
    xv, yv = read_split(out, "val")
    xs, ys = read_split(out, "test")
    assert len(xt) == 12 and len(xv) == 4 and len(xs) == 3  # no random cut
    assert sorted(yv.tolist()) == [1, 1, 2, 2]  # cat = 1, zebra = 2
    assert sorted(ys.tolist()) == [0, 1, 2]
    assert {x.tobytes() for x in xv} == {
        a.transpose(2, 0, 1).tobytes() for a in val.values()
    }
    with h5py.File(out) as f:
        assert f.attrs["val_fraction"] == 0.0
        assert f.attrs["val_source"] == str(tmp_path / "val")
    # a validation class the training data lacks is an error naming it
    write_folder(tmp_path / "val2", per_class=1, classes=("ant",))
    (tmp_path / "val2" / "yak").mkdir()
    Image.fromarray(image_array(0, 0)).save(tmp_path / "val2" / "yak" / "0.png")
    with pytest.raises(
        ValueError, match=r"classes \['yak'\] that the training data lacks"
    ):
        convert_folder(
            tmp_path / "train", tmp_path / "e.h5", val_from=tmp_path / "val2"
        )


@pytest.mark.parametrize(
    "kind,error,message",
    [
        ("missing", FileNotFoundError, "does not exist"),
        ("no-classes", ValueError, "has no class sub-folders"),
        ("empty-class", ValueError, r"class folder .*cat holds no image"),
        ("corrupt", ValueError, r"image .*bad\.png cannot be read"),
        ("loose", ValueError, "beside its class folders"),
    ],
)
def test_bad_folders_are_clear_errors(tmp_path, kind, error, message):
    root = tmp_path / "imgs"
    if kind != "missing":
        root.mkdir()
    if kind in ("empty-class", "corrupt", "loose"):
        write_folder(root, per_class=1, classes=("ant",))
    if kind == "empty-class":
        (root / "cat").mkdir()
    if kind == "corrupt":
        (root / "ant" / "bad.png").write_bytes(b"\x89PNG but not really")
    if kind == "loose":
        Image.fromarray(image_array(0, 0)).save(root / "stray.png")
    with pytest.raises(error, match=message):
        convert_folder(root, tmp_path / "o.h5", val_fraction=0.0)
    assert not (tmp_path / "o.h5").exists()


def test_cli_converts_a_folder(tmp_path, capsys):
    write_folder(tmp_path / "imgs")
    write_folder(tmp_path / "val", per_class=1, start=5)
    out = tmp_path / "d.h5"
    argv = ["convert", "--from", "folder", str(tmp_path / "imgs"), "--size", "4x4"]
    argv += ["--val-from", str(tmp_path / "val"), "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert read_split(out, "train")[0].shape == (12, 3, 4, 4)
    assert read_split(out, "val")[0].shape == (3, 3, 4, 4)
    bad = ["convert", "--from", "folder", str(tmp_path / "imgs"), "--size", "4y"]
    assert cli.main([*bad, "--out", str(out)]) == 2
    assert "--size must be HxW" in capsys.readouterr().err
    npz = ["convert", "--from", "digits", "--size", "4x4", "--out", str(out)]
    assert cli.main(npz) == 2 and "--from folder only" in capsys.readouterr().err


# ------------------------------------------------------------------ channels last
@pytest.mark.parametrize(
    "shape,layout",
    [
        ((3, 32, 32), "nchw"),
        ((32, 32, 3), "nhwc"),
        ((1, 28, 28), "nchw"),
        ((28, 28, 1), "nhwc"),
        ((4, 9, 7), "nchw"),
        ((9, 7, 4), "nhwc"),
        ((28, 28), None),
        ((64,), None),
    ],
)
def test_layout_is_detected(shape, layout):
    assert resolve_layout(shape) == layout


@pytest.mark.parametrize("shape", [(5, 32, 32), (32, 32, 32), (3, 3, 3), (2, 8, 8)])
def test_ambiguous_layout_names_the_flag(shape):
    with pytest.raises(ValueError, match=r"--layout nchw .* --layout nhwc"):
        resolve_layout(shape)
    assert resolve_layout(shape, "nchw") == "nchw"


def test_layout_stated_for_samples_without_channels_is_refused():
    with pytest.raises(ValueError, match="--layout nhwc needs image samples of 3 axes"):
        resolve_layout((28, 28), "nhwc")


def test_channels_last_array_is_transposed_with_statistics_per_channel(tmp_path):
    rng = np.random.default_rng(0)
    # channel c has mean 100 * c: statistics for 3 channels, not 8 "columns"
    x = (rng.random((40, 8, 8, 3)) + np.array([0.0, 100.0, 200.0])).astype(np.float32)
    y = np.arange(40) % 4
    out = convert_arrays(x, y, tmp_path / "a.h5", val_fraction=0.0)
    xt, yt = read_split(out, "train")
    np.testing.assert_array_equal(xt, x.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(yt, y)
    with h5py.File(out) as f:
        assert f.attrs["norm_mean"].shape == (3,)
        np.testing.assert_allclose(f.attrs["norm_mean"], [0.5, 100.5, 200.5], atol=0.05)
        assert f.attrs["source_layout"] == "nhwc"
    # stated: the same; stated the other way: kept as is
    same = convert_arrays(x, y, tmp_path / "b.h5", val_fraction=0.0, layout="nhwc")
    np.testing.assert_array_equal(read_split(same, "train")[0], xt)
    kept = convert_arrays(x, y, tmp_path / "c.h5", val_fraction=0.0, layout="nchw")
    np.testing.assert_array_equal(read_split(kept, "train")[0], x)
    with pytest.raises(ValueError, match="--layout"):
        convert_arrays(np.zeros((4, 5, 6, 7)), np.zeros(4, int), tmp_path / "d.h5")


def test_cli_layout_flag(tmp_path, capsys):
    x = np.zeros((6, 5, 7, 9), np.float32)  # neither channels first nor last
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(6) % 2)
    argv = ["convert", "--from", "npz", str(tmp_path / "d.npz"), "--quiet"]
    argv += ["--val-fraction", "0", "--out", str(tmp_path / "d.h5")]
    assert cli.main(argv) == 2
    assert "pass --layout nchw" in capsys.readouterr().err
    assert cli.main([*argv, "--layout", "nhwc"]) == 0
    assert read_split(tmp_path / "d.h5", "train")[0].shape == (6, 9, 5, 7)


def test_labels_as_a_column_or_whole_floats_are_taken(tmp_path):
    x = np.zeros((4, 3), np.float32)
    out = convert_arrays(x, np.array([[0.0], [2.0], [1.0], [2.0]]), tmp_path / "a.h5")
    with h5py.File(out) as f:
        assert f.attrs["num_classes"] == 3
    with pytest.raises(TypeError, match="need integers"):
        convert_arrays(x, np.array([0.5, 1, 2, 0]), tmp_path / "b.h5")
    with pytest.raises(ValueError, match="label -1 is negative"):
        convert_arrays(x, np.array([0, -1, 2, 0]), tmp_path / "b.h5")


# ---------------------------------------------------------------- plain HDF5 files
def plain_file(path, n=60, nhwc=True, x_key="x", y_key="y", seed=0, float_labels=False):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 8, 8, 3) if nhwc else (n, 3, 8, 8), dtype=np.uint8)
    y = np.arange(n) % 5
    with h5py.File(path, "w") as f:
        f.create_dataset(
            x_key, data=x, chunks=(min(7, n), *x.shape[1:]), compression="gzip"
        )
        f.create_dataset(y_key, data=y.astype(np.float32) if float_labels else y)
    return x, y


def test_plain_hdf5_file_converts_with_given_splits(tmp_path):
    x, y = plain_file(tmp_path / "train.h5", n=60, float_labels=True)
    xv, yv = plain_file(tmp_path / "val.h5", n=10, seed=1)
    xs, ys = plain_file(tmp_path / "test.h5", n=5, seed=2)
    out = convert_hdf5(
        tmp_path / "train.h5",
        tmp_path / "d.h5",
        val_from=tmp_path / "val.h5",
        test_from=tmp_path / "test.h5",
        block_samples=8,
    )
    for split, (a, b) in {"train": (x, y), "val": (xv, yv), "test": (xs, ys)}.items():
        got_x, got_y = read_split(out, split)
        np.testing.assert_array_equal(got_x, a.transpose(0, 3, 1, 2))
        np.testing.assert_array_equal(got_y, b)
    info = load_split_info([out], "train")[0]
    assert info.sample_shape == (3, 8, 8) and info.num_classes == 5
    assert info.norm_mean.shape == (3,)
    # the loader reads it: every training sample once
    with HDF5Loader(out, batch_size=16, prefetch=0) as ld:
        assert sum(len(b) for _, b in ld) == 60


def test_plain_hdf5_nested_keys_and_missing_key(tmp_path):
    plain_file(tmp_path / "p.h5", nhwc=False, x_key="data/images", y_key="data/labels")
    out = convert_hdf5(
        tmp_path / "p.h5",
        tmp_path / "d.h5",
        x_key="data/images",
        y_key="data/labels",
        val_fraction=0.2,
    )
    assert len(read_split(out, "val")[0]) == 12
    with pytest.raises(
        ValueError, match=r"no dataset 'x' \(has: data/images, data/labels\).*--x-key"
    ):
        convert_hdf5(tmp_path / "p.h5", tmp_path / "e.h5")


def test_training_from_a_plain_file_names_the_conversion(tmp_path):
    plain_file(tmp_path / "plain.h5")
    fix = r"hybridagg convert --from hdf5 .*plain\.h5 --x-key x --y-key y --out"
    with pytest.raises(ValueError, match=r"no split 'train' \(found: x, y\).*" + fix):
        load_split_info([tmp_path / "plain.h5"], "train")
    with pytest.raises(ValueError, match=fix):
        HDF5Loader(tmp_path / "plain.h5", batch_size=4)


def test_npy_given_validation_pair(tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("", 30), ("v", 6)):
        np.save(tmp_path / f"{name}x.npy", rng.random((n, 4)).astype(np.float32))
        np.save(tmp_path / f"{name}y.npy", np.arange(n) % 3)
    out = convert_npy(
        tmp_path / "x.npy",
        tmp_path / "y.npy",
        tmp_path / "d.h5",
        val_from=(tmp_path / "vx.npy", tmp_path / "vy.npy"),
    )
    np.testing.assert_array_equal(
        read_split(out, "val")[0], np.load(tmp_path / "vx.npy")
    )
    np.save(tmp_path / "wx.npy", np.zeros((6, 5), np.float32))
    with pytest.raises(ValueError, match=r"samples of shape \(5,\), the training"):
        convert_npy(
            tmp_path / "x.npy",
            tmp_path / "y.npy",
            tmp_path / "e.h5",
            val_from=(tmp_path / "wx.npy", tmp_path / "vy.npy"),
        )


def test_cli_converts_a_plain_hdf5_file_and_checks_given_splits(tmp_path, capsys):
    plain_file(tmp_path / "p.h5")
    plain_file(tmp_path / "v.h5", n=8)
    with h5py.File(tmp_path / "w.h5", "w") as f:  # 6x6 images beside 8x8 ones
        f["x"], f["y"] = np.zeros((8, 6, 6, 3), np.uint8), np.zeros(8, int)
    out = tmp_path / "d.h5"
    head = ["convert", "--from", "hdf5", str(tmp_path / "p.h5"), "--x-key", "x"]
    tail = ["--out", str(out), "--quiet"]
    assert cli.main([*head, "--val-from", str(tmp_path / "v.h5"), *tail]) == 0
    assert read_split(out, "val")[0].shape == (8, 3, 8, 8)
    assert cli.main([*head, "--val-from", "a.h5", "b.h5", *tail]) == 2
    assert "takes one file" in capsys.readouterr().err
    # a given validation set must be samples of the training data's shape
    assert cli.main([*head, "--val-from", str(tmp_path / "w.h5"), *tail]) == 2
    assert "hdf5:w.h5: samples of shape (3, 6, 6)" in capsys.readouterr().err


# ------------------------------------------------------------------- normalisation
def raw_split_file(path, x, y):
    """A file with a split but no attributes (no statistics), as another tool writes."""
    with h5py.File(path, "w") as f:
        f.create_dataset("train/samples", data=x)
        f.create_dataset("train/labels", data=y)
    return path


def test_compute_statistics_matches_the_converters(tmp_path):
    x = np.random.default_rng(0).random((300, 3, 4, 4)).astype(np.float32) * 9
    y = np.arange(300) % 3
    out = convert_arrays(x, y, tmp_path / "a.h5", val_fraction=0.0, block_samples=10)
    mean, std = compute_statistics(out)
    with h5py.File(out) as f:
        np.testing.assert_allclose(mean, f.attrs["norm_mean"], rtol=1e-5)
        np.testing.assert_allclose(std, f.attrs["norm_std"], rtol=1e-5)
    np.testing.assert_allclose(mean, x.mean(axis=(0, 2, 3)), rtol=1e-4)


def test_loader_normalises_with_computed_statistics(tmp_path):
    x = (np.random.default_rng(1).random((200, 6)) * 5 + 3).astype(np.float32)
    raw = raw_split_file(tmp_path / "raw.h5", x, np.arange(200) % 4)
    with pytest.raises(ValueError, match="--normalize compute"):
        HDF5Loader(raw, batch_size=8, normalize=True)
    stats = compute_statistics(raw)
    with HDF5Loader(raw, batch_size=50, normalize=True, statistics=stats) as ld:
        seen = torch.cat([b for b, _ in ld])
    assert abs(float(seen.mean())) < 1e-4 and abs(float(seen.std()) - 1) < 1e-2
    with pytest.raises(ValueError, match="only with normalize=True"):
        HDF5Loader(raw, batch_size=8, statistics=stats)
    with pytest.raises(ValueError, match="do not fit samples of shape"):
        HDF5Loader(raw, batch_size=8, normalize=True, statistics=([0, 0], [1, 1]))
    with pytest.raises(ValueError, match="std > 0"):
        HDF5Loader(raw, batch_size=8, normalize=True, statistics=([0], [0]))


def test_map_style_dataset_transforms_after_normalising(tmp_path):
    x = np.random.default_rng(2).random((20, 1, 4, 4)).astype(np.float32)
    out = convert_arrays(x, np.arange(20) % 2, tmp_path / "a.h5", val_fraction=0.0)
    plain = HDF5Dataset(out, normalize=True)
    flipped = HDF5Dataset(
        out,
        normalize=True,
        transform=lambda t: torch.flip(t, dims=[-1]),
        target_transform=lambda c: c + 10,
    )
    a, ya = plain[3]
    b, yb = flipped[3]
    assert torch.equal(b, torch.flip(a, dims=[-1])) and yb == ya + 10
    loader = torch.utils.data.DataLoader(flipped, batch_size=5)
    assert sum(len(yy) for _, yy in loader) == 20


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_workers_compute_the_same_statistics_as_one_process(mpi_tmp_path):
    from hybridagg.comm import Comm

    comm = Comm(name="test")
    path = mpi_tmp_path / "raw.h5"
    if comm.rank == 0 and not path.exists():
        rng = np.random.default_rng(3)
        x = (rng.random((3000, 3, 4, 4)) * [[[1]], [[10]], [[100]]]).astype(np.float32)
        raw_split_file(path, x, np.arange(3000) % 3)
    comm.barrier(what="file written")
    mean, std = compute_statistics(path, comm=comm)  # pieces of 16 MiB: few rows
    alone = compute_statistics(path)
    np.testing.assert_allclose(mean, alone[0], rtol=1e-6)
    np.testing.assert_allclose(std, alone[1], rtol=1e-6)
    same = comm.allgather((mean.tolist(), std.tolist()))
    assert all(v == same[0] for v in same)  # bit for bit on every worker
    # a missing file is the same error on every worker
    with pytest.raises(FileNotFoundError, match="does not exist"):
        compute_statistics(mpi_tmp_path / "nope.h5", comm=comm)
    comm.free()


# ------------------------------------------------------- training from such files
@pytest.fixture(scope="module")
def raw_digits(tmp_path_factory):
    """The digits in train and val groups with no attributes: no statistics."""
    from sklearn.datasets import load_digits

    d = load_digits()
    path = tmp_path_factory.mktemp("raw") / "raw.h5"
    cut = 1437
    with h5py.File(path, "w") as f:
        for split, rows in (("train", slice(0, cut)), ("val", slice(cut, None))):
            f[f"{split}/samples"] = d.data[rows].astype(np.float32)
            f[f"{split}/labels"] = d.target[rows].astype(np.int64)
    return path


def test_train_computes_the_statistics_a_file_lacks(raw_digits, tmp_path):
    args = ["--data", str(raw_digits), "--epochs", "4", "--no-progress"]
    refused = run_train(2, args)
    assert refused.returncode == 2, output(refused)[-2000:]
    assert "--normalize compute" in refused.stderr
    out = tmp_path / "s.json"
    result = run_train(3, [*args, "--normalize", "compute", "--summary", str(out)])
    assert result.returncode == 0, output(result)[-3000:]
    assert summary(out)["final_accuracy"] > 0.85  # chance is 0.1


def test_train_on_a_plain_file_names_the_conversion(tmp_path):
    plain_file(tmp_path / "plain.h5")
    result = run_train(2, ["--data", str(tmp_path / "plain.h5"), "--no-progress"])
    assert result.returncode == 2, output(result)[-2000:]
    assert "hybridagg convert --from hdf5" in result.stderr
    assert result.stderr.count("no split 'train'") == 1  # rank 0 says it, once
