"""The three training modes and the rules that tie them to servers and groups.

A leaf module (pure logic, no torch, no MPI): the training configuration
and the optimizer factory both check a mode here, so they give the same
verdict, each in its own user's words (command-line flags or keywords).
"""

from __future__ import annotations

__all__ = ["MODES", "SERVER_MODES", "check_mode"]

MODES = ("sync", "hybrid", "async")
"""``sync``: one all-reduce over every worker per step (the DDP/Horovod
baseline); ``hybrid``: groups all-reduce inside and meet parameter servers
asynchronously; ``async``: every worker its own group (a classic
asynchronous parameter server)."""

SERVER_MODES = ("hybrid", "async")
"""The modes that need parameter servers."""


def check_mode(
    mode: str,
    *,
    servers: int | None,
    singleton_groups: bool | None = None,
    groups: str = "",
    cli: bool = False,
) -> None:
    """Check that ``mode`` fits the servers and groups (pure logic).

    Args:
        mode: One of :data:`MODES`.
        servers: Number of parameter servers (``None``: not given; a default
            will be filled in later).
        singleton_groups: Whether every worker is alone in its group
            (``None``: not known yet).
        groups: How the groups were given, for the message.
        cli: Name command-line flags (``--mode``) instead of keywords.

    Raises:
        ValueError: Naming what does not fit.
    """

    def named(m: str) -> str:
        return f"--mode {m}" if cli else f"mode={m!r}"

    if mode not in MODES:
        what = "--mode" if cli else "mode"
        raise ValueError(f"{what} must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "sync":
        if servers:
            fix = (
                "drop --servers or use --mode hybrid"
                if cli
                else "use mode='hybrid' or servers=0"
            )
            raise ValueError(
                f"{named(mode)} uses no parameter servers, but {servers} "
                f"{'was' if servers == 1 else 'were'} given; {fix}"
            )
        return
    if servers is not None and servers < 1:
        need = (
            "--servers 1 or more"
            if cli
            else "at least one parameter server (servers=K)"
        )
        raise ValueError(f"{named(mode)} needs {need}")
    if mode == "async" and singleton_groups is False:
        fix = (
            "drop --groups (or use --mode hybrid for groups)"
            if cli
            else "use init(groups='each'), or mode='hybrid' for groups"
        )
        given = f" ({groups})" if groups else ""
        raise ValueError(
            f"{named(mode)} puts every worker in its own group{given}; {fix}"
        )
