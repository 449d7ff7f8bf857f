"""The ``hybridagg`` command line.

Subcommands:
    ``hybridagg env``   every environment variable hybridagg reads, and its value.
    ``hybridagg info``  the MPI library, launcher, thread level and versions in use.
    ``hybridagg run -n N -- CMD ...``  start CMD as an N-rank MPI job with the
        right launcher flags for this machine (oversubscription, root), killed
        after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "main"]


def _cmd_env(args: argparse.Namespace) -> int:
    from . import config

    print(config.describe())
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    import h5py
    import mpi4py
    import numpy
    import torch

    from . import __version__, runner

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
    from . import runner

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
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds")
    run.add_argument("--dry-run", action="store_true", help="print the command")
    run.add_argument(
        "--no-oversubscribe", action="store_true", help="refuse more ranks than cores"
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    return parser


_COMMANDS = {"env": _cmd_env, "info": _cmd_info, "run": _cmd_run}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hybridagg`` command."""
    args = build_parser().parse_args(argv)
    return _COMMANDS[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
