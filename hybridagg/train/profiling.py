"""Running a profile: what is profiled, on which device, and by which ranks.

:mod:`.profiler` measures; this module runs the measurements for the
command line:

* :func:`profiled_input`: one sample's shape and the classes, from a data
  file or as given (``hybridagg profile`` and ``hybridagg plan --model``
  read them the same way);
* :func:`profile_here`: build the model (seed 0) and measure it in this
  process, without MPI (``hybridagg profile`` with one rank,
  ``hybridagg plan --model``);
* :func:`run_profile`: ``hybridagg profile`` on one rank or on every rank
  of an MPI job. Under ``mpiexec -n N`` rank 0 builds the model, measures it
  and writes the file in declared solo phases (:func:`hybridagg.comm.solo`)
  while a :class:`~hybridagg.comm.Heartbeat` runs, so the other ranks' waits
  do not count that time against ``HYBRIDAGG_TIMEOUT`` and a dead or stuck
  rank is found within ``HYBRIDAGG_FAILURE_TIMEOUT``; after each phase
  :meth:`~hybridagg.comm.Comm.check` raises rank 0's error on every rank, so
  a bad model or data file is the same ``ValueError`` (or ``OSError``)
  everywhere; then every rank times the group all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
from torch import nn

from ..sim.calibrate import calibrate
from ..sim.cluster import load_cluster
from ..sim.profile import AllreduceFit, Profile, save_profile
from .config.simulation import PlanConfig, ProfileConfig
from .models import build_model, check_fits
from .profiler import (
    ALLREDUCE_SIZES,
    compute_device,
    measure_allreduce,
    profile_model,
)

__all__ = [
    "describe",
    "profile_for_plan",
    "profile_here",
    "profiled_input",
    "run_profile",
]


def profiled_input(
    data: str | None, sample_shape: tuple[int, ...] | None, classes: int | None
) -> tuple[tuple[int, ...], int]:
    """One sample's shape and the number of classes.

    Args:
        data: An HDF5 file from ``hybridagg convert`` (its training split
            tells both), or ``None``.
        sample_shape: The shape without ``data``.
        classes: The classes without ``data``.

    Raises:
        ValueError, OSError: A bad or missing data file; neither ``data`` nor
            both of the others.
    """
    if data is not None:
        from ..data.format import inspect_split, open_file

        with open_file(data) as f:
            info = inspect_split(f, "train", path=data)
        return tuple(info.sample_shape), int(info.num_classes)
    if sample_shape is None or classes is None:
        raise ValueError("give --data FILE.h5, or --sample-shape and --classes")
    return tuple(sample_shape), int(classes)


def _model(cfg: ProfileConfig) -> tuple[nn.Module, tuple[int, ...], int]:
    shape, classes = profiled_input(
        cfg.data,
        None if cfg.sample_shape is None else cfg.parsed_shape(),
        cfg.classes,
    )
    torch.manual_seed(0)  # every profile of a model times the same weights
    return build_model(cfg.model, shape, classes), shape, classes


def _device(cfg: ProfileConfig, local_rank: int) -> tuple[str, bool]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return compute_device(cfg.device, local_rank, count)


def profile_here(cfg: ProfileConfig, local_rank: int = 0) -> Profile:
    """Build ``cfg``'s model and measure it in this process (no all-reduce).

    Args:
        cfg: What to profile (``cfg.out`` is not written here).
        local_rank: This process's rank on its node (``--device cuda``'s GPU).

    Raises:
        ValueError, TypeError, OSError: A bad model, data file or device.
    """
    model, shape, classes = _model(cfg)
    device, synchronize = _device(cfg, local_rank)
    # a model that does not take the samples: one clear ValueError, not a
    # traceback from inside the timed forward
    check_fits(model, shape, classes, cfg.model, torch.device("cpu"), cfg.loss)
    profile = profile_model(
        model,
        cfg.model,
        shape,
        cfg.batch_size,
        cfg,
        reps=cfg.reps,
        device=device,
        synchronize=synchronize,
        amp=cfg.amp,
        data=cfg.data,
        loss=cfg.loss,
    )
    inputs: dict = dict(cfg.calibration())
    if cfg.network_cluster is not None:
        inputs["network_cluster"] = load_cluster(cfg.network_cluster)
    # fitted on the microbenchmarks only (never on training runs): the
    # simulator is then validated on training runs it was not fitted to
    return calibrate(profile, **inputs) if inputs else profile


def profile_for_plan(cfg: PlanConfig, reps: int = 3) -> Profile:
    """``hybridagg plan --model NAME``: the model profiled in this process, its
    servers timed with the optimizer the plan's flags name.

    Raises:
        ValueError, TypeError, OSError: A bad model or data file.
    """
    return profile_here(
        ProfileConfig(
            out="-",
            model=cfg.model,
            data=cfg.data,
            sample_shape=cfg.sample_shape,
            classes=cfg.classes,
            batch_size=cfg.batch_size,
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            reps=reps,
        )
    )


def run_profile(cfg: ProfileConfig) -> Profile | None:
    """``hybridagg profile``: measure, write ``cfg.out`` on rank 0, return it there.

    With one process (no ``mpiexec``, or ``-n 1``) no MPI is started. Under
    ``mpiexec -n N`` (see the module) this is collective over the job.

    Returns:
        The profile on rank 0 (and with one process); ``None`` on the others.

    Raises:
        ValueError, TypeError, OSError: A bad model, data file, device or
            output path: with N ranks, the same error (``[rank 0] ...``) on
            every rank.
        CommTimeoutError: A wait ran out of time (a stuck peer).
    """
    from ..comm import configure_threads
    from ..runtime.launchenv import launch_env

    env = launch_env()
    configure_threads()  # a rank's threads in a run (one unless set)
    if (env.size or 1) == 1:
        _check_destination(cfg.out)
        profile = profile_here(cfg, env.local_rank or 0)
        save_profile(profile, cfg.out)
        return profile
    return _run_ranks(cfg, env.local_rank or 0)


def _run_ranks(cfg: ProfileConfig, local_rank: int) -> Profile | None:
    from ..comm import Comm, Heartbeat, end_job, install_abort_hook, solo

    install_abort_hook()  # an error of one rank alone ends the job, never a hang
    comm = Comm(name="profile")
    heartbeat = Heartbeat(
        comm.mpi, on_failure=functools.partial(end_job, program="hybridagg profile")
    )
    # on an error the communicators are left to the process's end (as the
    # heartbeat leaves its own): freeing one may wait for a stuck peer
    with heartbeat:
        profile, err = None, None
        if comm.rank == 0:
            with solo("profiling the model"):
                try:
                    _check_destination(cfg.out)
                    profile = profile_here(cfg, local_rank)
                except Exception as exc:  # told to every rank, whatever it is
                    err = exc
        comm.check(err, what="the model's profile")
        latency, bandwidth, points = measure_allreduce(comm, ALLREDUCE_SIZES, cfg.reps)
        if comm.rank == 0:
            fit = AllreduceFit(latency, bandwidth, comm.size, tuple(points))
            profile = dataclasses.replace(profile, allreduce=fit)
            with solo("writing the profile"):
                try:
                    save_profile(profile, cfg.out)
                except OSError as exc:
                    err = exc
        comm.check(err, what="writing the profile")
    comm.free()
    return profile


def _check_destination(out: str) -> None:
    """Refuse an ``--out`` whose folder does not exist (before minutes of timing).

    Raises:
        FileNotFoundError: Its folder does not exist.
    """
    folder = Path(out).resolve().parent
    if not folder.is_dir():
        raise FileNotFoundError(f"--out {out}: folder {folder} does not exist")


def describe(profile: Profile) -> str:
    """One line of what a profile measured (``hybridagg profile`` prints it)."""
    ar = profile.allreduce
    where = profile.machine.device
    if profile.machine.amp != "none":
        where += f", --amp {profile.machine.amp}"
    text = (
        f"{profile.parameters} parameters, {profile.sample_seconds * 1e3:.3f} ms "
        f"per sample (forward and backward, on {where}), server "
        f"{profile.server.seconds_per_update * 1e3:.3f} ms + "
        f"{profile.server.seconds_per_byte * 1e9:.3f} ns/B, copies "
        f"{profile.machine.memcpy_Bps / 1e9:.2f} GB/s"
    )
    if ar is not None:
        text += (
            f", all-reduce over {ar.ranks}: {ar.latency_s * 1e6:.1f} us, "
            f"{ar.bandwidth_Bps / 1e9:.2f} GB/s"
        )
    return text
