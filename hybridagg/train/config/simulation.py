"""``hybridagg simulate``, ``profile`` and ``plan``: their configurations.

:class:`SimulateConfig` is :class:`~hybridagg.train.config.TrainConfig` (every
training flag, checked the same way) with ``--data`` made optional (a
simulation reads no data; the file, when given, tells the epoch's size) and
:class:`SimulationOptions` added. :class:`ProfileConfig` is the model and
optimizer concerns with :class:`ProfileOptions`. :class:`PlanConfig` is
:class:`PlanOptions` with the optimizer's concern (the planner chooses mode,
groups, servers and batches itself; the optimizer is what the servers run).
Pure logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ...devices import check_device_spec
from . import CONCERNS, TrainConfig
from .aggregation import WIRE_FORMATS
from .compute import AMP_MODES
from .fields import Concern, check_declared, option
from .training import ModelOptions, OptimOptions

__all__ = [
    "PLAN_CONCERNS",
    "PROFILE_CONCERNS",
    "SIMULATE_CONCERNS",
    "PlanConfig",
    "PlanOptions",
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
    with --ranks ranks); with --plan, the plan's cluster file, of which the
    plan's nodes are simulated (another cluster is refused)"""

    ranks: int | None = option(None, at_least=2)
    """ranks of the job, servers included, as mpiexec -n would give them
    (with --cluster: the cluster cut down to this many workers plus the
    servers, each node type keeping its share; default: every device; with
    --plan: the plan's ranks, and another number is refused)"""

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
        if self.cluster is None and self.ranks is None:  # (--plan sets --ranks)
            raise ValueError(
                "give --cluster FILE, --ranks N to simulate this machine, or "
                "--plan FILE"
            )


def calibration_files(value: str | None) -> list[str]:
    """A comma-separated list of files (``None``: none)."""
    return [f for f in (value or "").split(",") if f]


SIMULATE_CONCERNS: tuple[type, ...] = (SimulationOptions, *CONCERNS)
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

    device: str = "cpu"
    """where the model's compute is timed, as hybridagg train's --device: cpu,
    cuda (the node-local GPU), cuda:N, or auto (a GPU where there is one,
    else the CPU); CUDA is synchronised before each reading of the clock"""

    amp: str = option("none", choices=AMP_MODES)
    """mixed precision of the timed forward, as hybridagg train's --amp: none,
    bf16, or fp16 (CUDA only)"""

    calibrate_allreduce: str | None = None
    """bench/allreduce.py --json outputs (comma-separated; e.g. one per
    mpiexec -n): the simulator's all-reduce and copies are fitted on them"""

    calibrate_ps: str | None = None
    """bench/ps.py --json outputs (comma-separated): a server's update and a
    leader's transfer to it are fitted on them"""

    calibrate_network: str | None = None
    """bench/allreduce.py --json outputs measured across a cluster's nodes
    (hybridagg-run --cluster, or mpiexec over its hosts; comma-separated):
    the latency between its nodes and the bandwidth its core switch shares
    are fitted on them, for --network-cluster"""

    network_cluster: str | None = None
    """the cluster file describing where --calibrate-network ran (its ranks
    on the file's devices in order); hybridagg simulate --cluster with a
    file of the same name then uses the fit"""

    def _check(self) -> None:
        if self.data is None and (self.sample_shape is None or self.classes is None):
            raise ValueError("give --data FILE.h5, or --sample-shape and --classes")
        for flag, files in (
            ("--calibrate-allreduce", self.calibrate_allreduce),
            ("--calibrate-ps", self.calibrate_ps),
            ("--calibrate-network", self.calibrate_network),
        ):
            for name in calibration_files(files):
                if not Path(name).is_file():
                    raise ValueError(f"{flag}: {name} is not a file")
        if (self.calibrate_network is None) != (self.network_cluster is None):
            raise ValueError(
                "--calibrate-network and --network-cluster go together (the "
                "all-reduce across a cluster, and that cluster's file)"
            )
        if (
            self.network_cluster is not None
            and not Path(self.network_cluster).is_file()
        ):
            raise ValueError(f"--network-cluster: {self.network_cluster} is not a file")
        if self.sample_shape is not None:
            self.parsed_shape()
        check_device_spec(self.device)  # the spelling; whether CUDA is there, later
        if self.amp == "fp16" and self.device == "cpu":
            raise ValueError(
                "--amp fp16 needs --device cuda: autocast on the CPU computes in "
                "bf16 (--amp bf16)"
            )

    def calibration(self) -> dict[str, list[str]]:
        """The calibration's inputs as ``hybridagg.sim.calibrate``'s keywords
        (empty: the profile is not calibrated); ``network_json`` goes with
        the cluster file :attr:`network_cluster` names, loaded by the caller."""
        given = {
            "allreduce_json": calibration_files(self.calibrate_allreduce),
            "ps_json": calibration_files(self.calibrate_ps),
            "network_json": calibration_files(self.calibrate_network),
        }
        return {k: v for k, v in given.items() if v}

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


@dataclass(frozen=True, kw_only=True)
class PlanOptions(Concern):
    """What to plan for, what to optimise, and where the plan goes."""

    help_group: ClassVar[str] = "plan"

    cluster: str | None = None
    """cluster file (YAML, JSON or TOML); or -n N for this machine's emulation"""

    workers: int | None = option(None, at_least=2, short="-n")
    """this machine's emulation: N workers, which --slowdown and
    --sample-ms describe; the plan may use only the fastest of them (its
    --slowdown then names those, renumbered from 0), and its servers are
    ranks beside them (its 'ranks' says mpiexec -n)"""

    profile: str | None = None
    """profile file from 'hybridagg profile' (what the model needs)"""

    model: str | None = None
    """or a model to profile here on the spot (with --data, or --sample-shape
    and --classes)"""

    data: str | None = None
    """with --model: HDF5 file from 'hybridagg convert' (the sample shape and
    the classes)"""

    sample_shape: str | None = None
    """with --model: one sample's shape, e.g. 3,32,32"""

    classes: int | None = option(None, at_least=1)
    """with --model: number of classes"""

    batch_size: int = option(32, at_least=1)
    """samples per rank per step (the base of equal and speed-proportional
    batches)"""

    batch_choices: str | None = None
    """or per-rank batches for the planner to choose from, e.g. 16,32,64
    (each checked against the node types' memory)"""

    slowdown: str | None = None
    """the emulation's per-rank slowdown (as hybridagg train's --slowdown)"""

    sample_ms: float = option(0.0, at_least=0)
    """the emulation's milliseconds of compute per sample (as hybridagg
    train's --sample-ms)"""

    wire: str = option("fp32", choices=WIRE_FORMATS)
    """the gradients' format on the wire (as hybridagg train's --wire)"""

    objective: str = option("throughput", choices=("throughput", "cost", "time"))
    """throughput: the most samples/s; cost: the cheapest per hour that
    reaches --min-samples-per-sec; time: the shortest predicted time to the
    target accuracy (with --convergence)"""

    min_samples_per_sec: float | None = option(None, at_least=0)
    """with --objective cost: the samples/s the plan must reach"""

    convergence: str | None = None
    """with --objective time: convergence table (bench/convergence.py
    --json): updates to the target per samples per update and staleness"""

    eval_every: int | None = option(None, at_least=1)
    """with --convergence: the --eval-every the planned job validates at
    (the file's table at that cadence; default: the file's first): how
    often a run looks changes when it is seen to reach the target"""

    pipelines: str = option("auto", choices=("auto", "off"))
    """auto: also consider hybrid groups that are pipelines (each group of
    several ranks holds consecutive stages of the model, cut by the exact
    program; the profile must record the model's pipeline units); off:
    every rank holds a whole replica"""

    micro_batches: int = option(4, at_least=1)
    """micro-batches per step of a planned pipelined group (as hybridagg
    train's --micro-batches)"""

    searcher: str = option("auto", choices=("auto", "exact", "rl"))
    """exact: every configuration but those a bound rules out; rl: a policy
    trained with REINFORCE on the analytic model; auto: exact up to 20000
    configurations, rl beyond"""

    seed: int = option(0, at_least=0)
    """seed of the rl searcher"""

    rounds: int = option(150, at_least=1)
    """policy updates of the rl searcher (16 configurations each)"""

    confirm_workers: int = option(64, at_least=0)
    """simulate the chosen plan with SimGrid when it has at most this many
    workers (0: never)"""

    confirm_band: float = option(0.15, at_least=0)
    """--objective throughput: also simulate the configurations predicted
    within this share of the best (at most 8; the analytic model's error
    band) and choose the fastest simulated (0: the best predicted alone)"""

    sim_timeout: float = option(600.0, at_least=1)
    """seconds the confirming simulation may run"""

    json: str | None = None
    """also write the plan and its predictions to this JSON file"""

    out: str | None = None
    """write the plan file (for hybridagg train --plan) here"""

    def _check(self) -> None:
        if (self.profile is None) == (self.model is None):
            raise ValueError("give --profile FILE, or --model NAME to profile here")
        if self.model is None and (
            self.data is not None
            or self.sample_shape is not None
            or self.classes is not None
        ):
            raise ValueError("--data, --sample-shape and --classes go with --model")
        if (
            self.model is not None
            and self.data is None
            and (self.sample_shape is None or self.classes is None)
        ):
            raise ValueError(
                "--model needs --data FILE.h5, or --sample-shape and --classes"
            )
        if (self.cluster is None) == (self.workers is None):
            raise ValueError(
                "give --cluster FILE, or -n N to plan for this machine's emulation"
            )
        if self.objective == "cost" and self.min_samples_per_sec is None:
            raise ValueError(
                "--objective cost needs --min-samples-per-sec X: the samples/s "
                "the cheapest plan must reach"
            )
        if self.objective != "cost" and self.min_samples_per_sec is not None:
            raise ValueError("--min-samples-per-sec goes with --objective cost")
        if self.objective == "time" and self.convergence is None:
            raise ValueError(
                "--objective time needs --convergence FILE: the updates to the "
                "target per samples per update and staleness (bench/convergence.py)"
            )
        if self.objective != "time" and self.convergence is not None:
            raise ValueError("--convergence goes with --objective time")
        if self.eval_every is not None and self.convergence is None:
            raise ValueError("--eval-every goes with --convergence")
        from ...sim.space import parse_batch_choices
        from ...slowdown import parse_slowdown

        parse_slowdown(self.slowdown)  # raises on a malformed spec
        parse_batch_choices(self.batch_choices)


@dataclass(frozen=True, kw_only=True)
class PlanConfig(PlanOptions, OptimOptions):
    """``hybridagg plan``'s options (see ``hybridagg plan --help``).

    The optimizer's flags are hybridagg train's: ``--model`` times the
    servers' update with the optimizer they name (``--batch-size`` is
    :class:`PlanOptions`', with the same meaning).

    Raises:
        ValueError: A bad value, naming its flag.
    """

    def __post_init__(self) -> None:
        for concern in PLAN_CONCERNS:
            check_declared(self, concern)
            concern._check(self)


PLAN_CONCERNS: tuple[type, ...] = (PlanOptions, OptimOptions)
"""The concerns of ``hybridagg plan``, in the order of its ``--help``."""
