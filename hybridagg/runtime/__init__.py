"""Process plumbing: the environment registry, the launch environment, the job
runner, stop signals and optional dependencies.

This package knows about nothing else in hybridagg and imports neither torch
nor ``mpi4py.MPI`` at import time, so the command line and the training
configuration can load it cheaply.
"""

__all__ = ["envvars", "extras", "launchenv", "outcomes", "runner", "signals"]
