"""What a run does when a rank dies (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .fields import Concern, option

__all__ = ["ON_GROUP_FAILURE", "FailureOptions"]

ON_GROUP_FAILURE = ("abort", "continue")


@dataclass(frozen=True, kw_only=True)
class FailureOptions(Concern):
    """When a rank dies: end the job, or drop its group and go on."""

    help_group: ClassVar[str] = "how to aggregate"

    on_group_failure: str = option("abort", choices=ON_GROUP_FAILURE)
    """abort: a dead rank ends the job (exit 5); continue (hybrid, async; needs
    MPI with ULFM, mpirun --with-ft ulfm): the servers drop the dead rank's
    group and the other groups train to the end (exit 4)"""

    @property
    def survives_group_loss(self) -> bool:
        """Whether a lost group is dropped and the others go on."""
        return self.on_group_failure == "continue"
