"""``--plan FILE``: a plan from ``hybridagg plan`` as ``hybridagg train``'s options.

The plan sets the fields it chose and those its prediction was scored
under (:meth:`hybridagg.sim.planfile.Plan.settings`: mode, groups, servers,
batch size, adaptive batches, wire format, slowdown, sample-ms and, when
the profile named it, the optimizer) and, for ``hybridagg simulate``, its
``--ranks`` (the plan's ``ranks``: the job's size is part of the plan; a
run's size is checked at launch instead). A flag the user gave too must agree
with the plan, else it is an error naming both: a plan silently overridden
by a flag, or a flag silently overridden by a plan, would run a job nobody
chose (or one the prediction does not describe). Values are compared as
the job reads them (``--slowdown 2-3:4`` and ``0:1,2:4,3:4.0`` agree). Pure
logic apart from reading the file.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .fields import flag

__all__ = ["apply_plan"]


def apply_plan(values: dict[str, Any], given: Collection[str]) -> dict[str, Any]:
    """``values`` (a configuration's fields) with ``values["plan"]``'s settings.

    Args:
        values: The parsed options, by field name (``plan``: the file or ``None``).
        given: The fields the user gave on the command line.

    Raises:
        ValueError: The plan file is bad, or a given flag conflicts with it.
    """
    path = values.get("plan")
    if not path:
        return values
    from ...sim.planfile import load_plan

    plan = load_plan(path)
    settings = plan.settings()
    if "ranks" in values:  # hybridagg simulate: the plan's size, as mpiexec -n
        settings["ranks"] = plan.ranks
    out = dict(values)
    for name, wanted in settings.items():
        if name in given and not _same(name, values.get(name), wanted):
            shown = values.get(name)
            raise ValueError(
                f"--plan {path} sets {flag(name)} to {_show(wanted)}, but "
                f"{flag(name)} {_show(shown)} was given too; drop the flag or the plan"
            )
        out[name] = wanted
    return out


def _same(name: str, given: Any, wanted: Any) -> bool:
    if given == wanted:
        return True
    if name == "slowdown":
        from ...slowdown import parse_slowdown

        def slowed(spec: Any) -> list[tuple[float, dict[int, float]]]:
            phases = parse_slowdown(spec).phases
            return [(t, {r: f for r, f in fs.items() if f != 1.0}) for t, fs in phases]

        try:
            return slowed(given) == slowed(wanted)
        except ValueError:
            return False  # the configuration's own check names the bad spec
    if name == "sample_ms" and isinstance(given, (int, float)):
        return float(given) == float(wanted)
    return False


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)
