"""Read a rank's place in the job from whatever launched it.

MPI itself is the authority once initialised; before that (or to cross-check
it), the launcher's variables tell rank, local rank and size: Slurm's
``srun`` (``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``), Open MPI
(``OMPI_COMM_WORLD_*``) and MPICH/Hydra (``PMI_RANK``/``PMI_SIZE``,
``MPI_LOCALRANKID``). :func:`launch_env` is the one function that reads them.

The innermost launcher wins. ``mpirun`` inside a Slurm allocation starts its
daemons with ``srun`` (one task per node), so its ranks inherit that step's
``SLURM_PROCID``/``SLURM_NTASKS``, which number daemons, not ranks (seen on
Slurm 22.05 with Open MPI 5: ranks 0-3 on two nodes carried
``SLURM_PROCID`` 0, 0, 1, 1 and ``SLURM_NTASKS=2``). Open MPI's variables are
set only by its own launcher, so they come first; Hydra's ``PMI_RANK`` comes
next unless it merely repeats ``srun``'s own numbering (``srun --mpi=pmi2``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import envvars

__all__ = ["LaunchEnv", "launch_env", "slurm_het_component"]


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher says about this process (``None``: it did not say).

    Attributes:
        launcher: ``"slurm"``, ``"openmpi"``, ``"mpich"`` or ``"none"``.
        rank: Global rank.
        size: Number of ranks.
        local_rank: Rank on this node.
        local_size: Ranks on this node.
        het_component: Slurm heterogeneous-job component of this task.
    """

    launcher: str
    rank: int | None = None
    size: int | None = None
    local_rank: int | None = None
    local_size: int | None = None
    het_component: int | None = None


def _int(name: str) -> int | None:
    try:
        return envvars.get_int(name)
    except ValueError:
        return None


def slurm_het_component() -> int | None:
    """This task's component index in a Slurm heterogeneous job step, if any.

    Observed on Slurm 22.05.8 (see docs/architecture.md, "Slurm heterogeneous
    jobs"): no variable states it. ``SLURM_HET_JOB_ID``,
    ``SLURM_HET_JOB_OFFSET`` and ``SLURM_HET_GROUP`` are not set in step
    tasks, and ``SLURM_JOB_ID`` is component 0's id on every task. Tasks are
    numbered in component order, and tasks started inside ``sbatch``/``salloc``
    inherit ``SLURM_NTASKS_HET_GROUP_<k>``, so the component is the range of
    ``SLURM_PROCID`` among the cumulative counts, when the step spans every
    component (``srun --het-group=0,1,...``: ``SLURM_NTASKS`` is their sum).
    ``HYBRIDAGG_HET_COMPONENT``, which ``hybridagg-run`` sets per component
    through srun's ``:`` syntax, wins. A process started by ``mpirun`` (which
    sees only component 0 of a heterogeneous allocation) gets ``None``, as
    does a malformed value (never an exception here: every rank calls this
    before the collective that would report it; ``groups='slurm'`` then fails
    on every rank alike, naming the missing component).
    """
    explicit = _int("HYBRIDAGG_HET_COMPONENT")
    if explicit is not None:
        return explicit if explicit >= 0 else None
    if _int("OMPI_COMM_WORLD_RANK") is not None:
        return None  # SLURM_PROCID numbers mpirun's daemons here, not ranks
    components, procid = _int("SLURM_HET_SIZE"), _int("SLURM_PROCID")
    if components is None or procid is None:
        return None
    counts = [
        _int(envvars.indexed("SLURM_NTASKS_HET_GROUP_<k>", k))
        for k in range(components)
    ]
    if any(c is None for c in counts) or sum(counts) != _int("SLURM_NTASKS"):
        return None
    end = 0
    for k, count in enumerate(counts):
        end += count
        if procid < end:
            return k
    return None


def launch_env() -> LaunchEnv:
    """Read rank and node placement from the launcher's environment.

    Open MPI's ``OMPI_COMM_WORLD_*`` first (only its own ``mpirun`` sets
    them, also inside a Slurm allocation); then Hydra's ``PMI_RANK`` unless
    it equals ``SLURM_PROCID`` with ``PMI_SIZE == SLURM_NTASKS`` (then
    ``srun --mpi=pmi2`` set both); then Slurm, when ``SLURM_PROCID`` is set
    together with ``SLURM_STEP_ID`` (a task of an ``srun`` step).
    """
    if _int("OMPI_COMM_WORLD_RANK") is not None:
        return LaunchEnv(
            launcher="openmpi",
            rank=_int("OMPI_COMM_WORLD_RANK"),
            size=_int("OMPI_COMM_WORLD_SIZE"),
            local_rank=_int("OMPI_COMM_WORLD_LOCAL_RANK"),
            local_size=_int("OMPI_COMM_WORLD_LOCAL_SIZE"),
        )
    srun_task = (
        _int("SLURM_PROCID") is not None
        and envvars.get_str("SLURM_STEP_ID") is not None
    )
    pmi = _int("PMI_RANK")
    if pmi is not None and (
        not srun_task
        or (pmi, _int("PMI_SIZE")) != (_int("SLURM_PROCID"), _int("SLURM_NTASKS"))
    ):
        return LaunchEnv(
            launcher="mpich",
            rank=pmi,
            size=_int("PMI_SIZE"),
            local_rank=_int("MPI_LOCALRANKID"),
            local_size=_int("MPI_LOCALNRANKS"),
        )
    if srun_task:
        return LaunchEnv(
            launcher="slurm",
            rank=_int("SLURM_PROCID"),
            size=_int("SLURM_NTASKS"),
            local_rank=_int("SLURM_LOCALID"),
            local_size=_slurm_local_size(),
            het_component=slurm_het_component(),
        )
    return LaunchEnv(launcher="none")


def _slurm_local_size() -> int | None:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": this node's count is not
    # derivable without the node index, so use SLURM_STEP_TASKS_PER_NODE's
    # entry for SLURM_NODEID when both are present.
    node = _int("SLURM_NODEID")
    spec = envvars.get_str("SLURM_STEP_TASKS_PER_NODE")
    if node is None or not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        value, _, rep = part.partition("(x")
        try:
            counts += [int(value)] * (int(rep.rstrip(")")) if rep else 1)
        except ValueError:
            return None
    return counts[node] if node < len(counts) else None
