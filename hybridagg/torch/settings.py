"""What ``hybridagg.torch.init()`` reads from the environment (pure logic).

A Horovod script names no mode, group or server: the launcher's environment
does (``HYBRIDAGG_MODE``, ``HYBRIDAGG_GROUPS``, ``HYBRIDAGG_SERVERS``, all
declared in :mod:`hybridagg.runtime.envvars`; ``hybridagg-run --mode ...``
sets them). The defaults are ``hybridagg train``'s: groups ``world``,
``node`` or ``each`` and 0, 1 or 1 servers by mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..modes import check_mode
from ..runtime import envvars

__all__ = ["JobSettings", "settings_from_env"]

_DEFAULT_GROUPS = {"sync": "world", "hybrid": "node", "async": "each"}


@dataclass(frozen=True)
class JobSettings:
    """How a Horovod script's job is laid out.

    Attributes:
        mode: ``"sync"``, ``"hybrid"`` or ``"async"``.
        groups: The groups spec (as ``hybridagg train --groups``).
        servers: Parameter-server ranks (the last ones of the job).
    """

    mode: str = "sync"
    groups: str = "world"
    servers: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.groups, str) or not self.groups.strip():
            raise ValueError(
                f"HYBRIDAGG_GROUPS must be a groups spec, got {self.groups!r}"
            )
        if isinstance(self.servers, bool) or not isinstance(self.servers, int):
            raise TypeError(f"servers must be an int, got {self.servers!r}")
        if self.servers < 0:
            raise ValueError(f"HYBRIDAGG_SERVERS must be >= 0, got {self.servers}")
        try:
            check_mode(
                self.mode,
                servers=self.servers,
                singleton_groups=None if self.groups == "each" else False,
                groups=f"HYBRIDAGG_GROUPS={self.groups}",
            )
        except ValueError as exc:
            # check_mode speaks of keywords; here the user set variables
            raise ValueError(
                f"HYBRIDAGG_MODE={self.mode}, HYBRIDAGG_SERVERS={self.servers}, "
                f"HYBRIDAGG_GROUPS={self.groups}: {exc}"
            ) from None


def settings_from_env(environ: Mapping[str, str] | None = None) -> JobSettings:
    """Read and check ``HYBRIDAGG_MODE``, ``HYBRIDAGG_GROUPS`` and ``HYBRIDAGG_SERVERS``.

    Args:
        environ: Where to read (default: this process's environment).

    Raises:
        ValueError: An unknown mode, a server count that is not a
            non-negative integer, or a combination that does not fit
            (servers in sync mode, none in hybrid, groups in async).
    """
    mode = (envvars.get_str("HYBRIDAGG_MODE", environ) or "sync").strip().lower()
    servers = envvars.get_int("HYBRIDAGG_SERVERS", environ)
    if servers is None:
        servers = 0 if mode == "sync" else 1
    groups = envvars.get_str("HYBRIDAGG_GROUPS", environ)
    if groups is None:
        groups = _DEFAULT_GROUPS.get(mode, "world")
    return JobSettings(mode=mode, groups=groups.strip(), servers=servers)
