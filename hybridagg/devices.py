"""Which device each rank trains on, and how a reduction treats its devices.

A leaf module of pure policies (no torch, no MPI): the mechanisms
(:func:`hybridagg.init`, the optimizer's transports, the host staging in
:mod:`hybridagg.comm.staging`, the speed probe) ask here and act on the
answer, so every choice is tested on a machine without a GPU by handing in
fake device counts and names.

- :func:`choose_device`: ``--device auto`` on one rank.
- :func:`resolve_device_spec`: any ``--device`` value to one rank's device.
- :func:`reduction_backend`: NCCL (``torch``) or MPI through host memory
  for the ranks of one reduction.
- :func:`staging_mode`: whether a tensor goes to MPI directly or through a
  host buffer.
- :func:`probe_plan`: what the ``--groups speed`` probe times.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEVICE_CHOICES",
    "STAGING_SETTINGS",
    "BackendChoice",
    "DeviceSlot",
    "ProbePlan",
    "check_device_spec",
    "choose_device",
    "device_label",
    "device_summary",
    "probe_plan",
    "reduction_backend",
    "resolve_device_spec",
    "staging_mode",
]

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
"""What ``--device`` accepts (``cuda:N``: any index)."""

STAGING_SETTINGS = ("auto", "always", "never")
"""``HYBRIDAGG_HOST_STAGING``: ``auto`` stages device tensors through host
memory unless MPI is CUDA-aware; ``always`` also copies CPU tensors through
a host buffer (the device stand-in that CI runs); ``never`` hands device
memory to MPI (needs a CUDA-aware MPI)."""


def check_device_spec(spec: str) -> str:
    """``spec`` if it is a ``--device`` value (pure spelling check).

    Raises:
        ValueError: Not ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    """
    kind, colon, index = spec.partition(":")
    ok = (kind in ("auto", "cpu") and not colon) or (
        kind == "cuda" and (not colon or index.isdigit())
    )
    if not ok:
        raise ValueError(f"unknown --device {spec!r}: use auto, cpu, cuda or cuda:N")
    return spec


def choose_device(local_rank: int, cuda_count: int) -> str:
    """``--device auto`` for one rank: its node-local GPU, else the CPU.

    A rank takes GPU ``local_rank % cuda_count`` of its node. With more
    ranks on a node than GPUs, ranks share GPUs round-robin: that is
    allowed (each rank holds its own model copy in the GPU's memory), but
    NCCL admits one rank per GPU in a communicator, so a reduction whose
    ranks share a GPU goes through MPI and host memory instead
    (:func:`reduction_backend` decides).

    Args:
        local_rank: The rank's index among the ranks of its node (>= 0).
        cuda_count: GPUs this rank sees (0: none, or no CUDA build of torch).

    Returns:
        ``"cuda:I"`` or ``"cpu"``.
    """
    if local_rank < 0 or cuda_count < 0:
        raise ValueError(
            f"local_rank and cuda_count must be >= 0, got {local_rank}, {cuda_count}"
        )
    if cuda_count == 0:
        return "cpu"
    return f"cuda:{local_rank % cuda_count}"


def resolve_device_spec(spec: str, local_rank: int, cuda_count: int) -> str:
    """One rank's device from a ``--device`` value (pure).

    ``auto`` follows :func:`choose_device`; ``cuda`` without an index is the
    node-local GPU ``local_rank % cuda_count`` (as :func:`hybridagg.init`
    binds it); ``cpu`` and ``cuda:N`` are taken as given.

    Raises:
        ValueError: A bad spelling, or ``cuda`` where the rank sees no GPU
            or fewer than ``N + 1``.
    """
    check_device_spec(spec)
    if spec == "auto":
        return choose_device(local_rank, cuda_count)
    if spec == "cpu":
        return "cpu"
    if cuda_count == 0:
        raise ValueError(
            f"--device {spec}: CUDA is not available on this rank (it sees no "
            "CUDA device); use --device auto (a GPU where there is one, else "
            "the CPU) or --device cpu"
        )
    if spec == "cuda":
        return f"cuda:{local_rank % cuda_count}"
    index = int(spec.partition(":")[2])
    if index >= cuda_count:
        raise ValueError(f"--device {spec}: this rank sees {cuda_count} CUDA device(s)")
    return spec


def device_label(device: str, cuda_name: str | None, cpu_model: str) -> str:
    """The device kind ``--groups device`` compares: what the rank trains on.

    ``"cuda:<GPU name>"`` for a rank that trains on a GPU, ``"cpu:<model>"``
    otherwise, even on a node that has GPUs (a rank told ``--device cpu``
    computes like the other CPU ranks).
    """
    if device.startswith("cuda"):
        return f"cuda:{cuda_name or 'unknown GPU'}"
    return f"cpu:{cpu_model}"


def device_summary(labels: list[str]) -> str:
    """Which ranks train on which device kind, for the log (pure).

    ``["cuda:H100", "cpu:Xeon", "cpu:Xeon"]`` gives
    ``"cuda:H100: ranks [0]; cpu:Xeon: ranks [1, 2]"`` (kinds in order of
    their first rank).
    """
    ranks: dict[str, list[int]] = {}
    for rank, label in enumerate(labels):
        ranks.setdefault(label, []).append(rank)
    return "; ".join(f"{label}: ranks {r}" for label, r in ranks.items())


@dataclass(frozen=True)
class DeviceSlot:
    """Where one rank's parameters live, as a reduction's policy sees it.

    Attributes:
        host: The rank's node.
        kind: ``"cpu"`` or ``"cuda"``.
        index: The CUDA device index on that node (``None`` on the CPU).
    """

    host: str
    kind: str = "cpu"
    index: int | None = None


@dataclass(frozen=True)
class BackendChoice:
    """How the ranks of one reduction all-reduce, and why.

    Attributes:
        backend: ``"torch"`` (NCCL on CUDA), ``"mpi"`` or ``"horovod"``.
        reason: Words for the log: why this backend.
        on_cpu: Every rank's parameters are on the CPU (the same answer on
            every rank, so the strategies that depend on it agree).
    """

    backend: str
    reason: str
    on_cpu: bool


def reduction_backend(
    requested: str, slots: list[DeviceSlot], nccl: bool
) -> BackendChoice:
    """The all-reduce backend of one reduction's ranks (the same on each).

    With ``requested="auto"``: NCCL (``torch``) when every rank trains on a
    GPU, no two ranks share a GPU (NCCL refuses two ranks of one
    communicator on one device) and torch was built with NCCL; otherwise MPI,
    which takes any mix of CPU and GPU ranks (a GPU rank's buckets are
    staged through pinned host memory, :mod:`hybridagg.comm.staging`). An
    explicit ``mpi`` or ``horovod`` is kept; an explicit ``torch`` is kept
    too (NCCL on all-GPU ranks, gloo otherwise), except that ranks sharing
    a GPU or mixing CPU and GPU are refused, since NCCL would fail or hang.

    Args:
        requested: ``auto``, ``mpi``, ``torch`` or ``horovod``.
        slots: Each rank's :class:`DeviceSlot`, in the reduction's order.
        nccl: Whether this torch has NCCL (``torch.distributed.is_nccl_available()``).

    Raises:
        ValueError: ``torch`` asked for ranks NCCL cannot serve; an unknown
            backend; no slots.
    """
    if requested not in ("auto", "mpi", "torch", "horovod"):
        raise ValueError(f"unknown all-reduce backend {requested!r}")
    if not slots:
        raise ValueError("a reduction needs at least one rank")
    on_cpu = all(s.kind == "cpu" for s in slots)
    on_gpu = all(s.kind == "cuda" for s in slots)
    shared = _shared_gpus(slots)
    if requested in ("mpi", "horovod"):
        return BackendChoice(requested, f"{requested} as asked", on_cpu)
    if requested == "torch":
        if not on_cpu and not on_gpu:
            raise ValueError(
                "allreduce_backend 'torch' for a reduction that mixes CPU and "
                f"GPU ranks ({_kinds(slots)}); use 'auto' (MPI through host "
                "memory) or group ranks by device (--groups device)"
            )
        if shared:
            raise ValueError(
                f"allreduce_backend 'torch' (NCCL) with {shared}: NCCL admits "
                "one rank per GPU in a communicator; use 'auto' or 'mpi'"
            )
        return BackendChoice(
            "torch", "NCCL as asked" if on_gpu else "gloo as asked", on_cpu
        )
    if on_cpu:
        return BackendChoice("mpi", "every rank on the CPU: MPI", True)
    if not on_gpu:
        return BackendChoice(
            "mpi",
            f"CPU and GPU ranks in one reduction ({_kinds(slots)}): MPI, GPU "
            "tensors through pinned host memory",
            False,
        )
    if shared:
        return BackendChoice(
            "mpi",
            f"{shared} (NCCL admits one rank per GPU in a communicator): MPI "
            "through pinned host memory",
            False,
        )
    if not nccl:
        return BackendChoice(
            "mpi", "torch was built without NCCL: MPI through pinned host memory", False
        )
    return BackendChoice("torch", "every rank on a GPU of its own: NCCL", False)


def _shared_gpus(slots: list[DeviceSlot]) -> str:
    """Words naming the ranks that share a GPU (``""``: none do)."""
    seen: dict[tuple[str, int | None], list[int]] = {}
    for i, s in enumerate(slots):
        if s.kind == "cuda":
            seen.setdefault((s.host, s.index), []).append(i)
    shared = [
        f"ranks {ranks} of the reduction share GPU {index} on {host}"
        for (host, index), ranks in seen.items()
        if len(ranks) > 1
    ]
    return "; ".join(shared)


def _kinds(slots: list[DeviceSlot]) -> str:
    gpu = [i for i, s in enumerate(slots) if s.kind == "cuda"]
    cpu = [i for i, s in enumerate(slots) if s.kind == "cpu"]
    return f"GPU ranks {gpu}, CPU ranks {cpu} of the reduction"


def staging_mode(device_type: str, setting: str, cuda_aware: bool) -> str:
    """How one tensor reaches MPI: ``"direct"`` or ``"staged"`` (pure).

    ``direct``: MPI reads the tensor's own memory (a CPU tensor; a GPU
    tensor only when MPI is CUDA-aware). ``staged``: it is copied into a
    host buffer (pinned for a GPU tensor), MPI works there, and the result
    is copied back. ``setting`` is ``HYBRIDAGG_HOST_STAGING``
    (:data:`STAGING_SETTINGS`): ``always`` stages every tensor, CPU ones
    included, which is how CI runs the GPU path without a GPU.

    Raises:
        ValueError: An unknown setting, or ``never`` for a GPU tensor where
            MPI is not CUDA-aware.
    """
    if setting not in STAGING_SETTINGS:
        raise ValueError(
            f"HYBRIDAGG_HOST_STAGING must be one of {', '.join(STAGING_SETTINGS)}, "
            f"got {setting!r}"
        )
    if setting == "always":
        return "staged"
    if device_type == "cpu":
        return "direct"
    if setting == "never":
        if not cuda_aware:
            raise ValueError(
                "HYBRIDAGG_HOST_STAGING=never needs a CUDA-aware MPI, and this "
                "MPI library is not one (MPIX_Query_cuda_support() is 0 or "
                "missing); unset it to stage GPU tensors through host memory"
            )
        return "direct"
    return "direct" if cuda_aware else "staged"


@dataclass(frozen=True)
class ProbePlan:
    """What the ``--groups speed`` probe times on one rank.

    Attributes:
        device: Where the matrices live (the device the rank trains on).
        synchronize: Wait for the device before reading the clock (CUDA
            kernels return before they finish).
        size: The square matrices' side (larger on a GPU, where a small
            product measures only the launch latency).
    """

    device: str
    synchronize: bool
    size: int


def probe_plan(device: str, cpu_size: int = 192, gpu_size: int = 2048) -> ProbePlan:
    """The speed probe for a rank that trains on ``device`` (pure).

    A GPU rank times a CUDA matrix product with synchronisation; any other
    rank the CPU product. So ``--groups speed`` compares the devices ranks
    train on, not their hosts' CPUs.
    """
    if device.startswith("cuda"):
        return ProbePlan(device, True, gpu_size)
    return ProbePlan("cpu", False, cpu_size)
