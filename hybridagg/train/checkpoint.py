"""Checkpoints that survive a kill at any moment and never mix two runs.

Layout of a checkpoint directory::

    DIR/ckpt-000003/manifest.json   which run wrote it (run id, configuration),
                                    its commit sequence, which ranks
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

**Runs.** Every manifest names the run that wrote it (``run_id``, chosen
once by a fresh run and kept by every resume of it) and carries a
``sequence``: one more than the highest sequence in the directory when it
was committed. Commit order is the sequence, not the directory's name: a
fresh run numbers its checkpoints from 1 again. Pruning keeps the newest
:data:`KEEP` of the committing run's own checkpoints and never touches
another run's, so ``latest`` (always the committing run's newest) never
names a missing directory. A checkpoint whose manifest cannot be read
belongs to no known run and is left alone.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..runtime import envvars

__all__ = [
    "KEEP",
    "UNNAMED_RUN",
    "Checkpointer",
    "Entry",
    "latest_checkpoint",
    "load_part",
    "new_run_id",
    "read_manifest",
    "resume_candidates",
    "run_of",
    "scan",
]

KEEP = 2
"""Checkpoints of a run kept on disk: the newest and, should it not load, the one before."""

UNNAMED_RUN = "unnamed"
"""The run of a manifest that names none (written before runs had ids)."""


def new_run_id() -> str:
    """A fresh run's id: when it started (readable, sortable) and 24 random bits."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def run_of(manifest: dict) -> str:
    """The id of the run that wrote ``manifest``."""
    return str(manifest.get("run_id") or UNNAMED_RUN)


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


@dataclass(frozen=True)
class Entry:
    """A committed checkpoint directory and what its manifest says.

    Attributes:
        path: The directory (``DIR/ckpt-000003``).
        manifest: Its manifest (``None``: unreadable).
        error: Why the manifest cannot be read (``None``: it can).
    """

    path: Path
    manifest: dict | None
    error: str | None = None

    @property
    def run(self) -> str | None:
        """The run that wrote it (``None``: unknown, the manifest is unreadable)."""
        return None if self.manifest is None else run_of(self.manifest)

    @property
    def order(self) -> tuple[int, float, str]:
        """Its place in commit order (larger is newer; unreadable ones first)."""
        m = self.manifest or {}
        seq = m.get("sequence")
        return (
            seq if isinstance(seq, int) else -1,
            float(m.get("time") or 0.0),
            self.path.name,
        )


def scan(root: str | os.PathLike) -> list[Entry]:
    """Every committed checkpoint under ``root``, oldest first in commit order."""
    root = Path(root)
    if not root.is_dir():
        return []
    entries = []
    for path in root.glob("ckpt-*"):
        if not path.is_dir():
            continue
        try:
            entries.append(Entry(path, read_manifest(path)))
        except ValueError as exc:
            entries.append(Entry(path, None, str(exc)))
    return sorted(entries, key=lambda e: e.order)


class Checkpointer:
    """Writes this rank's parts of checkpoints of run ``run_id`` under ``root``.

    Args:
        root: The checkpoint directory (created if missing).
        rank: This rank (names its part).
        run_id: The run the checkpoints belong to (:func:`new_run_id`, or
            the resumed run's).
        replace_others: At the first commit, delete every checkpoint of
            another run in ``root`` (``--overwrite-checkpoints``).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        rank: int,
        run_id: str,
        *,
        replace_others: bool = False,
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        self.run_id = run_id
        self.replace_others = replace_others
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
        entries = scan(self.root)
        sequence = 1 + max((e.order[0] for e in entries), default=0)
        manifest = {
            **manifest,
            "run_id": self.run_id,
            "number": number,
            "sequence": max(sequence, 1),
            "time": time.time(),
        }
        with open(stage / "manifest.json", "w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(stage)
        final = self.final(number)
        if final.exists():
            # this run's own: a checkpoint that did not load and was resumed
            # from the one before, or (with replace_others) another run's
            shutil.rmtree(final)
        os.replace(stage, final)
        tmp = self.root / ".latest.tmp"
        tmp.write_text(final.name + "\n")
        with open(tmp) as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.root / "latest")
        _fsync_dir(self.root)
        if self.replace_others:
            # only now: a run that fails before its first checkpoint leaves
            # the other run's checkpoints, and `latest` naming one, intact
            self.replace_others = False
            for entry in scan(self.root):
                if entry.run != self.run_id:
                    shutil.rmtree(entry.path, ignore_errors=True)
        self._prune(number)
        return final

    def remove_stale(self) -> None:
        """Remove staging directories left by a run that was killed (call before writing)."""
        for stage in self.root.glob(".staging-*"):
            shutil.rmtree(stage, ignore_errors=True)

    def _prune(self, newest: int) -> None:
        mine = [e for e in scan(self.root) if e.run == self.run_id]
        for old in mine[:-KEEP]:
            shutil.rmtree(old.path, ignore_errors=True)
        for stage in self.root.glob(".staging-*"):
            if int(stage.name.split("-")[1]) <= newest:
                shutil.rmtree(stage, ignore_errors=True)


def read_manifest(path: Path) -> dict:
    """The manifest of a checkpoint directory.

    Raises:
        ValueError: It is missing or unreadable.
    """
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint {path} has no readable manifest: {exc}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"checkpoint {path} has no readable manifest: not an object")
    return manifest


def _pointed(root: Path) -> Path | None:
    """The directory ``latest`` names, if it exists."""
    try:
        name = (root / "latest").read_text().strip()
    except OSError:
        return None
    path = root / name
    return path if name.startswith("ckpt-") and path.is_dir() else None


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest committed checkpoint under ``root`` (``None``: there is none).

    ``latest`` if it names a checkpoint whose manifest can be read, else the
    newest such checkpoint in commit order.
    """
    root = Path(root)
    pointed = _pointed(root)
    if pointed is not None:
        try:
            read_manifest(pointed)
            return pointed
        except ValueError:
            pass
    readable = [e for e in scan(root) if e.manifest is not None]
    return readable[-1].path if readable else None


def resume_candidates(root: str | os.PathLike) -> list[Entry]:
    """The checkpoints ``--resume`` tries, in order, until one loads.

    The run to continue is the one whose readable checkpoint is the newest
    in commit order; its checkpoints follow, newest first. If ``latest``
    names a checkpoint whose manifest cannot be read (so whose run is
    unknown), it comes first: it is the newest, and the reason it fails is
    worth a warning. Other runs' checkpoints are never candidates.
    """
    root = Path(root)
    entries = scan(root)
    pointed = _pointed(root)
    first = [e for e in entries if e.manifest is None and e.path == pointed]
    readable = [e for e in reversed(entries) if e.manifest is not None]
    if not readable:
        return first
    run = readable[0].run
    return first + [e for e in readable if e.run == run]


def load_part(path: Path, rank: int) -> dict | None:
    """A rank's part of a checkpoint (``None`` if that rank wrote none).

    Raises:
        ValueError: The part exists but cannot be loaded (truncated, corrupt).
    """
    part = path / f"rank-{rank:05d}.pt"
    if not part.exists():
        return None
    try:
        state = torch.load(part, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise ValueError(
            f"checkpoint part {part} cannot be loaded: {_reason(exc)}"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint part {part} cannot be loaded: not a dict")
    return state


def _reason(exc: Exception) -> str:
    """torch.load's error, short: its advice (load with ``weights_only=False``) is wrong here."""
    text = str(exc)
    detail = re.search(r"WeightsUnpickler error:\s*(.+?)\n", text)
    if detail:
        return f"corrupt or not tensors only ({detail.group(1).strip()})"
    first = text.split(". ")[0].strip()
    return first or type(exc).__name__
