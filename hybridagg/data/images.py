"""A folder of images, one sub-folder per class, as a converter :class:`~.sources.Source`.

The layout torchvision's ``ImageFolder`` reads::

    DIR/cat/0001.png
    DIR/cat/more/0002.jpg     (files in nested folders count for their class)
    DIR/dog/0003.png

Class names are the sub-folders' names, sorted; label ``i`` is the ``i``-th
name, and the converter writes the names into the file (``class_names``) so
labels can be mapped back. Images are decoded with Pillow (the ``images``
extra: ``pip install hybridagg[images]``), stored as ``uint8`` channels
first: one channel if every image is greyscale, else three (RGB; alpha is
dropped). Every image must have one size, or ``size`` resizes them all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.extras import require

__all__ = ["ImageFolder", "parse_size"]

# Pillow modes stored as one grey channel; every other mode becomes RGB.
_GREY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "F"})


def parse_size(text: str) -> tuple[int, int]:
    """``"HxW"`` (or one number for a square) as ``(height, width)``.

    Raises:
        ValueError: Not two positive integers.
    """
    parts = str(text).lower().replace(",", "x").split("x")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or min(values) < 1:
        raise ValueError(f"--size must be HxW (e.g. 32x32) or one number, got {text!r}")
    return values[0], values[1]


def _pil() -> Any:
    return require("PIL.Image", "converting a folder of images")


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


class ImageFolder:
    """The images of class sub-folders of ``root``.

    Scanning opens every image's header (not its pixels): a file Pillow
    cannot read, mixed sizes without ``size``, a class with no image, or
    images lying beside the class folders are errors naming the file or
    folder. Files whose extension Pillow does not know, and hidden files,
    are not images and are skipped.

    Args:
        root: The folder.
        size: ``(height, width)`` every image is resized to (bilinear), or
            ``None`` to keep them as they are (they must agree).
        classes: Class names whose order fixes the labels (a validation or
            test folder takes the training folder's; it may lack some);
            default: ``root``'s sub-folders, sorted.
        channels: 1 or 3, or ``None`` to choose (1 if every image is grey).

    Attributes:
        name, labels, sample_shape, dtype: As :class:`~.sources.Source`.
        class_names: The class names, in label order.
        files: Every image, in label then path order.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        ValueError: Anything else wrong with the folder (named).
        ImportError: Pillow is not installed.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        size: tuple[int, int] | None = None,
        classes: list[str] | None = None,
        channels: int | None = None,
    ) -> None:
        image = _pil()
        self.root = root = Path(root)
        self.name = str(root)
        if not root.exists():
            raise FileNotFoundError(f"image folder {root} does not exist")
        if not root.is_dir():
            raise ValueError(
                f"{root} is not a folder; --from folder takes a folder with one "
                "sub-folder of images per class"
            )
        known = {ext.lower() for ext in image.registered_extensions()}
        found = sorted(
            p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
        )
        loose = [
            p.name
            for p in root.iterdir()
            if p.is_file() and p.suffix.lower() in known and not p.name.startswith(".")
        ]
        if loose:
            raise ValueError(
                f"image folder {root} holds images beside its class folders "
                f"({', '.join(sorted(loose)[:3])}...); put each class's images in "
                f"a sub-folder {root}/CLASS/"
            )
        if not found:
            raise ValueError(
                f"image folder {root} has no class sub-folders; put each class's "
                f"images in a sub-folder {root}/CLASS/"
            )
        self.class_names = list(found) if classes is None else list(classes)
        index = {c: i for i, c in enumerate(self.class_names)}
        unknown = [c for c in found if c not in index]
        if unknown:
            raise ValueError(
                f"image folder {root} has classes {unknown} that the training data "
                f"lacks (it has {self.class_names})"
            )
        files: list[Path] = []
        labels: list[int] = []
        for c in found:
            mine = sorted(
                p
                for p in (root / c).rglob("*")
                if p.is_file() and p.suffix.lower() in known and not _hidden(p, root)
            )
            if not mine:
                raise ValueError(f"class folder {root / c} holds no image")
            files += mine
            labels += [index[c]] * len(mine)
        self.files = files
        self.labels = np.asarray(labels, dtype=np.int64)
        sizes, grey = self._scan(image)
        if size is None:
            if len(sizes) > 1:
                (a, pa), (b, pb) = sorted(sizes.items())[:2]
                raise ValueError(
                    f"images of {root} differ in size: {pa} is {a[0]}x{a[1]}, {pb} "
                    f"is {b[0]}x{b[1]} (height x width); pass --size HxW to resize "
                    "them all"
                )
            size = next(iter(sizes))
        if channels is None:
            channels = 1 if grey else 3
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels}")
        self.size = (int(size[0]), int(size[1]))
        self.mode = "L" if channels == 1 else "RGB"
        self.sample_shape = (channels, *self.size)
        self.dtype = np.dtype(np.uint8)

    def _scan(self, image: Any) -> tuple[dict[tuple[int, int], Path], bool]:
        """Each size found (with one file of it), and whether every image is grey."""
        sizes: dict[tuple[int, int], Path] = {}
        grey = True
        for p in self.files:
            try:
                with image.open(p) as im:
                    w, h = im.size
                    mode = im.mode
            except (OSError, ValueError, image.DecompressionBombError) as exc:
                raise ValueError(f"image {p} cannot be read: {exc}") from None
            sizes.setdefault((h, w), p)
            grey = grey and mode in _GREY_MODES
        return sizes, grey

    def __len__(self) -> int:
        return len(self.files)

    def read(self, idx: np.ndarray) -> np.ndarray:
        """The images at ``idx``, ``(len(idx), C, H, W)`` uint8."""
        image = _pil()
        out = np.empty((len(idx), *self.sample_shape), dtype=np.uint8)
        h, w = self.size
        for k, i in enumerate(np.asarray(idx, dtype=np.int64)):
            p = self.files[int(i)]
            try:
                with image.open(p) as im:
                    im = im.convert(self.mode)
                    if im.size != (w, h):
                        im = im.resize((w, h), image.Resampling.BILINEAR)
                    a = np.asarray(im, dtype=np.uint8)
            except (OSError, ValueError) as exc:
                raise ValueError(f"image {p} cannot be decoded: {exc}") from None
            out[k] = a[None] if a.ndim == 2 else np.moveaxis(a, -1, 0)
        return out
