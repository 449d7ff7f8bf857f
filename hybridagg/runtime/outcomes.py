"""How a run of ``hybridagg train`` ends: its exit codes and the errors behind them.

Every rank of a job exits with one of these codes, so a batch script (or a
test) can tell a finished run from one that stopped on bad numbers, lost a
group and went on, or was aborted. Under a launcher that keeps the job alive
after a rank dies (``mpirun --with-ft ulfm``) the launcher's own exit code
says little; each rank's code and the summary's ``outcome`` say what
happened. The codes are pure data: no torch, no MPI.
"""

from __future__ import annotations

import enum

__all__ = [
    "ExitCode",
    "GroupLost",
    "NonFiniteError",
    "PeerFailure",
    "exit_code_of",
]


class ExitCode(enum.IntEnum):
    """The exit code of one rank of ``hybridagg train``."""

    FINISHED = 0
    """Trained to the end; no group was lost."""
    INTERNAL = 1
    """An unexpected error (a bug): a Python traceback says where."""
    BAD_INPUT = 2
    """A bad option, environment variable, data file, model or checkpoint,
    found before training (or a set-up phase) and reported by rank 0."""
    NON_FINITE = 3
    """Stopped: the loss, a gradient or an update was not finite (NaN or
    infinite); the message names the step. Every rank stops, servers too."""
    FINISHED_WITH_LOSSES = 4
    """Trained to the end with ``--on-group-failure continue`` after losing
    one or more groups (the summary's ``lost_groups`` lists them)."""
    ABORTED = 5
    """Aborted: a peer died, hung or timed out (or a server was lost); the
    message names the rank. Resume from the last checkpoint."""
    GROUP_LOST = 6
    """This rank survived but its group was dropped after one of its members
    died (``--on-group-failure continue``); the other groups went on."""


class NonFiniteError(ArithmeticError):
    """The loss, the reduced gradient or an update was NaN or infinite.

    Args:
        message: What was not finite, naming the step (and the group or rank
            where that is known).
    """

    exit_code = ExitCode.NON_FINITE


class PeerFailure(RuntimeError):
    """A peer rank died, stopped answering or was lost; the job is aborted.

    Args:
        message: What failed, naming the rank(s).
        ranks: The world ranks found dead or stuck (empty: unknown).
    """

    exit_code = ExitCode.ABORTED

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class GroupLost(RuntimeError):
    """This rank's group was dropped after one of its members died.

    Args:
        message: Which member died, and when.
        group: The group's id.
        ranks: The world ranks of the group found dead.
    """

    exit_code = ExitCode.GROUP_LOST

    def __init__(self, message: str, group: int, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.group = group
        self.ranks = tuple(ranks)


def exit_code_of(error: BaseException) -> ExitCode:
    """The exit code a rank uses when ``error`` ends its run."""
    code = getattr(error, "exit_code", None)
    if isinstance(code, ExitCode):
        return code
    if isinstance(error, (ValueError, TypeError, OSError)):
        return ExitCode.BAD_INPUT
    return ExitCode.INTERNAL
