"""What differs between a checkpoint's configuration and a resumed run's (pure logic).

A resumed run should continue the run it resumes, not quietly become another
one: a checkpoint of a run at ``--lr 0.1`` for 30 steps, resumed with
``--lr 0.05 --steps 100``, would be neither run. :func:`config_changes`
compares the configuration recorded in the manifest with this run's, field
by field, and sorts each difference into one of four kinds:

* **harmless** (:data:`HARMLESS`): fields that say how the run is observed,
  saved or executed, not what it learns: the metrics and summary files, the
  saved model, the TensorBoard folder, the log level, the
  progress bar, validation's cadence and target, the checkpoint folder
  (which may have been moved), checkpoint cadence and the resume flags
  themselves, the device, the all-reduce backend and ``--stream-push``
  (the same arithmetic, other hardware or another timing of the messages),
  ``--accumulate`` (the same update in fewer or more passes), the emulated slowdown (``--slowdown``, ``--sample-ms``:
  they change how long a step takes, as another machine would) and the
  batch probe (skipped on resume). They are not reported.
* **resharded** (:data:`RESHARDED`): ``--groups`` and ``--servers``. A run
  resumed on another topology has its state resharded; this check does not
  refuse them (whether the topology itself can be resumed is decided where
  the parts are loaded).
* **fixed** (:data:`FIXED`): ``--mode``. A checkpoint's parts are laid out
  by mode (sync: the model in rank 0's part; hybrid and async: shards on the
  servers), so no flag can accept such a change.
* **changed**: every other field: the data, the model, the optimizer and
  its hyperparameters, the batch size and the lr warm-up, the length
  (``--epochs``, ``--steps``), staleness handling, adaptive batching, the
  seed. Refused unless ``--accept-config-changes`` is given.

A field the checkpoint does not record (added to hybridagg after it was
written) counts as having had its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .fields import flag

__all__ = [
    "FIXED",
    "HARMLESS",
    "RESHARDED",
    "ConfigChange",
    "config_changes",
    "refusal",
]

HARMLESS = frozenset(
    {
        "metrics",
        "summary",
        "progress",
        "eval_every",
        "target_accuracy",
        "checkpoint",
        "checkpoint_every",
        "resume",
        "overwrite_checkpoints",
        "accept_config_changes",
        "device",
        "allreduce_backend",
        "stream_push",
        "accumulate",
        "slowdown",
        "sample_ms",
        "batch_probe",
        "save_model",
        "tensorboard",
        "log_level",
        "plan",  # what it sets is compared field by field
    }
)
"""Fields whose change does not change what the run learns (not reported)."""

RESHARDED = frozenset({"groups", "servers"})
"""Topology fields: a change is accepted (the state is resharded), and reported."""

FIXED = frozenset({"mode"})
"""Fields a resumed run can never change (the checkpoint's parts depend on them)."""

_UNRECORDED = object()


@dataclass(frozen=True)
class ConfigChange:
    """One field that differs between the checkpoint's run and this run.

    Attributes:
        field: The configuration field (``lr``).
        before: Its value in the checkpoint's run.
        after: Its value in this run.
        kind: ``"changed"``, ``"resharded"`` or ``"fixed"`` (see the module).
    """

    field: str
    before: Any
    after: Any
    kind: str

    def __str__(self) -> str:
        return f"{flag(self.field)}: was {_show(self.before)}, now {_show(self.after)}"


def _show(value: Any) -> str:
    if value is _UNRECORDED:
        return "not recorded"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _kind(name: str) -> str:
    if name in FIXED:
        return "fixed"
    if name in RESHARDED:
        return "resharded"
    return "changed"


def config_changes(
    before: Mapping[str, Any],
    after: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
) -> list[ConfigChange]:
    """The differences that matter between two flat configurations.

    Args:
        before: The configuration the checkpoint recorded (``cfg.as_dict()``).
        after: This run's.
        defaults: Each field's default: a field missing from ``before`` or
            ``after`` counts as its default (else as "not recorded").

    Returns:
        One :class:`ConfigChange` per differing field that is not
        :data:`HARMLESS`, in ``after``'s field order, then fields only
        ``before`` has.
    """
    defaults = defaults or {}
    names = list(after) + [k for k in before if k not in after]
    changes = []
    for name in names:
        if name in HARMLESS:
            continue
        old = before.get(name, defaults.get(name, _UNRECORDED))
        new = after.get(name, defaults.get(name, _UNRECORDED))
        if old != new:
            changes.append(ConfigChange(name, old, new, _kind(name)))
    return changes


def refusal(changes: list[ConfigChange], *, accept: bool, where: str) -> str | None:
    """Why a resume with ``changes`` must not start (``None``: it may).

    Args:
        changes: From :func:`config_changes`.
        accept: ``--accept-config-changes`` was given.
        where: The checkpoint, for the message.

    Returns:
        One message listing each refused difference as ``--flag: was X, now
        Y`` and the way out, or ``None``.
    """
    fixed = [c for c in changes if c.kind == "fixed"]
    if fixed:
        listed = "; ".join(map(str, fixed))
        return (
            f"cannot resume {where}: {listed} (a checkpoint's parts are laid out "
            "by mode; start a fresh run in another --checkpoint folder)"
        )
    changed = [c for c in changes if c.kind == "changed"]
    if changed and not accept:
        listed = "; ".join(map(str, changed))
        return (
            f"the configuration differs from the one {where} was written with: "
            f"{listed}. Pass --accept-config-changes to resume with these "
            "changes, or resume with the checkpoint's values"
        )
    return None
