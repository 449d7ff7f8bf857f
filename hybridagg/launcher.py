"""``hybridagg-run``: start a command as ONE MPI job, the right way for where it runs.

The console script ``hybridagg-run`` (``python -m hybridagg.launcher``) is
:func:`main`. The decision is pure: :func:`parse_options` turns the command
line (and ``HYBRIDAGG_LAUNCHER``/``HYBRIDAGG_SRUN_MPI``) into
:class:`Options`, and :func:`plan_launch` turns those, an environment mapping
and what the machine answers (:class:`Probes`: ``srun``/``mpiexec`` on
``PATH``, ``srun --mpi=list``, ``mpiexec --version``, the user id) into a
:class:`Plan`: the argv and the variables it adds. Only :func:`execute`
starts anything: it replaces this process with the plan's command, as the
shell script it replaces did with ``exec``. Every refusal is a
:class:`LaunchError` with the message and exit status :func:`main` gives.

This module imports neither torch nor ``mpi4py`` (only
``hybridagg.runtime``), so the command starts fast.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .cluster import ClusterError, ClusterSpec, read_state
from .cluster import load as load_cluster
from .cluster.plan import mpiexec_args as cluster_mpiexec_args
from .modes import MODES, check_mode
from .runtime import envvars, runner

__all__ = [
    "HetGroups",
    "LaunchError",
    "Options",
    "Plan",
    "Probes",
    "build_parser",
    "choose_launcher",
    "cluster_plan",
    "execute",
    "find_mpiexec",
    "hand_groups",
    "het_groups",
    "main",
    "mpiexec_plan",
    "offers_pmix",
    "parse_options",
    "plan_launch",
    "script_vars",
    "srun_plan",
]

PROG = "hybridagg-run"

_DESCRIPTION = """\
Start a command as ONE MPI job, the right way for where it runs.

Inside a Slurm allocation (SLURM_JOB_ID set, srun on PATH): srun, with
--mpi=pmix when srun offers it (Open MPI 5 needs PMIx to form one job) and
the task count of the allocation unless -n is given. In a heterogeneous
allocation (SLURM_HET_SIZE set) it starts one step over every component, in
component order, telling each task its component (HYBRIDAGG_HET_COMPONENT),
and passes the groups to the program: one group per component, and the
tasks of the --servers-from component as parameter servers.
Elsewhere, or with --launcher mpiexec (e.g. an MPI built without Slurm's
PMI, which then reads the allocation itself): the mpiexec it finds
(HYBRIDAGG_MPIEXEC, the one beside python3, then mpiexec or mpirun on PATH)
with that MPI's flags: Open MPI 4 and 5 get --oversubscribe --bind-to none
(ranks that share cores must not be pinned to one), their run-as-root
consent as root, and on 5 the PRRTE oversubscription policy; MPICH's Hydra
(also Intel MPI) needs none of these. The hostfile flag is --hostfile for
Open MPI and -f for Hydra.
With --cluster FILE (Open MPI 5): the ranks run on the emulated hosts of a
cluster brought up by `hybridagg cluster up FILE`, filling the hosts in the
file's order; -n defaults to all their ranks."""

_EPILOG = """\
Groups reach the program (heterogeneous allocations only) as: {groups} and
{servers} in ARGS replaced by the spec ("slurm") and the server count; or,
when CMD runs `hybridagg train` (also behind a wrapper such as numactl)
without --groups, "--groups slurm [--servers K]" appended to it; or, for
any other program (a Horovod-style script, `import hybridagg.torch as hvd`),
as HYBRIDAGG_GROUPS=slurm, and with --servers-from HYBRIDAGG_SERVERS=K and
HYBRIDAGG_MODE=hybrid, unless set.
--mode, --groups and --servers set HYBRIDAGG_MODE, HYBRIDAGG_GROUPS and
HYBRIDAGG_SERVERS for a Horovod-style script (hybridagg train takes its own
flags instead)."""

_POSITIVE = re.compile(r"[1-9][0-9]*")
_INDEX = re.compile(r"[0-9]+")
# grep -w: "pmix" as a whole word (not pmix_v4)
_PMIX = re.compile(r"(?<![A-Za-z0-9_])pmix(?![A-Za-z0-9_])")
_PRTE_POLICY = "PRTE_MCA_rmaps_default_mapping_policy"
_TASKS_OF = "SLURM_NTASKS_HET_GROUP_<k>"


class LaunchError(Exception):
    """A refusal: the message ``hybridagg-run`` prints and its exit status.

    Attributes:
        status: Exit status (2: bad input; 127: no ``mpiexec`` found).
        usage: Whether the help text follows the message (a command line
            that could not be parsed).
    """

    def __init__(self, message: str, *, status: int = 2, usage: bool = False):
        super().__init__(message)
        self.status = status
        self.usage = usage


class _HelpRequested(Exception):
    """``-h``/``--help`` was given (raised where it is parsed, like the script)."""


@dataclass(frozen=True)
class Options:
    """The command line of ``hybridagg-run``, checked.

    Attributes:
        command: The program and its arguments.
        nranks: ``-n``: number of ranks (``None``: not given).
        hostfile: ``--hostfile`` (``None``: not given).
        launcher: ``"auto"``, ``"srun"`` or ``"mpiexec"`` (``mpirun`` is
            ``mpiexec``), from ``--launcher`` or ``HYBRIDAGG_LAUNCHER``.
        srun_mpi: srun's ``--mpi`` plugin from ``--mpi`` or
            ``HYBRIDAGG_SRUN_MPI`` (``None``: pmix if srun offers it).
        servers_from: ``--servers-from`` as typed (checked against the
            allocation by :func:`het_groups`).
        dry_run: Print the plan instead of running it.
        cluster: ``--cluster``: the emulated cluster's description.
        mode: ``--mode``: ``HYBRIDAGG_MODE`` for a Horovod-style script.
        groups: ``--groups``: ``HYBRIDAGG_GROUPS`` for it.
        servers: ``--servers``: ``HYBRIDAGG_SERVERS`` for it.
        (``--plan FILE`` fills ``nranks``, and ``mode``, ``groups`` and
        ``servers`` for a script, or adds ``--plan FILE`` to ``hybridagg
        train``'s command.)
    """

    command: tuple[str, ...]
    nranks: int | None = None
    hostfile: str | None = None
    launcher: str = "auto"
    srun_mpi: str | None = None
    servers_from: str | None = None
    dry_run: bool = False
    cluster: ClusterSpec | None = None
    mode: str | None = None
    groups: str | None = None
    servers: int | None = None


@dataclass(frozen=True)
class Plan:
    """What to run.

    Attributes:
        argv: The command (its first word is looked up on ``PATH``).
        env: Variables it adds to the environment, in the order printed.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)

    def command_line(self) -> str:
        """The ``--dry-run`` line: ``NAME=value ... argv``, quoted for a shell."""
        words = [f"{k}={v}" for k, v in self.env.items()] + list(self.argv)
        return " ".join(shlex.quote(w) for w in words)


@dataclass(frozen=True)
class HetGroups:
    """The groups of a heterogeneous Slurm allocation, as the program gets them.

    Attributes:
        task_counts: Tasks of each component, in component order.
        servers: Parameter servers (the tasks of the ``--servers-from``
            component; 0 without it).
        spec: The ``--groups`` spec: one group per component.
    """

    task_counts: tuple[int, ...]
    servers: int = 0
    spec: str = "slurm"

    @property
    def components(self) -> int:
        """Number of components."""
        return len(self.task_counts)


def _is_executable(path: str) -> bool:
    return os.access(path, os.X_OK)


def _srun_mpi_list() -> str:
    try:
        out = subprocess.run(
            ["srun", "--mpi=list"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
    except OSError:
        return ""
    return out.stdout


def _effective_uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


@dataclass(frozen=True)
class Probes:
    """What the plan asks of the machine; tests pass fakes.

    Attributes:
        which: A program's path on ``PATH`` (``None``: not there).
        executable: Whether a path is executable (``test -x``).
        srun_mpi_list: What ``srun --mpi=list`` prints (asked only when no
            plugin was chosen).
        mpiexec_version: What ``<mpiexec> --version`` prints.
        euid: The effective user id (0: root).
        cluster_state: The state folder of an emulated cluster that is up
            with this description (raises ``ClusterError`` otherwise).
    """

    which: Callable[[str], str | None] = shutil.which
    executable: Callable[[str], bool] = _is_executable
    srun_mpi_list: Callable[[], str] = _srun_mpi_list
    mpiexec_version: Callable[[str], str] = runner.mpiexec_version
    euid: int = field(default_factory=_effective_uid)
    cluster_state: Callable[[ClusterSpec], Path] = read_state


# ------------------------------------------------------------------ options
class _Value(argparse.Action):
    """An option with one value; a missing value is refused by its name."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            raise LaunchError(f"{option_string} needs a value")
        setattr(namespace, self.dest, values)


class _Help(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        raise _HelpRequested


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows ``-n N``, not argparse's ``-n [N]`` for the optional-looking values."""

    def _format_args(self, action, default_metavar):
        if isinstance(action, _Value):
            return action.metavar or default_metavar
        return super()._format_args(action, default_metavar)


class _Parser(argparse.ArgumentParser):
    """Refuses through :class:`LaunchError` (status 2) instead of exiting."""

    def error(self, message: str):
        raise LaunchError(message, usage=True)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``hybridagg-run`` (its help is the manual).

    Options stop at the first word that is not one (or after ``--``): the
    rest is the command, whatever options it has.
    """
    parser = _Parser(
        prog=PROG,
        usage=f"{PROG} [options] [--] CMD [ARGS...]",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_Formatter,
        add_help=False,
        allow_abbrev=False,
    )
    parser.add_argument(
        "-n",
        "--np",
        action=_Value,
        metavar="N",
        help="ranks (default: SLURM_NTASKS inside an allocation; required "
        "outside one unless --hostfile is given)",
    )
    parser.add_argument(
        "--hostfile",
        action=_Value,
        metavar="FILE",
        help="hosts for mpiexec, outside Slurm",
    )
    parser.add_argument(
        "--cluster",
        action=_Value,
        metavar="FILE",
        help="run on the emulated cluster FILE (up: hybridagg cluster up FILE)",
    )
    parser.add_argument(
        "--launcher",
        action=_Value,
        metavar="L",
        help="auto, srun or mpiexec (also: mpirun)  [HYBRIDAGG_LAUNCHER, auto]",
    )
    parser.add_argument(
        "--mpi",
        action=_Value,
        metavar="TYPE",
        help="srun's --mpi plugin  [HYBRIDAGG_SRUN_MPI; pmix if srun offers it]",
    )
    parser.add_argument(
        "--servers-from",
        action=_Value,
        metavar="K",
        help="heterogeneous job: the tasks of component K (the last one) are "
        "parameter servers",
    )
    parser.add_argument(
        "--mode",
        action=_Value,
        metavar="M",
        help="a Horovod-style script's mode: sync, hybrid or async  "
        "[HYBRIDAGG_MODE, sync]",
    )
    parser.add_argument(
        "--groups",
        action=_Value,
        metavar="SPEC",
        help="its groups of workers, as hybridagg train --groups  [HYBRIDAGG_GROUPS]",
    )
    parser.add_argument(
        "--servers",
        action=_Value,
        metavar="K",
        help="its parameter servers, the last K ranks  [HYBRIDAGG_SERVERS]",
    )
    parser.add_argument(
        "--plan",
        action=_Value,
        metavar="FILE",
        help="a plan from hybridagg plan: -n is its ranks; hybridagg train gets "
        "--plan FILE, a Horovod-style script its mode, groups and servers",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the command, with the variables it sets, and exit",
    )
    parser.add_argument("-h", "--help", action=_Help, help="this text")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="CMD", help=argparse.SUPPRESS
    )
    return parser


def parse_options(argv: Sequence[str], environ: Mapping[str, str]) -> Options:
    """Parse and check ``hybridagg-run``'s command line.

    An empty value (``-n ''``) counts as not given, except for
    ``--launcher``.

    Args:
        argv: The arguments after the program name.
        environ: The environment (``HYBRIDAGG_LAUNCHER``, ``HYBRIDAGG_SRUN_MPI``).

    Returns:
        The options.

    Raises:
        LaunchError: An unknown option, a missing value or command, a rank
            count that is not a positive integer, an unreadable hostfile or
            an unknown launcher.
        _HelpRequested: ``-h`` or ``--help``.
    """
    ns, unknown = build_parser().parse_known_args(list(argv))
    if unknown:
        raise LaunchError(f"unknown option {unknown[0]}", usage=True)
    command = list(ns.command)
    if command and command[0] == "--":
        command = command[1:]
    elif command and command[0].startswith("-"):
        # argparse takes "-", "-5" or "-x y" for a positional; the script did not
        raise LaunchError(f"unknown option {command[0]}", usage=True)
    if not command:
        raise LaunchError("no command given", usage=True)

    nranks = ns.np or None
    if nranks is not None and not _POSITIVE.fullmatch(nranks):
        raise LaunchError(f"-n needs a positive integer, got '{nranks}'")
    hostfile = ns.hostfile or None
    if hostfile is not None and not os.access(hostfile, os.R_OK):
        raise LaunchError(f"hostfile '{hostfile}' does not exist or is not readable")
    cluster = None
    if ns.cluster:
        try:
            cluster = load_cluster(ns.cluster)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    launcher = ns.launcher
    if launcher is None:
        launcher = envvars.get_str("HYBRIDAGG_LAUNCHER", environ) or "auto"
    if launcher == "mpirun":
        launcher = "mpiexec"
    if launcher not in ("auto", "srun", "mpiexec"):
        raise LaunchError(
            "--launcher (or HYBRIDAGG_LAUNCHER) must be auto, srun or mpiexec, "
            f"got '{launcher}'"
        )
    srun_mpi = ns.mpi
    if srun_mpi is None:
        srun_mpi = envvars.get_str("HYBRIDAGG_SRUN_MPI", environ)
    if ns.mode is not None and ns.mode not in MODES:
        raise LaunchError(f"--mode must be one of {', '.join(MODES)}, got '{ns.mode}'")
    if ns.servers is not None and not _INDEX.fullmatch(ns.servers):
        raise LaunchError(f"--servers needs a count (0 or more), got '{ns.servers}'")
    if ns.groups is not None and not ns.groups.strip():
        raise LaunchError("--groups needs a groups spec")
    mode, groups, servers = ns.mode, ns.groups, ns.servers
    if ns.plan:
        nranks, command, (mode, groups, servers) = _apply_plan(
            ns.plan, nranks, command, (mode, groups, servers), cluster
        )
    return Options(
        command=tuple(command),
        nranks=int(nranks) if nranks is not None else None,
        hostfile=hostfile,
        launcher=launcher,
        srun_mpi=srun_mpi or None,
        servers_from=ns.servers_from or None,
        dry_run=ns.dry_run,
        cluster=cluster,
        mode=mode,
        groups=groups,
        servers=int(servers) if servers is not None else None,
    )


def _apply_plan(
    path: str,
    nranks: str | None,
    command: list[str],
    script: tuple[str | None, str | None, str | None],
    cluster: ClusterSpec | None = None,
) -> tuple[str, list[str], tuple[str | None, str | None, str | None]]:
    """``--plan FILE``: the job's rank count, and the plan for the program:
    ``--plan FILE`` appended to a ``hybridagg train`` that has none, or the
    mode, groups and servers of a Horovod-style script (its batch size stays
    its own). A value given too must agree with the plan; with ``--cluster``
    the emulated hosts must place the ranks as the plan's nodes do (its
    groups and servers' placement assume that order).

    Raises:
        LaunchError: A bad plan file, or ``-n``, ``--mode``, ``--groups``,
            ``--servers`` or ``--cluster`` that disagree with it.
    """
    from .sim.planfile import groups_spec, layout_conflict, load_plan

    try:
        plan = load_plan(path)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if nranks is not None and int(nranks) != plan.ranks:
        raise LaunchError(
            f"-n {nranks}: the plan {path} is for {plan.ranks} ranks; drop -n"
        )
    if cluster is not None:
        why = layout_conflict(plan, [h.name for h in cluster.rank_order()])
        if why is not None:
            raise LaunchError(
                f"--cluster {cluster.name}: the plan {path} places its ranks "
                f"otherwise: {why}"
            )
    at = _train_at(command)
    if at is not None:
        if not any(w == "--plan" or w.startswith("--plan=") for w in command[at:]):
            command = [*command, "--plan", path]
        return str(plan.ranks), command, script
    if plan.pipeline_groups:
        raise LaunchError(
            f"the plan {path} has pipelined groups, which hybridagg train runs "
            "(a script's DistributedOptimizer holds a whole replica per rank)"
        )
    groups = {"hybrid": groups_spec(plan.groups), "async": "each"}.get(plan.mode)
    wanted = (plan.mode, groups, str(plan.servers))
    for flag, mine, theirs in zip(
        ("--mode", "--groups", "--servers"), script, wanted, strict=True
    ):
        if mine is not None and mine != theirs:
            raise LaunchError(
                f"{flag} {mine}: the plan {path} says {theirs or 'none'}; drop "
                f"{flag} or the plan"
            )
    return str(plan.ranks), command, wanted


# ---------------------------------------------------------------- decisions
def choose_launcher(choice: str, *, in_slurm: bool, srun_on_path: bool) -> str:
    """Resolve ``auto`` and check that the launcher can run here.

    Args:
        choice: ``"auto"``, ``"srun"`` or ``"mpiexec"``.
        in_slurm: Inside a Slurm allocation (``SLURM_JOB_ID`` set).
        srun_on_path: ``srun`` is on ``PATH``.

    Returns:
        ``"srun"`` or ``"mpiexec"``: ``auto`` is srun inside an allocation
        with srun on ``PATH``, else mpiexec.

    Raises:
        LaunchError: srun outside an allocation, or without srun on ``PATH``.
    """
    launcher = choice
    if launcher == "auto":
        launcher = "srun" if in_slurm and srun_on_path else "mpiexec"
    if launcher == "srun" and not in_slurm:
        raise LaunchError(
            "--launcher srun needs a Slurm allocation (SLURM_JOB_ID is unset): "
            "use sbatch or salloc"
        )
    if launcher == "srun" and not srun_on_path:
        raise LaunchError("--launcher srun, but there is no srun on PATH")
    return launcher


def het_groups(
    options: Options,
    environ: Mapping[str, str],
    *,
    components: int | None,
    launcher: str,
) -> HetGroups | None:
    """The groups of a heterogeneous allocation (``None`` outside one).

    Args:
        options: The command line.
        environ: The environment (``SLURM_NTASKS_HET_GROUP_<k>``).
        components: ``SLURM_HET_SIZE`` (``None``: not a heterogeneous
            allocation).
        launcher: The launcher chosen.

    Raises:
        LaunchError: mpiexec, ``-n`` or ``--hostfile`` in a heterogeneous
            allocation, a component without a task count, a bad
            ``--servers-from``, or ``--servers-from`` outside one.
    """
    if components is None:
        if options.servers_from is not None:
            raise LaunchError(
                "--servers-from needs a heterogeneous Slurm allocation "
                "(SLURM_HET_SIZE is unset); use --servers K of hybridagg train instead"
            )
        return None
    if launcher != "srun":
        raise LaunchError(
            "mpiexec inside a heterogeneous allocation sees only component 0; "
            "use srun (the default) with an MPI that has PMIx"
        )
    if options.nranks is not None:
        raise LaunchError(
            "-n does not apply to a heterogeneous allocation: each component's "
            "task count (SLURM_NTASKS_HET_GROUP_<k>) is used"
        )
    if options.hostfile is not None:
        raise LaunchError("--hostfile does not apply inside a Slurm allocation")
    counts = []
    for k in range(components):
        name = envvars.indexed(_TASKS_OF, k)
        value = envvars.get_str(name, environ) or ""
        if not _POSITIVE.fullmatch(value):
            raise LaunchError(
                f"{name}='{value}' is not a task count: is this a job step of a "
                "heterogeneous job started by sbatch or salloc?"
            )
        counts.append(int(value))
    servers = 0
    given = options.servers_from
    if given is not None:
        if not _INDEX.fullmatch(given):
            raise LaunchError(f"--servers-from needs a component index, got '{given}'")
        k = int(given)
        if k >= components:
            raise LaunchError(
                f"--servers-from {given}, but the job has components 0-{components - 1}"
            )
        if components < 2:
            raise LaunchError(
                "--servers-from needs a worker component besides the servers' one"
            )
        if k != components - 1:
            raise LaunchError(
                f"--servers-from {given} is not the last component "
                f"({components - 1}): hybridagg's servers are the last world "
                "ranks, so put the servers' component last in the job script"
            )
        servers = counts[k]
    return HetGroups(task_counts=tuple(counts), servers=servers)


def _train_at(command: Sequence[str]) -> int | None:
    """Index where ``hybridagg train`` (or ``-m hybridagg train``) starts."""
    for i, word in enumerate(command):
        after = list(command[i + 1 : i + 3]) + ["", ""]
        if word.rsplit("/", 1)[-1] == "hybridagg" and after[0] == "train":
            return i
        if word == "-m" and after[:2] == ["hybridagg", "train"]:
            return i
    return None


def hand_groups(
    command: Sequence[str], groups: HetGroups, *, with_servers: bool
) -> list[str]:
    """Give the groups to the program.

    ``{groups}`` and ``{servers}`` anywhere in the command are replaced by the
    spec and the server count. Without them, a ``hybridagg train`` in the
    command (also behind a wrapper, or as ``python -m hybridagg train``) gets
    ``--groups <spec>`` appended unless it has ``--groups`` or runs
    ``--mode async`` (a group per worker), and ``--servers <count>`` with
    ``--servers-from``. Any other command is left alone.

    Args:
        command: The program and its arguments.
        groups: The allocation's groups.
        with_servers: ``--servers-from`` was given.

    Raises:
        LaunchError: ``--servers-from`` and a ``hybridagg train`` that already
            has ``--groups`` or ``--servers``.
    """
    servers = str(groups.servers)
    if any("{groups}" in w or "{servers}" in w for w in command):
        return [
            w.replace("{groups}", groups.spec).replace("{servers}", servers)
            for w in command
        ]
    at = _train_at(command)
    if at is None:
        return list(command)
    tail = list(command[at:])
    has_groups = has_servers = is_async = False
    for i, word in enumerate(tail):
        if word == "--groups" or word.startswith("--groups="):
            has_groups = True
        elif word == "--servers" or word.startswith("--servers="):
            has_servers = True
        elif word == "--mode=async" or (
            word == "--mode" and i + 1 < len(tail) and tail[i + 1] == "async"
        ):
            is_async = True
    if with_servers and (has_groups or has_servers):
        raise LaunchError(
            "the command already has --groups or --servers; drop them, or drop "
            "--servers-from"
        )
    out = list(command)
    if not has_groups and not is_async:
        out += ["--groups", groups.spec]
    if with_servers:
        out += ["--servers", servers]
    return out


_SCRIPT_VARS = ("HYBRIDAGG_MODE", "HYBRIDAGG_GROUPS", "HYBRIDAGG_SERVERS")


def script_vars(
    options: Options,
    command: Sequence[str],
    environ: Mapping[str, str],
    groups: HetGroups | None = None,
) -> dict[str, str]:
    """The variables a Horovod-style script's ``hybridagg.torch.init()`` reads.

    From ``--mode``, ``--groups`` and ``--servers``; in a heterogeneous
    allocation, for a program that is not ``hybridagg train`` and has no
    ``{groups}`` placeholder, also the allocation's groups (``slurm``) and,
    with ``--servers-from``, its servers and ``hybrid`` mode, each unless
    the flag or the environment already sets it.

    Raises:
        LaunchError: The flags with ``hybridagg train`` (it has its own), or
            a mode that does not fit the servers or groups.
    """
    given = {
        name: str(value)
        for name, value in zip(
            _SCRIPT_VARS, (options.mode, options.groups, options.servers), strict=True
        )
        if value is not None
    }
    is_train = _train_at(command) is not None
    if given and is_train:
        raise LaunchError(
            "--mode, --groups and --servers of hybridagg-run configure a "
            "Horovod-style script (import hybridagg.torch as hvd); hybridagg "
            "train takes them as its own flags: put them after 'train'"
        )
    placeholders = any("{groups}" in w or "{servers}" in w for w in command)
    if groups is not None and not is_train and not placeholders:
        mode = given.get("HYBRIDAGG_MODE") or envvars.get_str("HYBRIDAGG_MODE", environ)
        # (async mode is a group per worker: the components are not groups)
        defaults = {} if mode == "async" else {"HYBRIDAGG_GROUPS": groups.spec}
        if options.servers_from is not None:
            defaults["HYBRIDAGG_SERVERS"] = str(groups.servers)
            defaults["HYBRIDAGG_MODE"] = "hybrid"
        for name, value in defaults.items():
            if name not in given and not envvars.get_str(name, environ):
                given[name] = value
    if given:
        final = {n: given.get(n) or envvars.get_str(n, environ) for n in _SCRIPT_VARS}
        mode = final["HYBRIDAGG_MODE"] or "sync"
        spec = final["HYBRIDAGG_GROUPS"]
        try:
            servers = envvars.get_int("HYBRIDAGG_SERVERS", final)
            check_mode(
                mode,
                servers=servers,
                singleton_groups=None if spec in (None, "each") else False,
                groups=f"--groups {spec}",
                cli=True,
            )
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    return given


def offers_pmix(mpi_list: str) -> bool:
    """Whether ``srun --mpi=list``'s output names the ``pmix`` plugin."""
    return _PMIX.search(mpi_list) is not None


def srun_plan(
    command: Sequence[str],
    *,
    mpi: str | None,
    nranks: int | None = None,
    components: int | None = None,
) -> Plan:
    """``srun --kill-on-bad-exit=1 [--mpi=TYPE] ...``: one step.

    Args:
        command: The program and its arguments.
        mpi: srun's ``--mpi`` plugin (``None``: the site's default).
        nranks: ``--ntasks`` (``None``: the allocation's).
        components: Components of a heterogeneous allocation: one MPMD
            segment each (``:`` between them), with ``--het-group=k`` and
            ``HYBRIDAGG_HET_COMPONENT=k`` exported.
    """
    step = ["--kill-on-bad-exit=1"] + ([f"--mpi={mpi}"] if mpi else [])
    argv = ["srun"]
    if components is not None:
        for k in range(components):
            if k:
                argv.append(":")
            argv += step + [
                f"--het-group={k}",
                f"--export=ALL,HYBRIDAGG_HET_COMPONENT={k}",
                *command,
            ]
    else:
        argv += step + (["--ntasks", str(nranks)] if nranks is not None else [])
        argv += list(command)
    return Plan(tuple(argv))


def find_mpiexec(environ: Mapping[str, str], probes: Probes) -> str:
    """The ``mpiexec`` to use.

    ``HYBRIDAGG_MPIEXEC`` (looked up on ``PATH`` if it is a name); else the
    ``mpiexec`` beside the ``python3`` on ``PATH``; else ``mpiexec``, then
    ``mpirun`` on ``PATH``. (:func:`hybridagg.runtime.runner.find_mpiexec`
    looks beside the running interpreter instead.)

    Raises:
        LaunchError: ``HYBRIDAGG_MPIEXEC`` is not an executable (status 2),
            or none was found (status 127).
    """
    chosen = envvars.get_str("HYBRIDAGG_MPIEXEC", environ)
    if chosen:
        found = probes.which(chosen)
        if not found:
            raise LaunchError(f"HYBRIDAGG_MPIEXEC='{chosen}' is not an executable")
        return found
    python3 = probes.which("python3") or "/nonexistent/python3"
    beside = os.path.join(os.path.dirname(python3) or ".", "mpiexec")
    if probes.executable(beside):
        return beside
    found = probes.which("mpiexec") or probes.which("mpirun")
    if not found:
        raise LaunchError(
            "no mpiexec found: load your MPI, or set HYBRIDAGG_MPIEXEC", status=127
        )
    return found


def mpiexec_plan(
    info: runner.MpiexecInfo,
    command: Sequence[str],
    environ: Mapping[str, str],
    *,
    nranks: str | None,
    hostfile: str | None,
    euid: int,
) -> Plan:
    """``mpiexec [-n N] [flags] [hostfile] command`` for this MPI.

    Open MPI: ``--oversubscribe --bind-to none``, ``--hostfile FILE``, the
    run-as-root consent as root, the TCP eager limit
    (:func:`~hybridagg.runtime.runner.tcp_eager_env`), and on 5 and later
    ``PRTE_MCA_rmaps_default_mapping_policy`` (its value in ``environ``, else
    ``:oversubscribe``). Hydra: ``-f FILE``. Unknown: ``-n`` only.

    Args:
        info: The launcher (see :func:`hybridagg.runtime.runner.identify_mpiexec`).
        command: The program and its arguments.
        environ: The environment (``PRTE_MCA_rmaps_default_mapping_policy``).
        nranks: ``-n`` (``None``: none, a hostfile gives the ranks).
        hostfile: The hostfile, if any.
        euid: The effective user id.

    Raises:
        LaunchError: A hostfile for a launcher that is neither Open MPI nor
            Hydra.
    """
    argv = [info.path] + (["-n", nranks] if nranks else [])
    env: dict[str, str] = {}
    if info.flavor == "openmpi":
        argv += runner.mpiexec_flags(info)
        if hostfile:
            argv += ["--hostfile", hostfile]
        env.update(runner.root_consent_env(euid))
        env.update(runner.tcp_eager_env(environ))
        if info.major >= 5:
            policy = envvars.get_str(_PRTE_POLICY, environ) or ":oversubscribe"
            env[_PRTE_POLICY] = policy
    elif info.flavor == "mpich":
        if hostfile:
            argv += ["-f", hostfile]
    elif hostfile:
        raise LaunchError(
            f"{info.path} is neither Open MPI nor MPICH/Hydra: pass its hostfile "
            "option in the command yourself"
        )
    return Plan(tuple(argv + list(command)), env)


def plan_launch(
    options: Options, environ: Mapping[str, str], probes: Probes | None = None
) -> Plan:
    """Decide the command that starts ``options.command`` as one MPI job.

    The checks run in the order of the shell script this replaces, so the
    first problem is the one reported.

    Args:
        options: The command line (see :func:`parse_options`).
        environ: The environment (``SLURM_*``, ``HYBRIDAGG_MPIEXEC``, ...).
        probes: What the machine answers (default: this machine).

    Returns:
        The plan.

    Raises:
        LaunchError: The job cannot be started as asked.
    """
    probes = probes or Probes()
    in_slurm = bool(envvars.get_str("SLURM_JOB_ID", environ))
    # before the launcher is chosen: inside an allocation "auto" is srun,
    # which would start the job on the allocation's nodes, not the cluster's
    if options.cluster is not None and (
        in_slurm or options.hostfile is not None or options.launcher == "srun"
    ):
        raise LaunchError(
            "--cluster places the ranks on the emulated hosts itself: it does not "
            "go with --hostfile, --launcher srun or inside a Slurm allocation"
        )
    het_size = envvars.get_str("SLURM_HET_SIZE", environ)
    if het_size is not None and not _POSITIVE.fullmatch(het_size):
        raise LaunchError(f"SLURM_HET_SIZE='{het_size}' is not a component count")
    launcher = choose_launcher(
        options.launcher,
        in_slurm=in_slurm,
        srun_on_path=probes.which("srun") is not None,
    )
    groups = het_groups(
        options,
        environ,
        components=int(het_size) if het_size is not None else None,
        launcher=launcher,
    )
    command = list(options.command)
    extra = script_vars(options, command, environ, groups)
    if groups is not None:
        command = hand_groups(
            command, groups, with_servers=options.servers_from is not None
        )

    if launcher == "srun":
        if options.hostfile is not None:
            raise LaunchError(
                "--hostfile does not apply inside a Slurm allocation: srun uses "
                "the allocation's nodes"
            )
        mpi = options.srun_mpi
        if mpi is None and offers_pmix(probes.srun_mpi_list()):
            mpi = "pmix"
        plan = srun_plan(
            command,
            mpi=mpi,
            nranks=options.nranks,
            components=groups.components if groups is not None else None,
        )
        # (srun exports the whole environment: --export=ALL is its default)
        return Plan(plan.argv, {**plan.env, **extra})

    mpiexec = find_mpiexec(environ, probes)
    nranks = str(options.nranks) if options.nranks is not None else None
    if nranks is None and in_slurm:
        nranks = envvars.get_str("SLURM_NTASKS", environ)
    if in_slurm and options.hostfile is not None:
        raise LaunchError(
            "--hostfile does not apply inside a Slurm allocation: mpiexec reads "
            "the allocation's nodes"
        )
    if not nranks and options.hostfile is None and options.cluster is None:
        raise LaunchError(
            "give -n N (or --hostfile FILE): outside a Slurm allocation there is "
            "no task count to take"
        )
    info = runner.identify_mpiexec(mpiexec, probes.mpiexec_version(mpiexec))
    if options.cluster is not None:
        plan = cluster_plan(options, info, environ, probes)
    else:
        plan = mpiexec_plan(
            info,
            command,
            environ,
            nranks=nranks,
            hostfile=options.hostfile,
            euid=probes.euid,
        )
    if not extra:
        return plan
    argv = list(plan.argv)
    if info.flavor == "openmpi":
        # Open MPI passes a variable to ranks on other hosts only when named
        # (Hydra and srun pass the whole environment)
        argv[1:1] = [word for name in extra for word in ("-x", name)]
    return Plan(tuple(argv), {**plan.env, **extra})


def cluster_plan(
    options: Options,
    info: runner.MpiexecInfo,
    environ: Mapping[str, str],
    probes: Probes,
) -> Plan:
    """``mpiexec`` that places the job's ranks on an emulated cluster's hosts.

    Args:
        options: The command line; ``options.cluster`` is set.
        info: The launcher: Open MPI 5 or later (its launch agent option).
        environ: The environment.
        probes: What the machine answers (the cluster's state folder).

    Raises:
        LaunchError: Another MPI, more ranks than the hosts hold, or the
            cluster is not up with this description.
    """
    spec = options.cluster
    assert spec is not None
    if info.flavor != "openmpi" or info.major < 5:
        raise LaunchError(
            f"--cluster needs Open MPI 5 or later (its launcher starts one daemon "
            f"per emulated host); {info.path} is {info.flavor} {info.major or ''}".rstrip()
        )
    nranks = options.nranks if options.nranks is not None else spec.total_ranks
    if nranks > spec.total_ranks:
        raise LaunchError(
            f"-n {nranks}: the hosts of {spec.source} hold {spec.total_ranks} ranks "
            f"({', '.join(f'{h.name}: {h.ranks}' for h in spec.hosts)})"
        )
    try:
        folder = probes.cluster_state(spec)
    except ClusterError as exc:
        raise LaunchError(str(exc)) from None
    prefix = os.path.dirname(os.path.dirname(os.path.abspath(info.path)))
    argv = [info.path, "-n", str(nranks)] + runner.mpiexec_flags(
        info, oversubscribe=False
    )
    argv += cluster_mpiexec_args(spec, folder, prefix)
    env = dict(runner.root_consent_env(probes.euid))
    env.update(runner.tcp_eager_env(environ))
    return Plan(tuple(argv + list(options.command)), env)


# ---------------------------------------------------------------- execution
def execute(plan: Plan) -> int:
    """Replace this process with the plan's command, its variables exported.

    Returns only when the command cannot be started: 127 when it is not
    found, 126 when it cannot be executed (a shell's statuses).
    """
    env = dict(os.environ)
    env.update(plan.env)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(plan.argv[0], list(plan.argv), env)
    except FileNotFoundError:
        print(f"{PROG}: {plan.argv[0]}: not found", file=sys.stderr)
        return 127
    except OSError as exc:
        print(f"{PROG}: {plan.argv[0]}: {exc.strerror}", file=sys.stderr)
        return 126
    return 0  # not reached: execvpe returns only by raising


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hybridagg-run``: plan the job, then print it or become it.

    Args:
        argv: The arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 after ``--help`` or ``--dry-run``, 2 for a refusal,
        127 without an ``mpiexec``; a real run does not return (the process
        becomes the launcher) unless the launcher cannot be started.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        options = parse_options(args, os.environ)
        plan = plan_launch(options, os.environ)
    except _HelpRequested:
        build_parser().print_help()
        return 0
    except LaunchError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        if exc.usage:
            build_parser().print_help()
        return exc.status
    if options.dry_run:
        print(plan.command_line())
        return 0
    return execute(plan)


if __name__ == "__main__":
    sys.exit(main())
