"""The ``hybridagg`` command line.

Subcommands:
    ``hybridagg env``   every environment variable hybridagg reads, and its value.
    ``hybridagg info``  the MPI library, launcher, thread level and versions in use.
    ``hybridagg run -n N -- CMD ...``  start CMD as an N-rank MPI job with the
        right launcher flags for this machine (oversubscription, root), killed
        after ``--timeout`` seconds.
    ``hybridagg convert --from digits|npz|npy|synthetic ... --out FILE.h5``
        write a data set in hybridagg's HDF5 format (train/val splits).
    ``hybridagg train --data FILE.h5 --mode sync|hybrid|async ...``
        train a model; launch on every rank (``mpiexec -n N hybridagg train``).
"""

from __future__ import annotations

import argparse
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
    return parser


def _cmd_convert(args: argparse.Namespace) -> int:
    from . import data

    kw = {
        "val_fraction": args.val_fraction,
        "seed": args.seed,
        "block_samples": args.block_samples,
        "progress": not args.quiet,
        "allow_nonfinite": args.allow_nonfinite,
    }
    if args.targets != "classes":
        if args.source not in ("npz", "npy"):
            print(
                "hybridagg convert: --targets float needs --from npz or npy",
                file=sys.stderr,
            )
            return 2
        kw["targets"] = args.targets
    src = args.source
    try:
        if src == "digits":
            if args.inputs:
                raise ValueError("--from digits takes no input files")
            out = data.convert_digits(args.out, image=args.image, **kw)
        elif src == "npz":
            if len(args.inputs) != 1:
                raise ValueError("--from npz takes one file: --from npz DATA.npz")
            out = data.convert_npz(
                args.inputs[0],
                args.out,
                x_key=args.x_key,
                y_key=args.y_key,
                num_classes=args.classes,
                **kw,
            )
        elif src == "npy":
            if len(args.inputs) != 2:
                raise ValueError("--from npy takes two files: --from npy X.npy Y.npy")
            out = data.convert_npy(
                args.inputs[0], args.inputs[1], args.out, num_classes=args.classes, **kw
            )
        else:
            if args.inputs:
                raise ValueError("--from synthetic takes no input files")
            shape = tuple(int(s) for s in args.shape.split(","))
            out = data.convert_synthetic(
                args.out,
                samples=args.samples,
                shape=shape,
                dtype=args.dtype,
                num_classes=args.classes or 10,
                **kw,
            )
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"hybridagg convert: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _add_convert_parser(sub) -> None:
    conv = sub.add_parser("convert", help="write a data set in hybridagg's HDF5 format")
    conv.add_argument(
        "--from",
        dest="source",
        required=True,
        choices=["digits", "npz", "npy", "synthetic"],
        help="digits (scikit-learn's bundled set), npz FILE, npy X.npy Y.npy, "
        "or synthetic image-shaped data",
    )
    conv.add_argument("inputs", nargs="*", help="input file(s) for npz/npy")
    conv.add_argument("--out", required=True, help="output .h5 file")
    conv.add_argument("--val-fraction", type=finite_float, default=0.2)
    conv.add_argument("--seed", type=int, default=0)
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
        help="number of classes (default: max label + 1; synthetic 10)",
    )
    conv.add_argument(
        "--targets",
        choices=["classes", "float"],
        default="classes",
        help="npz/npy: the labels are integer classes, or float regression "
        "targets (N,) or (N, k) (train with --loss mse)",
    )
    conv.add_argument("--x-key", default="x", help="npz: samples array name")
    conv.add_argument("--y-key", default="y", help="npz: labels array name")
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
    except ValueError as exc:  # the same verdict on every rank, before MPI starts
        if rank == 0:
            _log.error("hybridagg train: error: %s", exc)
        else:
            # The launcher ends the whole job at the first non-zero exit; give
            # rank 0 (maybe started later) the time to print the message.
            time.sleep(_ERROR_GRACE_S)
        return 2
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
        from mpi4py import MPI

        agreed = str(exc).startswith("[rank ")  # raised on every rank by Comm.check
        rank = MPI.COMM_WORLD.Get_rank()
        if rank == 0 or not agreed:
            _log.error("hybridagg train: error: %s", exc, extra=_ANY_RANK)
        if not agreed:
            MPI.COMM_WORLD.Abort(2)
        return 2
    except Exception as exc:
        _end_if_peer_failed(exc)
        raise
    return 0


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


def _end_if_peer_failed(exc: BaseException) -> None:
    """A dead or stuck peer (the heartbeat's verdict, or MPI's): exit 5, one message.

    Other errors return, to reach the abort hook with their traceback.
    """
    from .comm import end_on_peer_failure, peer_failure_of

    failure = peer_failure_of(exc)
    if failure is not None:
        end_on_peer_failure(failure, program="hybridagg train")


_COMMANDS["train"] = _cmd_train


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hybridagg`` command."""
    args = build_parser().parse_args(argv)
    return _COMMANDS[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
