"""The ``hybridagg`` command line.

Subcommands:
    ``hybridagg env``   every environment variable hybridagg reads, and its value.
    ``hybridagg info``  the MPI library, launcher, thread level and versions in use.
    ``hybridagg run -n N -- CMD ...``  start CMD as an N-rank MPI job with the
        right launcher flags for this machine (oversubscription, root), killed
        after ``--timeout`` seconds.
    ``hybridagg convert --from digits|npz|npy|hdf5|folder|synthetic ... --out FILE.h5``
        write a data set in hybridagg's HDF5 format (train/val/test splits).
    ``hybridagg train --data FILE.h5 --mode sync|hybrid|async ...``
        train a model; launch on every rank (``mpiexec -n N hybridagg train``).
    ``hybridagg simulate --profile P.json [--cluster C.yaml | --ranks N] ...``
        predict a training run (train's options) on SimGrid.
    ``hybridagg profile --model NAME --out P.json ...``
        measure what a model needs here (``mpiexec -n N``: the all-reduce too).
    ``hybridagg plan --profile P.json [--cluster C.yaml | -n N] --objective ...``
        choose mode, groups, servers and batches (a plan file for train).
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import sys
import time

__all__ = ["build_parser", "finite_float", "main"]


def _cmd_env(args: argparse.Namespace) -> int:
    from .runtime import envvars

    print(envvars.describe())
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import h5py
    import mpi4py
    import numpy
    import torch

    from .runtime import runner
    from .version import __version__

    try:
        launcher = runner.mpiexec_info()
        launcher_text = f"{launcher.path} ({launcher.flavor} {launcher.major or ''})"
    except FileNotFoundError as exc:
        launcher_text = f"none ({exc})"
    mpi4py.rc.initialize = False
    from mpi4py import MPI

    rows = [
        ("hybridagg", __version__),
        ("python", sys.version.split()[0]),
        ("torch", torch.__version__),
        ("cuda available", str(torch.cuda.is_available())),
        ("numpy", numpy.__version__),
        ("h5py", f"{h5py.__version__} (mpi={h5py.get_config().mpi})"),
        ("mpi4py", mpi4py.__version__),
        ("MPI library", MPI.Get_library_version().splitlines()[0].strip()),
        ("launcher", launcher_text),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .runtime import runner

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("hybridagg run: give a command after --")
    argv = runner.mpiexec_argv(args.n, command, oversubscribe=not args.no_oversubscribe)
    if args.dry_run:
        print(" ".join(argv))
        return 0
    result = runner.run_job(
        argv,
        timeout=args.timeout,
        env=runner.mpiexec_env(oversubscribe=not args.no_oversubscribe),
        stream=True,
    )
    if result.timed_out:
        print(
            f"hybridagg run: job killed after {args.timeout:g} s "
            f"({result.leftovers_killed} leftover processes)",
            file=sys.stderr,
        )
        return 124
    return int(result.returncode or 0)


def finite_float(text: str) -> float:
    """An argparse ``type=`` for a float flag: a finite number (not nan or inf).

    Raises:
        argparse.ArgumentTypeError: Not a finite number (argparse names the
            flag and exits with code 2).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``hybridagg`` command."""
    parser = argparse.ArgumentParser(
        prog="hybridagg",
        description="Hybrid sync/async distributed training on heterogeneous clusters.",
    )
    from .version import __version__

    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="list the environment variables hybridagg reads")
    sub.add_parser("info", help="show MPI, launcher and library versions")
    run = sub.add_parser("run", help="run a command as an MPI job on this machine")
    run.add_argument("-n", type=int, required=True, help="number of ranks")
    run.add_argument("--timeout", type=finite_float, default=3600.0, help="seconds")
    run.add_argument("--dry-run", action="store_true", help="print the command")
    run.add_argument(
        "--no-oversubscribe", action="store_true", help="refuse more ranks than cores"
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    _add_convert_parser(sub)
    from .cluster import command as cluster_command

    cluster_command.add_parser(sub)
    from .train.flags import add_arguments

    train = sub.add_parser(
        "train",
        help="train a model (launch as: mpiexec -n N hybridagg train ...)",
        description="Train a model on an HDF5 data set in sync, hybrid or async mode. "
        "Launch on every rank: mpiexec -n N hybridagg train --data FILE.h5 ...",
    )
    add_arguments(train)
    from .train.config.simulation import SIMULATE_CONCERNS, SimulateConfig

    simulate = sub.add_parser(
        "simulate",
        help="predict a training run on a cluster (SimGrid)",
        description="Predict samples/s, time per update and staleness of a "
        "training run (the options of hybridagg train) on a cluster file, "
        "from a model's profile (hybridagg profile), with SimGrid.",
    )
    add_arguments(simulate, SimulateConfig, SIMULATE_CONCERNS)
    from .train.config.simulation import PROFILE_CONCERNS, ProfileConfig

    profile = sub.add_parser(
        "profile",
        help="measure what a model needs here (for hybridagg simulate)",
        description="Measure a model's compute per sample and per layer, its "
        "memory, a server's update cost, memory-copy bandwidth and (under "
        "mpiexec -n N) the group all-reduce; write a profile file.",
    )
    add_arguments(profile, ProfileConfig, PROFILE_CONCERNS)
    from .train.config.simulation import PLAN_CONCERNS, PlanConfig

    plan = sub.add_parser(
        "plan",
        help="choose mode, groups, servers and batches for a cluster",
        description="Choose the mode, groups, number and placement of servers, "
        "per-rank batches and nodes of a job on a cluster file (or this "
        "machine's emulation, -n N), for the most samples/s or the lowest cost "
        "per hour that reaches a rate; SimGrid confirms the choice.",
    )
    add_arguments(plan, PlanConfig, PLAN_CONCERNS)
    return parser


def _configured() -> dict[str, tuple[type, tuple[type, ...]]]:
    """The commands whose flags are a configuration's fields: its class and concerns."""
    from .train.config import CONCERNS, TrainConfig
    from .train.config.simulation import SIMULATE_CONCERNS, SimulateConfig

    return {
        "train": (TrainConfig, CONCERNS),
        "simulate": (SimulateConfig, SIMULATE_CONCERNS),
    }


_CONVERT_INPUTS = {
    "digits": 0,
    "synthetic": 0,
    "npz": 1,
    "hdf5": 1,
    "folder": 1,
    "npy": 2,
}
_CONVERT_USAGE = {
    "npz": "--from npz DATA.npz",
    "hdf5": "--from hdf5 DATA.h5 --x-key X --y-key Y",
    "folder": "--from folder DIR (one sub-folder of images per class)",
    "npy": "--from npy X.npy Y.npy",
}


def _given_split(args: argparse.Namespace, name: str):
    """``--val-from``/``--test-from``: one path, or two for npy; ``None`` if not given."""
    paths = getattr(args, name)
    flag = "--" + name.replace("_", "-")
    if paths is None:
        return None
    want = _CONVERT_INPUTS[args.source]
    if want == 0:
        raise ValueError(
            f"{flag} needs an input of files or images, not --from {args.source}"
        )
    if len(paths) != want:
        kind = (
            "X.npy Y.npy"
            if want == 2
            else ("a folder" if args.source == "folder" else "one file")
        )
        raise ValueError(
            f"{flag} of --from {args.source} takes {kind}, got {len(paths)} paths"
        )
    return paths if want == 2 else paths[0]


def _cmd_convert(args: argparse.Namespace) -> int:
    from . import data

    kw = {
        "val_fraction": args.val_fraction,
        "seed": args.seed,
        "block_samples": args.block_samples,
        "progress": not args.quiet,
    }
    arrays = {
        "allow_nonfinite": args.allow_nonfinite,
        "layout": args.layout,
        "targets": args.targets,
    }
    src = args.source
    try:
        want = _CONVERT_INPUTS[src]
        if len(args.inputs) != want:
            if want == 0:
                raise ValueError(f"--from {src} takes no input files")
            what = "one file" if want == 1 else "two files"
            if src == "folder":
                what = "one folder"
            raise ValueError(f"--from {src} takes {what}: {_CONVERT_USAGE[src]}")
        given = {
            "val_from": _given_split(args, "val_from"),
            "test_from": _given_split(args, "test_from"),
        }
        if src != "folder" and args.size is not None:
            raise ValueError("--size resizes images of --from folder only")
        if args.targets != "classes" and src not in ("npz", "npy", "hdf5"):
            raise ValueError("--targets float needs --from npz, npy or hdf5")
        if src == "digits":
            out = data.convert_digits(
                args.out, image=args.image, allow_nonfinite=args.allow_nonfinite, **kw
            )
        elif src == "npz":
            out = data.convert_npz(
                args.inputs[0],
                args.out,
                x_key=args.x_key,
                y_key=args.y_key,
                num_classes=args.classes,
                **given,
                **arrays,
                **kw,
            )
        elif src == "hdf5":
            out = data.convert_hdf5(
                args.inputs[0],
                args.out,
                x_key=args.x_key,
                y_key=args.y_key,
                num_classes=args.classes,
                **given,
                **arrays,
                **kw,
            )
        elif src == "npy":
            out = data.convert_npy(
                args.inputs[0],
                args.inputs[1],
                args.out,
                num_classes=args.classes,
                **given,
                **arrays,
                **kw,
            )
        elif src == "folder":
            from .data.images import parse_size

            size = None if args.size is None else parse_size(args.size)
            out = data.convert_folder(
                args.inputs[0], args.out, size=size, **given, **kw
            )
        else:
            shape = tuple(int(s) for s in args.shape.split(","))
            out = data.convert_synthetic(
                args.out,
                samples=args.samples,
                shape=shape,
                dtype=args.dtype,
                num_classes=args.classes or 10,
                **kw,
            )
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        print(f"hybridagg convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _add_convert_parser(sub) -> None:
    conv = sub.add_parser(
        "convert",
        help="write a data set in hybridagg's HDF5 format",
        description="Write a data set in hybridagg's HDF5 format: a train split, a "
        "val split (a random cut, or --val-from), a test split (--test-from), "
        "normalisation statistics, image samples channels first.",
    )
    conv.add_argument(
        "--from",
        dest="source",
        required=True,
        choices=["digits", "npz", "npy", "hdf5", "folder", "synthetic"],
        help="digits (scikit-learn's bundled set), npz FILE, npy X.npy Y.npy, "
        "hdf5 FILE (datasets --x-key and --y-key), folder DIR (one sub-folder of "
        "images per class, decoded with Pillow), or synthetic image-shaped data",
    )
    conv.add_argument("inputs", nargs="*", help="input file(s) or folder")
    conv.add_argument("--out", required=True, help="output .h5 file")
    conv.add_argument(
        "--val-fraction",
        type=finite_float,
        default=0.2,
        help="fraction cut off at random as the validation split (without --val-from)",
    )
    conv.add_argument(
        "--val-from",
        nargs="+",
        metavar="PATH",
        default=None,
        help="a given validation set, kept as it is instead of a random cut: a "
        "file of the input's kind (npz, hdf5: the same keys), X.npy Y.npy, or a "
        "folder with the same class folders",
    )
    conv.add_argument(
        "--test-from",
        nargs="+",
        metavar="PATH",
        default=None,
        help="a given test set, written as the 'test' split (as --val-from)",
    )
    conv.add_argument("--seed", type=int, default=0, help="seed of the random cut")
    conv.add_argument(
        "--block-samples",
        type=int,
        default=None,
        help="samples per block/chunk (default: about 1 MiB)",
    )
    conv.add_argument(
        "--classes",
        type=int,
        default=None,
        help="number of classes (default: max label + 1; folder: the class "
        "folders; synthetic 10)",
    )
    conv.add_argument("--x-key", default="x", help="npz, hdf5: the samples' name")
    conv.add_argument("--y-key", default="y", help="npz, hdf5: the labels' name")
    conv.add_argument(
        "--layout",
        default="auto",
        choices=["auto", "nchw", "nhwc"],
        help="npz, npy, hdf5: where the channels of (N, A, B, C) arrays are; auto "
        "takes channels last when C is 1, 3 or 4 and A, B are larger (and the "
        "same for channels first), and refuses what is neither; stored channels "
        "first",
    )
    conv.add_argument(
        "--size",
        default=None,
        metavar="HxW",
        help="folder: resize every image to height x width (default: keep "
        "them; they must agree)",
    )
    conv.add_argument(
        "--targets",
        choices=["classes", "float"],
        default="classes",
        help="npz, npy, hdf5: the labels are integer classes, or float regression "
        "targets (N,) or (N, k) (train with --loss mse)",
    )
    conv.add_argument(
        "--image",
        action="store_true",
        help="digits: store (1, 8, 8) images instead of 64-vectors",
    )
    conv.add_argument("--samples", type=int, default=10000, help="synthetic: count")
    conv.add_argument("--shape", default="3,32,32", help="synthetic: sample shape")
    conv.add_argument("--dtype", default="uint8", choices=["uint8", "float32"])
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="keep samples holding NaN or inf (refused by default, naming the "
        "first: training on them stops with exit code 3)",
    )


_COMMANDS = {"env": _cmd_env, "info": _cmd_info, "run": _cmd_run}
_COMMANDS["convert"] = _cmd_convert


def _cmd_cluster(args: argparse.Namespace) -> int:
    from .cluster import command as cluster_command

    return cluster_command.run(args)


_COMMANDS["cluster"] = _cmd_cluster


def _launch_rank() -> int:
    from .runtime.launchenv import launch_env

    rank = launch_env().rank
    return 0 if rank is None else rank


_ERROR_GRACE_S = 2.0
"""Seconds the other ranks wait before exiting on a bad option (see _cmd_train)."""


_log = logging.getLogger("hybridagg.train")


def _refuse_options(rank: int, say) -> int:
    """A bad option, found on every rank before MPI starts: rank 0 ``say()``s
    why; every rank exits 2."""
    if rank == 0:
        say()
    else:
        # The launcher ends the whole job at the first non-zero exit; give
        # rank 0 (maybe started later) the time to print the message.
        time.sleep(_ERROR_GRACE_S)
    return 2


def _agreed_or_abort(exc: BaseException, say) -> int:
    """An error met under MPI: exit 2 where every rank raised it, else abort.

    An error :meth:`hybridagg.comm.Comm.check` raised is the same on every
    rank (``[rank R] ...``): rank 0 ``say()``s it and every rank exits 2. Any
    other is this rank's alone, while its peers may wait for it: it says so
    and aborts the job (exit 2), never a hang.
    """
    from mpi4py import MPI

    agreed = str(exc).startswith("[rank ")  # raised on every rank by Comm.check
    if MPI.COMM_WORLD.Get_rank() == 0 or not agreed:
        say()
    if not agreed:
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(2)
    return 2


def _cmd_train(args: argparse.Namespace) -> int:
    """Run ``hybridagg train``: one clear message and exit 2 on bad input, every rank.

    Messages are log records (:mod:`hybridagg.runtime.logs`: ``[rank R]``,
    rank 0's by default, ``--log-level``); the final table (stdout) and the
    status lines of ``--on-group-failure continue`` stay plain lines.
    """
    from .runtime.signals import stop_flag

    stop_flag()  # before torch's import: a batch system's early warning is kept
    from .runtime import envvars, logs
    from .train.flags import config_from_args

    rank = _launch_rank()
    logs.configure(rank, "info", every_rank=False)  # (until the flags are read)
    try:
        cfg = config_from_args(args)
        envvars.check_all()
        logs.configure(rank, cfg.log_level)
        if cfg.plan:
            _check_plan_size(cfg.plan)
    except ValueError as exc:  # the same verdict on every rank, before MPI starts
        return _refuse_options(
            rank, functools.partial(_log.error, "hybridagg train: error: %s", exc)
        )
    from .comm import CommTimeoutError, RemoteError
    from .runtime.outcomes import ExitCode, NonFiniteError
    from .train.driver import run
    from .train.survival import status_line

    try:
        _, status = run(cfg)
        if status is not None:  # --on-group-failure continue
            from mpi4py import MPI

            # each rank says how it ended; its exit code says so only on
            # request: Open MPI 5.0.11's launcher under --with-ft ulfm was
            # seen to hang ("Abort is in progress") when a rank exited
            # non-zero, even after MPI_Finalize (about one run in three)
            line = status_line(MPI.COMM_WORLD.Get_rank(), status)
            print(line, file=sys.stderr, flush=True)
            code = status.code if envvars.get_bool("HYBRIDAGG_EXIT_CODES") else 0
            if status.code != ExitCode.FINISHED:
                # A rank died: the survivors have met, written the summary and
                # freed their communicators. MPI_Finalize (and joining threads
                # that may still wait on the dead peer) was seen to hang now and
                # then in Open MPI 5.0.11 under --with-ft ulfm, so leave without
                # it; under ULFM the launcher takes that as an ordinary exit.
                sys.stdout.flush()
                os._exit(int(code))
            return int(code)
    except NonFiniteError as exc:  # raised on every rank, after a clean wind-down
        _stopped_together(str(exc))
        return int(ExitCode.NON_FINITE)
    except CommTimeoutError as exc:  # an OSError, but no bad input: a stuck peer
        from mpi4py import MPI

        _log.error("hybridagg train: error: %s; aborting the job", exc, extra=_ANY_RANK)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(int(exc.exit_code))
    except (ValueError, TypeError, OSError, RemoteError) as exc:
        return _agreed_or_abort(
            exc,
            functools.partial(
                _log.error, "hybridagg train: error: %s", exc, extra=_ANY_RANK
            ),
        )
    except Exception as exc:
        _end_if_peer_failed(exc)
        raise
    return 0


def _check_plan_size(path: str) -> None:
    """A job launched with ``--plan`` must have the plan's ranks.

    Raises:
        ValueError: It has another number, naming both.
    """
    from .runtime.launchenv import launch_env
    from .sim.planfile import load_plan

    size = launch_env().size or 1
    ranks = load_plan(path).ranks
    if size != ranks:
        raise ValueError(
            f"--plan {path} is for {ranks} ranks (mpiexec -n {ranks}), but this "
            f"job has {size}"
        )


_ANY_RANK = {"any_rank": True}
"""A record only the rank logging it knows of: shown whatever its rank."""


def _stopped_together(message: str) -> None:
    """Rank 0 logs why training stopped; then every rank leaves together.

    The launcher ends the whole job at the first non-zero exit, so no rank
    may exit before rank 0 has printed: a polled barrier (with the usual
    timeout) after the message.
    """
    from .comm import Comm

    world = Comm(name="exit")
    if world.rank == 0:
        _log.error("hybridagg train: stopped: %s", message, extra=_ANY_RANK)
    world.barrier(what="exit after a non-finite stop")
    world.free()


def _end_if_peer_failed(exc: BaseException, program: str = "hybridagg train") -> None:
    """A dead or stuck peer (the heartbeat's verdict, or MPI's): exit 5, one message.

    Other errors return, to reach the abort hook with their traceback.
    """
    from .comm import end_on_peer_failure, peer_failure_of

    failure = peer_failure_of(exc)
    if failure is not None:
        end_on_peer_failure(failure, program=program)


_COMMANDS["train"] = _cmd_train


def _train_split(path: str) -> tuple[int, int]:
    """The training split's size and rows per block of a data file (for
    ``--epochs``: an epoch's samples, and the chunks workers draw them in)."""
    from .data.format import inspect_split, open_file

    with open_file(path) as f:
        info = inspect_split(f, "train", path=path)
        return info.length, info.block_samples


def _cmd_simulate(args: argparse.Namespace) -> int:
    """Run ``hybridagg simulate``: exit 2 with one message on bad input."""
    import json

    from .runtime.outcomes import ExitCode
    from .sim import build_job, load_cluster, load_profile, machine_cluster, simulate
    from .sim._simgrid import SimGridMissing
    from .sim.planfile import job_rank_nodes, layout_conflict, load_plan, plan_cluster
    from .train.config.simulation import SimulateConfig
    from .train.flags import config_from_args

    try:
        cfg = config_from_args(args, SimulateConfig)  # --plan: its settings, --ranks
        profile = load_profile(cfg.profile)
        servers = cfg.num_servers
        plan = load_plan(cfg.plan) if cfg.plan else None
        if cfg.cluster is None:
            cluster = machine_cluster(profile, cfg.ranks - servers, servers)
        else:
            cluster = load_cluster(cfg.cluster)
            if plan is not None:  # the plan's own cluster, cut to its nodes
                cluster = plan_cluster(plan, cluster, profile, cfg.plan)
            elif cfg.ranks is not None:
                cluster = cluster.scaled(cfg.ranks - servers)
        samples, block = cfg.samples, None
        if samples is None and cfg.data is not None:
            samples, block = _train_split(cfg.data)
        job = build_job(cfg, cluster, profile, samples=samples, block_samples=block)
        if plan is not None and cfg.cluster is not None:
            # as hybridagg-run --plan --cluster: the groups and the servers'
            # placement assume the plan's ranks-to-nodes order (a hand-edited
            # plan, or one written by another version of the numbering, breaks it)
            why = layout_conflict(plan, job_rank_nodes(job))
            if why is not None:
                raise ValueError(
                    f"--cluster {cfg.cluster}: the plan {cfg.plan} places its "
                    f"ranks otherwise: {why}"
                )
        prediction = simulate(job, timeout=cfg.sim_timeout)
    except SimGridMissing as exc:
        print(f"hybridagg simulate: {exc}", file=sys.stderr)
        return int(ExitCode.BAD_INPUT)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"hybridagg simulate: error: {exc}", file=sys.stderr)
        return int(ExitCode.BAD_INPUT)
    except (TimeoutError, RuntimeError) as exc:  # the engine's own failure
        print(f"hybridagg simulate: {exc}", file=sys.stderr)
        return int(ExitCode.INTERNAL)
    result = {
        "mode": cfg.mode,
        "cluster": cluster.name,
        "workers": len(job.workers),
        "servers": len(job.servers),
        "groups": job.groups if len(job.groups) <= 64 else len(job.groups),
        **prediction.as_dict(),
    }
    cuts = {g: p["bounds"] for g, p in enumerate(job.pipelines) if p is not None}
    if cuts:  # each pipelined group's cut, as a run's summary gives its bounds
        result["pipeline_bounds"] = list(cuts.values())
        result["pipeline_groups"] = list(cuts)
    rows = [
        (
            "cluster",
            f"{cluster.name} ({len(job.workers)} workers, {len(job.servers)} servers)",
        ),
        ("mode", f"{cfg.mode}, {len(job.groups)} group(s)"),
        ("samples/s", f"{prediction.samples_per_sec:.1f}"),
        (
            "second half",
            f"{prediction.steady_samples_per_sec:.1f} samples/s "
            "(without the first rounds' start-up)",
        ),
        ("ideal samples/s", f"{prediction.ideal_samples_per_sec:.1f}"),
        (
            "time for the run",
            f"{prediction.time_s:.3f} s ({prediction.updates} updates)",
        ),
        ("mean staleness", f"{prediction.mean_staleness:.2f}"),
    ]
    shown = [t for t in prediction.group_update_s[:8] if t is not None]
    more = " ..." if len(prediction.group_update_s) > 8 else ""
    rows.append(("s per update/group", " ".join(f"{t:.4f}" for t in shown) + more))
    if cuts:
        rows.append(
            ("pipeline cuts", " ".join(f"group {g}: {b}" for g, b in cuts.items()))
        )
    rows.append(("simulation took", f"{prediction.wall_s:.2f} s"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


_COMMANDS["simulate"] = _cmd_simulate


def _cmd_profile(args: argparse.Namespace) -> int:
    """Run ``hybridagg profile`` (one process, or every rank of an MPI job).

    As ``hybridagg train``: a bad option is one message (rank 0's) and exit 2
    on every rank before MPI starts; under MPI a bad model, data file or
    device is the same error on every rank (exit 2), a stuck peer aborts
    the job (exit 5), and rank 0's measuring is a declared solo phase
    (:mod:`hybridagg.train.profiling`).
    """
    from .runtime import envvars
    from .runtime.launchenv import launch_env
    from .train.config.simulation import ProfileConfig
    from .train.flags import config_from_args

    rank = _launch_rank()
    try:
        cfg = config_from_args(args, ProfileConfig)
        envvars.check_all()
    except ValueError as exc:  # the same verdict on every rank
        return _refuse_options(rank, functools.partial(_say, "profile", exc))
    from .comm import CommTimeoutError, RemoteError
    from .train.profiling import describe, run_profile

    under_mpi = (launch_env().size or 1) > 1
    try:
        result = run_profile(cfg)
    except CommTimeoutError as exc:  # (an OSError) no bad input: a stuck peer
        from mpi4py import MPI

        _say("profile", f"{exc}; aborting the job")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(int(exc.exit_code))
    except (ValueError, TypeError, OSError, RemoteError) as exc:
        if not under_mpi:
            _say("profile", exc)
            return 2
        return _agreed_or_abort(exc, functools.partial(_say, "profile", exc))
    except Exception as exc:
        if under_mpi:
            _end_if_peer_failed(exc, program="hybridagg profile")
        raise
    if result is not None:
        print(f"wrote {cfg.out}: {describe(result)}")
    return 0


def _say(command: str, exc: BaseException | str) -> None:
    """``hybridagg COMMAND: error: ...`` on stderr."""
    print(f"hybridagg {command}: error: {exc}", file=sys.stderr, flush=True)


_COMMANDS["profile"] = _cmd_profile


def _cmd_plan(args: argparse.Namespace) -> int:
    """Run ``hybridagg plan``: exit 2 with one message on bad input, or when no
    configuration reaches the required samples/s."""
    import json

    from .runtime.outcomes import ExitCode
    from .sim import load_profile
    from .sim.planner import plan
    from .train.config.simulation import PlanConfig
    from .train.flags import config_from_args

    try:
        cfg = config_from_args(args, PlanConfig)
        if cfg.profile is not None:
            profile = load_profile(cfg.profile)
        else:
            profile = _profile_here(cfg)
        chosen, result, note = plan(cfg, profile)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"hybridagg plan: error: {exc}", file=sys.stderr)
        return int(ExitCode.BAD_INPUT)
    p = chosen
    rows = [
        ("cluster", f"{p.cluster} (nodes used: {p.nodes})"),
        ("objective", p.objective
         + (f" (at least {p.min_samples_per_sec:g} samples/s)" if p.min_samples_per_sec else "")),
        ("searcher", f"{p.searcher}, {result.evaluated} configurations scored"
         + (f", {result.pruned} node sets pruned" if result.pruned else "")
         + (f", {p.memory_dropped} dropped (over a node type's memory)"
            if p.memory_dropped else "")),
        ("mode", f"{p.mode}, {len(p.groups)} group(s), {p.servers} server(s)"),
        ("ranks", f"{p.ranks} ({p.workers} workers + {p.servers} servers)"
         + (f"; of the emulated {cfg.workers} workers the {p.workers} fastest, "
            f"--slowdown {p.slowdown or '(none)'} renumbered from 0"
            if cfg.workers and p.workers < cfg.workers else "")),
        ("batches", f"--batch-size {p.batch_size}, "
         + ("speed-proportional" if p.adaptive_batch else "equal")
         + (f" {p.batch_sizes}" if p.workers <= 16 else "")),
        ("predicted samples/s", f"{p.predicted_samples_per_sec:.1f} "
         f"({p.predicted_samples_per_sec / p.ideal_samples_per_sec:.3f} of ideal)"),
        ("ideal samples/s", f"{p.ideal_samples_per_sec:.1f}"),
        ("sync all-reduce (best)", "-" if p.sync_samples_per_sec is None
         else f"{p.sync_samples_per_sec:.1f} samples/s, "
         f"{p.sync_cost_per_hour:g} per hour"
         + ("" if p.sync_time_to_target_s is None
            else f", {p.sync_time_to_target_s:.1f} s to the target")),
        ("simulated samples/s", note if p.simulated_samples_per_sec is None
         else f"{p.simulated_samples_per_sec:.1f} (SimGrid, the second half of its updates"
         + (f"; {note})" if note else ")")),
        ("cost per hour", f"{p.cost_per_hour:g}"),
        ("train flags", _shorten(" ".join(p.train_args()))),
    ]  # fmt: skip
    if p.predicted_time_to_target_s is not None:
        at = [k for k, _ in rows].index("ideal samples/s")
        rows.insert(at, ("predicted time to target",
                         f"{p.predicted_time_to_target_s:.2f} s, validating "
                         f"every {p.eval_every} updates (convergence table "
                         f"{cfg.convergence})"))  # fmt: skip
    if p.pipeline_groups:
        at = [k for k, _ in rows].index("batches")
        cuts = ", ".join(
            f"group {g}: units {b}"
            for g, b in zip(p.pipeline_groups, p.pipeline_bounds, strict=True)
        )
        rows.insert(at, ("pipelines", f"{cuts} ({p.micro_batches} micro-batches)"))
    if p.workers <= 64:
        rows.insert(4, ("groups", json.dumps(p.groups)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for path in (cfg.json, cfg.out):
        if path:
            p.save(path)
    return 0


def _shorten(text: str, limit: int = 160) -> str:
    """``text`` cut to ``limit`` characters (the plan file keeps it whole)."""
    if len(text) <= limit:
        return text
    return text[: limit - 40] + " ... (whole in the plan file: train_args)"


def _profile_here(cfg):
    """``hybridagg plan --model NAME``: profile the model in this process."""
    from .train.profiling import profile_for_plan

    return profile_for_plan(cfg)


_COMMANDS["plan"] = _cmd_plan


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hybridagg`` command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if getattr(args, "plan", None) and args.cmd in _configured():
        from .train.flags import given_fields

        # --plan must know which flags were given, even at their defaults;
        # the command's own flags follow its name (the top-level parser
        # has none but --help and --version, which exit)
        config, concerns = _configured()[args.cmd]
        rest = argv[argv.index(args.cmd) + 1 :]
        args.given_flags = given_fields(rest, config, concerns)
    return _COMMANDS[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
