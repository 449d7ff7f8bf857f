"""Online cost control: a budget per hour, each rank's price, the controller's weight (pure logic).

``--prices`` is parsed here, without MPI: either ``RANKS:PRICE`` items or a
cluster file of ``hybridagg plan`` (reading the file is the only I/O). The
job's size is known only at launch, so :func:`rank_prices` checks it then,
with the same message on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .fields import Concern, option

__all__ = ["CLUSTER_SUFFIXES", "CostOptions", "rank_prices"]

# what makes --prices a file rather than RANKS:PRICE items
CLUSTER_SUFFIXES = (".yaml", ".yml", ".json", ".toml")


@dataclass(frozen=True, kw_only=True)
class CostOptions(Concern):
    """Online cost control (Ling et al.'s drift-plus-penalty controller)."""

    help_group: ClassVar[str] = "online cost control (Ling et al.'s controller)"

    cost_budget: float | None = option(None, at_least=0)
    """long-term spend to keep, per hour: each slot, a drift-plus-penalty
    controller picks which groups train (a parked group's ranks idle and are
    not charged) and the linear solve splits the batch among them; needs
    --prices, --pipeline-groups, --mode sync and --adaptive-batch"""

    prices: str | None = None
    """each rank's price per hour for --cost-budget: RANKS:PRICE items
    (0-1:4,2:3.5; ranks as in --slowdown, every worker named once), or a
    cluster file of hybridagg plan (.yaml, .yml, .json, .toml) whose node
    types' price_per_hour is shared by their devices' ranks, nodes in the
    file's order"""

    cost_v: float = option(1.0, at_least=0)
    """the controller's V: weight of a second of batch time against the
    queue of overspent money times a candidate's price per hour (larger:
    follows batch time closer, and overspends longer before correcting)"""

    cost_slot: int = option(20, at_least=1)
    """steps per slot: the controller charges each slot's active prices for
    its measured seconds, then chooses the next slot's groups"""

    def _check(self) -> None:
        if self.cost_budget is None:
            for name, value, default in (
                ("prices", self.prices, None),
                ("cost_v", self.cost_v, 1.0),
                ("cost_slot", self.cost_slot, 20),
            ):
                if value != default:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(f"{flag} is for --cost-budget, which is not given")
            return
        if self.prices is None:
            raise ValueError(
                "--cost-budget needs --prices (each rank's price per hour)"
            )
        if self.cost_v <= 0:
            raise ValueError(f"--cost-v must be positive, got {self.cost_v}")
        if not _is_file(self.prices):
            _parse_items(self.prices)  # a malformed spec fails before launch


def _is_file(spec: str) -> bool:
    return spec.strip().lower().endswith(CLUSTER_SUFFIXES)


def _parse_items(spec: str) -> dict[int, float]:
    from ...slowdown import parse_rank_values

    return parse_rank_values(spec, "--prices", "price", positive=False)


def _cluster_prices(path: str) -> list[float]:
    from ...sim.cluster import load_cluster

    if not Path(path).is_file():
        raise ValueError(f"--prices {path}: no such cluster file")
    cluster = load_cluster(path)
    out: list[float] = []
    for node_type in cluster.node_types:
        if node_type.devices == 0:  # (nodes of servers only hold no worker)
            continue
        share = node_type.price_per_hour / node_type.devices
        out += [share] * (node_type.count * node_type.devices)
    return out


def rank_prices(spec: str, workers: int) -> list[float]:
    """Each of ``workers`` ranks' price per hour, from ``--prices``.

    Raises:
        ValueError: A malformed spec, a bad cluster file, a rank outside
            the job or one left without a price, or a cluster file with
            fewer devices than the job has workers.
    """
    if _is_file(spec):
        prices = _cluster_prices(spec.strip())
        if len(prices) < workers:
            raise ValueError(
                f"--prices {spec}: the cluster has {len(prices)} devices, the "
                f"job {workers} workers"
            )
        return prices[:workers]
    named = _parse_items(spec)
    outside = sorted(r for r in named if r >= workers)
    missing = [r for r in range(workers) if r not in named]
    if outside or missing:
        raise ValueError(
            f"--prices must name every worker rank 0-{workers - 1} once; "
            + (f"ranks {outside} are not workers of the job" if outside else "")
            + ("; " if outside and missing else "")
            + (f"ranks {missing} have no price" if missing else "")
        )
    return [named[r] for r in range(workers)]
