"""MNIST-1D as a hybridagg data file: a task harder than the digits.

Greydanus's MNIST-1D (the ``mnist1d`` package on PyPI) draws each sample
from one of ten 1-D templates, padded, shifted, sheared, scaled and noised:
40 values per sample. It is generated here, not downloaded (the package's
``get_dataset`` fetches a pickle from GitHub; ``make_dataset`` builds the
same kind of data locally). A small MLP reaches about 0.75 on it where it
reaches 0.97 on the digits, so modes and wire formats can differ in
accuracy::

    pip install mnist1d
    python bench/mnist1d_data.py --out runs/mnist1d.h5 --samples 12000
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

__all__ = ["to_arrays"]


def to_arrays(data: dict) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``(N, 1, 40)`` float32 and labels ``(N,)`` int64 from ``make_dataset``'s dict.

    The package's train and test parts are joined: hybridagg cuts its own
    validation split.
    """
    x = np.concatenate([data["x"], data["x_test"]]).astype(np.float32)
    y = np.concatenate([data["y"], data["y_test"]]).astype(np.int64)
    if x.ndim != 2 or len(x) != len(y):
        raise ValueError(
            f"expected (N, L) samples and N labels, got {x.shape}, {y.shape}"
        )
    return x[:, None, :], y


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/mnist1d.h5")
    p.add_argument("--samples", type=int, default=12000, help="train and test together")
    p.add_argument("--seed", type=int, default=42, help="the generator's seed")
    args = p.parse_args(argv)
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise SystemExit("mnist1d is not installed: pip install mnist1d") from None
    from hybridagg.data.convert import convert_arrays

    settings = get_dataset_args()
    settings.num_samples = args.samples
    settings.seed = args.seed
    x, y = to_arrays(make_dataset(settings))
    convert_arrays(x, y, args.out, num_classes=10, source="mnist1d")
    print(f"wrote {args.out}: {len(x)} samples of {x.shape[1:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
