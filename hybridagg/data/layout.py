"""Where the channels of an image-shaped sample are: detected or stated (pure logic).

hybridagg's models and statistics take images channels first, ``(C, H, W)``
(PyTorch's NCHW). Arrays written by other tools are often channels last,
``(H, W, C)`` (NHWC: TensorFlow, Pillow, OpenCV). Converting such an array
without a word would give it statistics for ``W`` "channels" and a model
that convolves over the wrong axes, so the converter resolves the layout of
every 3-d sample first:

* ``"nchw"``: the first axis is the channels; kept as it is.
* ``"nhwc"``: the last axis is the channels; transposed to channels first.
* ``"auto"``: channels first if the first axis has 1, 3 or 4 entries and
  both others are larger; channels last if the last axis does and both
  others are larger; anything else is ambiguous and an error naming
  ``--layout``.

Samples that are not 3-d (vectors, 2-d images without a channel axis) have
no channel axis to find and are kept as they are under ``"auto"``.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "CHANNEL_COUNTS",
    "LAYOUTS",
    "channels_first_shape",
    "resolve_layout",
    "to_channels_first",
]

LAYOUTS = ("auto", "nchw", "nhwc")
CHANNEL_COUNTS = (1, 3, 4)
"""Channel counts ``"auto"`` recognises: grey, RGB, RGBA."""


def _looks_channels_first(shape: tuple[int, ...]) -> bool:
    c, h, w = shape
    return c in CHANNEL_COUNTS and h > c and w > c


def _looks_channels_last(shape: tuple[int, ...]) -> bool:
    h, w, c = shape
    return c in CHANNEL_COUNTS and h > c and w > c


def resolve_layout(sample_shape: tuple[int, ...], layout: str = "auto") -> str | None:
    """The layout of samples of ``sample_shape``: ``"nchw"``, ``"nhwc"`` or ``None``.

    Args:
        sample_shape: The shape of one sample (without the sample axis).
        layout: ``"auto"``, ``"nchw"`` or ``"nhwc"``.

    Returns:
        ``"nchw"`` or ``"nhwc"`` for a 3-d sample; ``None`` (nothing to
        transpose) for samples of other ranks under ``"auto"``.

    Raises:
        ValueError: An unknown ``layout``; a stated layout for samples that
            are not 3-d; under ``"auto"``, a 3-d shape that is neither or
            both (the message names ``--layout``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    shape = tuple(int(s) for s in sample_shape)
    if len(shape) != 3:
        if layout != "auto":
            raise ValueError(
                f"--layout {layout} needs image samples of 3 axes, got samples of "
                f"shape {shape}"
            )
        return None
    if layout != "auto":
        return layout
    first, last = _looks_channels_first(shape), _looks_channels_last(shape)
    if first != last:
        return "nchw" if first else "nhwc"
    raise ValueError(
        f"samples of shape {shape}: cannot tell where the channels are (channels "
        f"first need {'/'.join(map(str, CHANNEL_COUNTS))} leading entries and larger "
        "height and width, channels last the same at the end); pass --layout nchw "
        "(channels first, (C, H, W)) or --layout nhwc (channels last, (H, W, C))"
    )


def to_channels_first(x: np.ndarray, layout: str | None) -> np.ndarray:
    """A batch ``x`` of samples in ``layout``, as contiguous channels-first samples.

    Args:
        x: ``(n, *sample_shape)``.
        layout: What :func:`resolve_layout` returned for the samples.
    """
    if layout != "nhwc":
        return x
    return np.ascontiguousarray(np.moveaxis(x, -1, 1))


def channels_first_shape(sample_shape: tuple[int, ...], layout: str | None) -> tuple:
    """The shape of one sample after :func:`to_channels_first`."""
    shape = tuple(int(s) for s in sample_shape)
    if layout != "nhwc":
        return shape
    h, w, c = shape
    return (c, h, w)
