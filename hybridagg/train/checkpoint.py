"""Checkpoints that survive a kill at any moment.

Layout of a checkpoint directory::

    DIR/ckpt-000003/manifest.json   what run wrote it, when, which ranks
    DIR/ckpt-000003/rank-00000.pt   each rank's part (torch.save of tensors,
    DIR/ckpt-000003/rank-00004.pt   numbers and lists only)
    DIR/latest                      "ckpt-000003"

Each rank writes its part into ``DIR/.staging-000003/`` (to a temporary
name, flushed and fsynced, then renamed). When every part is written, one
rank (rank 0 in sync mode, server 0 otherwise) writes the manifest, renames
the staging directory to ``ckpt-000003`` and then replaces ``latest``
atomically. A kill at any moment therefore leaves the previous checkpoint
whole and ``latest`` pointing at it; a half-written staging directory is
ignored and removed by the next run. Loading uses
``torch.load(weights_only=True)``: no arbitrary object is ever unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..runtime import envvars

__all__ = ["Checkpointer", "latest_checkpoint", "load_part", "read_manifest"]

_KEEP = 2


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault(number: int, rank: int) -> bool:
    """Test hook: ``HYBRIDAGG_FAULT=checkpoint:N:R`` kills rank R in checkpoint N."""
    spec = envvars.get_str("HYBRIDAGG_FAULT")
    if not spec or not spec.startswith("checkpoint:"):
        return False
    _, n, r = spec.split(":")
    return int(n) == number and int(r) == rank


class Checkpointer:
    """Writes this rank's parts of checkpoints under ``root``."""

    def __init__(self, root: str | os.PathLike, rank: int) -> None:
        self.root = Path(root)
        self.rank = rank
        self.root.mkdir(parents=True, exist_ok=True)

    def staging(self, number: int) -> Path:
        return self.root / f".staging-{number:06d}"

    def final(self, number: int) -> Path:
        return self.root / f"ckpt-{number:06d}"

    def write(self, number: int, state: dict[str, Any]) -> Path:
        """Write this rank's part of checkpoint ``number``; durable on return."""
        stage = self.staging(number)
        stage.mkdir(parents=True, exist_ok=True)
        path = stage / f"rank-{self.rank:05d}.pt"
        tmp = stage / f".rank-{self.rank:05d}.pt.tmp"
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            if _fault(number, self.rank):
                fh.flush()
                fh.truncate(max(1, fh.tell() // 2))
                os._exit(17)  # an injected crash in the middle of the write
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return path

    def commit(self, number: int, manifest: dict[str, Any]) -> Path:
        """Publish checkpoint ``number`` (call once every part is written)."""
        stage = self.staging(number)
        stage.mkdir(parents=True, exist_ok=True)
        manifest = {**manifest, "number": number, "time": time.time()}
        with open(stage / "manifest.json", "w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(stage)
        final = self.final(number)
        if final.exists():
            shutil.rmtree(final)
        os.replace(stage, final)
        tmp = self.root / ".latest.tmp"
        tmp.write_text(final.name + "\n")
        with open(tmp) as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.root / "latest")
        _fsync_dir(self.root)
        self._prune(number)
        return final

    def remove_stale(self) -> None:
        """Remove staging directories left by a run that was killed (call before writing)."""
        for stage in self.root.glob(".staging-*"):
            shutil.rmtree(stage, ignore_errors=True)

    def _prune(self, newest: int) -> None:
        done = sorted(self.root.glob("ckpt-*"))
        for old in done[:-_KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        for stage in self.root.glob(".staging-*"):
            if int(stage.name.split("-")[1]) <= newest:
                shutil.rmtree(stage, ignore_errors=True)


def read_manifest(path: Path) -> dict:
    """The manifest of a checkpoint directory.

    Raises:
        ValueError: It is missing or unreadable.
    """
    try:
        return json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint {path} has no readable manifest: {exc}") from None


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest committed checkpoint under ``root`` (``None``: there is none)."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.exists():
        path = root / pointer.read_text().strip()
        if (path / "manifest.json").exists():
            return path
    done = [p for p in sorted(root.glob("ckpt-*")) if (p / "manifest.json").exists()]
    return done[-1] if done else None


def load_part(path: Path, rank: int) -> dict | None:
    """A rank's part of a checkpoint (``None`` if that rank wrote none)."""
    part = path / f"rank-{rank:05d}.pt"
    if not part.exists():
        return None
    try:
        return torch.load(part, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise ValueError(f"checkpoint part {part} cannot be loaded: {exc}") from None
