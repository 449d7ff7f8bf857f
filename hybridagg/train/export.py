"""``--save-model PATH``: the trained model as a plain ``state_dict`` file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["check_destination", "save_state_dict"]


def check_destination(path: str | os.PathLike) -> Path:
    """Check at set-up that ``path`` can be written (its folder is created).

    Raises:
        ValueError: ``path`` is a directory, or its folder is not writable.
        OSError: Its folder cannot be created.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(
            f"--save-model {p} is a directory; give a file name like model.pt"
        )
    p.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(p.parent, os.W_OK):
        raise ValueError(f"--save-model {p}: folder {p.parent} is not writable")
    return p


def save_state_dict(state: dict[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """Write ``state`` with ``torch.save``, whole or not at all.

    Written to ``PATH.partial`` and renamed, so a job killed while writing
    leaves the previous file (or none), never a truncated one.
    """
    p = check_destination(path)
    tmp = p.with_name(p.name + ".partial")
    try:
        torch.save(state, tmp)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return p
