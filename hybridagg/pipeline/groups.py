"""Which groups of a job are pipelines (pure logic).

``--pipeline-groups`` names them; every other group is one rank holding a
whole replica. The training run, the simulator and plan files check a job's
groups by these two functions, so the three agree on what a pipelined job is.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["layout_conflicts", "parse_pipeline_groups"]


def parse_pipeline_groups(spec: str | None, num_groups: int) -> tuple[int, ...]:
    """The groups ``--pipeline-groups`` names, ascending.

    Args:
        spec: ``all``, or group indices separated by commas (``0,2``);
            ``None``: none.
        num_groups: The job's groups.

    Raises:
        ValueError: An index that is not a group of the job, a repeated one,
            or a malformed spec.
    """
    if spec is None:
        return ()
    text = spec.strip()
    if text == "all":
        return tuple(range(num_groups))
    try:
        picked = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--pipeline-groups takes 'all' or group indices like 0,2; got {spec!r}"
        ) from None
    if len(set(picked)) != len(picked):
        raise ValueError(f"--pipeline-groups repeats a group: {spec!r}")
    bad = [g for g in picked if not 0 <= g < num_groups]
    if bad:
        raise ValueError(
            f"--pipeline-groups names group(s) {bad}; the job has groups "
            f"0-{num_groups - 1}"
        )
    return tuple(sorted(picked))


def layout_conflicts(
    groups: Sequence[Sequence[int]], pipelined: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The groups that break a pipelined job's layout: named groups of one
    rank (``lone``), and groups of several ranks not named (``wide``).

    Args:
        groups: Each group's ranks.
        pipelined: The indices of the groups that are pipelines.

    Returns:
        ``(lone, wide)``, both empty for a valid layout (each caller words
        its own error).
    """
    lone = [g for g in pipelined if len(groups[g]) < 2]
    wide = [
        g for g, ranks in enumerate(groups) if g not in pipelined and len(ranks) > 1
    ]
    return lone, wide
