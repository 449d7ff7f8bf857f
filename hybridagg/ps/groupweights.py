"""How a leader hands the servers' weights and news to the rest of its group.

After each exchange with the servers the leader broadcasts, inside its
group, a small header (:class:`GroupHeader`) and, when new weights came,
the weights and buffers, flat.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch

from ..comm import Comm, alloc
from .flat import flatten_into, unflatten_from

__all__ = ["GROUP_HEAD_LEN", "GroupHeader", "GroupWeights"]


@dataclass(frozen=True)
class GroupHeader:
    """What a leader tells its group after an exchange (broadcast as float64).

    Attributes:
        stop: Every group is to stop.
        new_weights: The weights follow.
        staleness: Staleness of the group's last update.
        lr_scale: Factor the servers applied to its rates.
        checkpoint: Newest checkpoint requested (after a resume: the one
            resumed from, which counts as saved).
        advice: Batch size from server 0 (0: none).
        version: Newest server version the group has seen.
        nonfinite: The group whose loss or gradient was not finite, which
            stopped every group (``None``: none).
    """

    stop: bool = False
    new_weights: bool = False
    staleness: int = 0
    lr_scale: float = 1.0
    checkpoint: int = 0
    advice: float = 0.0
    version: int = 0
    nonfinite: int | None = None

    def encode_into(self, head: torch.Tensor) -> torch.Tensor:
        """Write the header into ``head`` (:data:`GROUP_HEAD_LEN` float64); returns it."""
        values = [float(x) for x in astuple(self)[:-1]]
        values.append(-1.0 if self.nonfinite is None else float(self.nonfinite))
        head[:] = torch.tensor(values, dtype=torch.float64)
        return head

    @classmethod
    def decode(cls, head: torch.Tensor) -> GroupHeader:
        """Read a received header."""
        values = head.tolist()
        return cls(
            stop=bool(values[0]),
            new_weights=values[1] > 0,
            staleness=int(values[2]),
            lr_scale=float(values[3]),
            checkpoint=int(values[4]),
            advice=float(values[5]),
            version=int(values[6]),
            nonfinite=None if values[7] < 0 else int(values[7]),
        )


GROUP_HEAD_LEN = len(fields(GroupHeader))


class GroupWeights:
    """A group's copy of the model in flight, and its broadcast from the leader.

    Args:
        comm: The group's own communicator for this traffic (leader: rank 0).
        params: The model's parameters (model order).
        buffers: Its floating buffers.
        is_leader: Whether this rank is the group's leader.
    """

    def __init__(
        self,
        comm: Comm,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        is_leader: bool,
    ) -> None:
        self.comm, self.params, self.buffers = comm, params, buffers
        self.is_leader = is_leader
        numel = sum(p.numel() for p in params)
        pinned = params[0].device.type == "cuda"  # (copies to a GPU: DMA)
        self.weights = alloc(numel, params[0].dtype, zero=False, pinned=pinned)
        nbuf = sum(b.numel() for b in buffers)
        self.flat_buffers = (
            alloc(nbuf, torch.float64, zero=False, pinned=pinned) if nbuf else None
        )
        self.head = torch.zeros(GROUP_HEAD_LEN, dtype=torch.float64)

    def broadcast(
        self, header: GroupHeader | None, what: str = "weights"
    ) -> GroupHeader:
        """Share the leader's header and, if it says so, the model's weights.

        Args:
            header: On the leader, what to tell the group; ``None`` elsewhere.
            what: What is shared, for timeout messages.

        Returns:
            The header; on a member whose header says ``new_weights``, the
            model now holds the leader's weights and buffers.
        """
        if self.is_leader:
            header.encode_into(self.head)
            if header.new_weights:
                self._pack()
        self.comm.Bcast(self.head, 0, what=f"{what} header from the group leader")
        got = GroupHeader.decode(self.head)
        if got.new_weights:
            reqs = [self.comm.Ibcast(self.weights, 0)]
            if self.flat_buffers is not None:
                reqs.append(self.comm.Ibcast(self.flat_buffers, 0))
            self.comm.wait(reqs, f"{what} from the group leader")
            if not self.is_leader:
                self._unpack()
        return got

    def _pack(self) -> None:
        flatten_into(self.weights, self.params)
        if self.flat_buffers is not None:
            flatten_into(self.flat_buffers, self.buffers)

    def _unpack(self) -> None:
        unflatten_from(self.weights, self.params)
        if self.flat_buffers is not None:
            unflatten_from(self.flat_buffers, self.buffers)
