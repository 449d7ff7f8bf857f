"""How a configuration field declares its flag and its checks; the concerns' base.

A field's name is its flag (:func:`flag`), its annotation the flag's type,
its default the flag's default, and the first paragraph of its docstring
the flag's help (:mod:`hybridagg.train.flags`). :func:`option` adds what
those cannot say: choices, a lower bound, a help text computed at import.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import MISSING, field, fields
from typing import Any, ClassVar

__all__ = ["Concern", "check_declared", "flag", "option"]


def flag(name: str) -> str:
    """The command-line flag of field ``name`` (``batch_size``: ``--batch-size``)."""
    return "--" + name.replace("_", "-")


def option(
    default: Any = MISSING,
    *,
    choices: Collection[str] | None = None,
    at_least: float | None = None,
    help: str | None = None,
    short: str | None = None,
) -> Any:
    """A field whose flag or check needs more than its name, type and default.

    Args:
        default: The default value (omit for a required field).
        choices: The only values allowed (checked here and by the parser).
        at_least: Lower bound, checked unless the value is ``None``.
        help: Help text computed at import (``--model`` lists the zoo); the
            docstring then stays the description for readers of the code.
        short: A one-letter alias of the flag besides its long name
            (``"-n"`` for ``hybridagg plan --workers``).

    Raises:
        ValueError: ``short`` is not a dash and one letter.
    """
    if short is not None and not (
        len(short) == 2 and short[0] == "-" and short[1].isalpha()
    ):
        raise ValueError(f"short must be a dash and one letter, got {short!r}")
    meta = {"choices": choices, "at_least": at_least, "help": help, "short": short}
    return field(
        default=default, metadata={k: v for k, v in meta.items() if v is not None}
    )


def check_declared(cfg: Any, concern: type) -> None:
    """The checks declared in ``concern``'s field metadata, on ``cfg``'s values.

    Every float value must also be finite: argparse's ``float`` takes
    ``nan`` and ``inf``, and comparisons with NaN are false, so a bound
    check alone lets ``--lr inf`` or ``--momentum nan`` through to a run that
    trains on NaN to the end.
    """
    for f in fields(concern):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag(f.name)} must be a finite number, got {value}")
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(
                f"{flag(f.name)} must be one of {', '.join(choices)}, got {value!r}"
            )
        low = f.metadata.get("at_least")
        if low is not None and value is not None and not value >= low:
            raise ValueError(f"{flag(f.name)} must be >= {low}, got {value}")


class Concern:
    """What every concern shares: its ``--help`` group and its own checks."""

    help_group: ClassVar[str]

    def __post_init__(self) -> None:
        check_declared(self, type(self))
        self._check()

    def _check(self) -> None:
        """Checks beyond the declared ones (none unless a concern adds them)."""
