"""``hybridagg simulate`` and ``hybridagg profile``: their configurations.

:class:`SimulateConfig` is :class:`~hybridagg.train.config.TrainConfig` (every
training flag, checked the same way) with ``--data`` made optional (a
simulation reads no data; the file, when given, tells the epoch's size) and
:class:`SimulationOptions` added. :class:`ProfileConfig` is the model and
optimizer concerns with :class:`ProfileOptions`. Pure logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from . import TrainConfig
from .fields import Concern, check_declared, option
from .training import ModelOptions, OptimOptions

__all__ = [
    "PROFILE_CONCERNS",
    "SIMULATE_CONCERNS",
    "ProfileConfig",
    "ProfileOptions",
    "SimulateConfig",
    "SimulationOptions",
]


@dataclass(frozen=True, kw_only=True)
class SimulationOptions(Concern):
    """What to simulate on: the cluster, the profile, and where the prediction goes."""

    help_group: ClassVar[str] = "simulation"

    profile: str
    """profile file from 'hybridagg profile' (what the model needs)"""

    cluster: str | None = None
    """cluster file (YAML, JSON or TOML; default: this machine as profiled,
    with --ranks ranks)"""

    ranks: int | None = option(None, at_least=2)
    """ranks of the job, servers included, as mpiexec -n would give them
    (with --cluster: the cluster cut down to this many workers plus the
    servers, each node type keeping its share; default: every device)"""

    samples: int | None = option(None, at_least=1)
    """training samples per epoch, for --epochs (default: --data's training
    split)"""

    json: str | None = None
    """also write the prediction to this JSON file"""

    sim_timeout: float = option(600.0, at_least=1)
    """seconds the simulation may run before it is stopped"""


@dataclass(frozen=True, kw_only=True)
class SimulateConfig(SimulationOptions, TrainConfig):
    """``hybridagg simulate``'s options (see ``hybridagg simulate --help``).

    Raises:
        ValueError: A bad value, naming its flag.
    """

    data: str | None = option(
        None,
        help="HDF5 file from 'hybridagg convert' (only its size is read, for --epochs)",
    )

    def __post_init__(self) -> None:
        TrainConfig.__post_init__(self)
        check_declared(self, SimulationOptions)
        SimulationOptions._check(self)
        if self.cluster is None and self.ranks is None:
            raise ValueError(
                "give --cluster FILE, or --ranks N to simulate this machine"
            )


SIMULATE_CONCERNS: tuple[type, ...] = (SimulationOptions, *TrainConfig.__bases__[::-1])
"""The concerns of ``hybridagg simulate``, in the order of its ``--help``."""


@dataclass(frozen=True, kw_only=True)
class ProfileOptions(Concern):
    """What to profile and where the profile goes."""

    help_group: ClassVar[str] = "profile"

    out: str
    """profile file to write (JSON)"""

    data: str | None = None
    """HDF5 file from 'hybridagg convert': the sample shape and the classes"""

    sample_shape: str | None = None
    """one sample's shape without --data, e.g. 3,32,32"""

    classes: int | None = option(None, at_least=1)
    """number of classes without --data"""

    reps: int = option(5, at_least=1)
    """timed repetitions of each measurement (the median is kept)"""

    def _check(self) -> None:
        if self.data is None and (self.sample_shape is None or self.classes is None):
            raise ValueError("give --data FILE.h5, or --sample-shape and --classes")
        if self.sample_shape is not None:
            self.parsed_shape()

    def parsed_shape(self) -> tuple[int, ...]:
        """``--sample-shape`` as a tuple of positive integers."""
        try:
            shape = tuple(int(s) for s in str(self.sample_shape).split(","))
        except ValueError:
            shape = ()
        if not shape or any(s < 1 for s in shape):
            raise ValueError(
                f"--sample-shape must be positive integers with commas, got "
                f"{self.sample_shape!r}"
            )
        return shape


@dataclass(frozen=True, kw_only=True)
class ProfileConfig(ProfileOptions, OptimOptions, ModelOptions):
    """``hybridagg profile``'s options.

    Raises:
        ValueError: A bad value, naming its flag.
    """

    def __post_init__(self) -> None:
        for concern in PROFILE_CONCERNS:
            check_declared(self, concern)
            concern._check(self)


PROFILE_CONCERNS: tuple[type, ...] = (ModelOptions, OptimOptions, ProfileOptions)
"""The concerns of ``hybridagg profile``, in the order of its ``--help``."""
