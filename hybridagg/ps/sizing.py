"""How many parameter servers a job needs: the rule, as a pure function.

Every update moves the whole model through the servers once each way (the
group's gradient in, the weights out) and costs one optimizer pass over it.
With ``K`` servers each carries ``1/K`` of that. So ``K`` servers keep up
when the groups' combined update rate, times the model's bytes, divided by
``K``, stays within what one server can take: the lesser of its host
link's rate (each way) and the bytes per second it updates (``bench/ps.py``
capacity, at the model's size). A margin (``headroom``) keeps servers from
running at their limit, where queues and staleness grow. More servers than
4 MiB parts of the model add messages without adding parallel bytes
(parts are the unit a server updates and returns: ``part_elems``).

Servers beside workers (a host's server slot, :mod:`hybridagg.cluster`)
keep the share of a shard's traffic that comes from the same host off the
link; the rule ignores that saving, so it errs towards enough servers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ServerSizing", "servers_needed"]


@dataclass(frozen=True)
class ServerSizing:
    """The servers a job needs, and why.

    Attributes:
        servers: How many.
        demand_bytes_per_sec: Bytes per second the groups send to the servers
            (and receive back) at their unhindered update rates.
        server_bytes_per_sec: What one server can take: the lesser of its
            link and its update rate.
        binding: ``"link"`` or ``"update"``: which of the two is the lesser.
        capped: The rule asked for more servers than the model has parts.
    """

    servers: int
    demand_bytes_per_sec: float
    server_bytes_per_sec: float
    binding: str
    capped: bool


def servers_needed(
    model_bytes: int,
    update_rates: Sequence[float],
    update_bytes_per_sec: float,
    link_bytes_per_sec: float | None = None,
    *,
    headroom: float = 0.8,
    part_bytes: int = 4 * 2**20,
) -> ServerSizing:
    """The rule for the number of servers (see the module's text).

    Args:
        model_bytes: Bytes of the parameters the servers hold.
        update_rates: Per group, the updates per second it makes when the
            servers never hold it back (its samples/s over its batch).
        update_bytes_per_sec: Bytes per second one server applies and
            returns (``bench/ps.py`` capacity x the model's bytes).
        link_bytes_per_sec: Each way, the rate of a server host's link
            (``None``: shared memory, no link).
        headroom: The fraction of a server's rate the rule plans to use.
        part_bytes: The servers' part size (at most one server per part).

    Returns:
        :class:`ServerSizing`; at least one server.

    Raises:
        ValueError: A non-positive size, rate or headroom, or a negative
            update rate.
    """
    if model_bytes <= 0 or part_bytes <= 0:
        raise ValueError(
            f"model_bytes and part_bytes must be positive, got {model_bytes}, {part_bytes}"
        )
    if not update_rates or any(r < 0 for r in update_rates):
        raise ValueError(
            f"update_rates must be >= 0, one per group, got {update_rates}"
        )
    if update_bytes_per_sec <= 0 or (
        link_bytes_per_sec is not None and link_bytes_per_sec <= 0
    ):
        raise ValueError("a server's update and link rates must be positive")
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    demand = sum(update_rates) * model_bytes
    rate, binding = update_bytes_per_sec, "update"
    if link_bytes_per_sec is not None and link_bytes_per_sec < rate:
        rate, binding = link_bytes_per_sec, "link"
    wanted = max(1, math.ceil(demand / (headroom * rate)))
    most = max(1, math.ceil(model_bytes / part_bytes))
    return ServerSizing(
        servers=min(wanted, most),
        demand_bytes_per_sec=demand,
        server_bytes_per_sec=rate,
        binding=binding,
        capped=wanted > most,
    )
