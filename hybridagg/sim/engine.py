"""The simulation itself, on SimGrid's s4u API: a platform, actors, flows.

Run in a process of its own (``python -m hybridagg.sim.engine JOB.json
RESULT.json``; :func:`hybridagg.sim.simulate.simulate` does it): SimGrid
allows one engine per process.

**Platform.** One Dijkstra zone: a core router; per node a router joined to
it by the node's link (``inter``, split-duplex: each direction has the full
bandwidth) and, when the cluster has one that limits, the core switch
(``core``: every message between nodes shares it); per device a host
joined to its node's router by the node's ``intra`` link. A node of shared
cores is one host with that many cores, joined to the core router
directly; transfers between its ranks are memory copies executed on its
cores (they contend with compute and with server updates). Each link
carries half its latency, so a message inside a node pays the ``intra``
latency and one between nodes pays ``intra + inter`` (and the core's).
Network model ``CM02`` without cross-traffic: a lone transfer of ``B`` bytes
over a route takes exactly ``latency + B / bandwidth``, and concurrent
transfers share links max-min fairly.

**Actors.** One actor per worker, on its host: its compute (an execution
on its host's cores, or a sleep for ``--sample-ms``, whose emulation
sleeps), its hop of the group's all-reduce, and its hop of the broadcast of
new weights; a group's members meet at a SimGrid barrier where a step's
data must all have arrived. The leader also pushes the group's gradient to
the servers and waits for their replies (hybrid, async; with ``--overlap``
the replies of the previous push, so the exchange runs during the step);
it flattens the gradient before and copies the reply's weights into its
model after (``copy_s``), and in a group of several flattens them again
for the broadcast, which each member copies in. Every worker zeroes its
gradient and checks the reduced one each step (``grad_s``); sync workers
update the model themselves after the reduction (``update_s``). A
leader's exchange with a server on another host goes in the run's parts
(``SimJob.part_bytes``: ``HYBRIDAGG_PS_PART_BYTES`` of the server's float32
shard): a pusher actor per leader sends them one after another, and the
server updates and returns each as it arrives, so the push, the updates
and the reply overlap (a held reply goes whole once its push is). Each
part pays the route's latency in turn, where a run's stream of sends pays
it about once: ``parts x latency`` more per push. One actor per server,
serving pushes (and rank 0's pulls) in arrival order: on its node of
shared cores it copies a leader's push in itself, as the receiver of a
large message on shared memory does; its update costs ``server_update_s +
master bytes x server_byte_s`` of its host's time (the float32 master
weights of its shard, whatever the wire); a leader on its node copies the
reply in itself. With ``SimJob.server_bank``
(:func:`hybridagg.sim.job.bank_servers`: 4,096 pushes a round or more,
interchangeable servers) the servers are one bank: one host behind their
links side by side, one actor, a push and a reply each a train of parts of
the whole gradient, each update one shard's cost; a simulated event (a
simcall: a thread switch in the Python binding) per server per push, and as
many concurrent flows, are what made 1,024 async leaders with 64 servers
take more than 300 s.
The reduction runs one collective per gradient bucket, one after another
in the reducer's order, each starting when backward has filled its bucket
(the profile's bucket schedule), so it overlaps the rest of backward as in
a run; the buckets before the last run on a second actor per rank (the
reducer's progress), fed through semaphores, and the worker runs the last
one itself. A ring all-reduce bucket is one flow per ring link, started once every
rank of the group has the bucket (each phase needs the neighbour's data,
so no rank's copies run ahead): its ``2(n-1)`` phases move the same
``bytes/n`` over the same links in turn, so one flow per link carries all
of them (``2(n-1)/n x bytes``) and the
phases' remaining ``2n-3`` latencies are slept; every bucket so pays
``2(n-1)(latency + bytes/(n bandwidth))`` exactly, at one simulated
transfer per rank, not ``2(n-1)`` (a Python actor costs about 150 us per
simulated message). Sync with several groups is hierarchical, as
``SyncOptimizer`` is: per bucket a chain reduce to the leader, the
leaders' ring, a chain broadcast, each stage an actor per rank so that the
stages of different buckets overlap (with one bucket the worker runs them
in turn itself).
The broadcast is a pipelined chain: one flow of the full weights per link.
Rank 0 validates every ``--eval-every`` updates, as a run does (the
profile's ``validation_s``, executed on its host; with servers after
pulling the weights: a request queued at each server behind the pushes
before it, the server's copy of its part and the transfer, then rank 0's
copies around it, :data:`PULL_COPIES`): a run's wall
time, and so its samples per second, includes it; in sync every rank
waits for it at the next reduction, in hybrid its group at the next barrier.
Hybrid and async runs of a number of samples (``--epochs``) draw them as a
run's dynamic shares do (:mod:`.loader`): chunks of an epoch from one
counter that runs on across epochs, each worker's loader holding
``SimJob.claim_ahead`` batches cut beyond the one it computes and
``windows_ahead`` chunks drawn beyond the one it cuts; an update of a group
that carries no samples ends the group's epoch, and its last epoch its
training; the run ends when the last drawn batch is pushed, so a slow
worker's draws are the run's tail. (A job without ``epoch_samples`` draws
one pool a batch at a time.)
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ..ps.staleness import GroupBook, HeldReply
from ._simgrid import load
from .job import PULL_COPIES, SimJob
from .loader import Chunks, WorkerLoader

__all__ = ["main", "run"]

PULL = (-1, 0, 0, 0, 1)
"""Rank 0's pull of the weights for a validation, in a server's mailbox."""

SIMGRID_CONFIG = (
    "--cfg=network/model:CM02",
    "--cfg=network/crosstraffic:0",
    "--log=root.thresh:critical",
)


@dataclass
class _State:
    """What the actors share (one process, one Python heap)."""

    stopped: bool = False
    stop_time: float | None = None
    stop_updates: int = 0
    stop_samples: int = 0
    version: int = 0
    samples: int = 0
    staleness: list[int] = field(default_factory=list)
    unclaimed: int = 0  # dynamic shares: the run's samples no worker has claimed
    chunks: Chunks | None = None  # dynamic shares by epoch: the chunk counter
    group_times: dict[int, list[float]] = field(default_factory=dict)
    # (time, samples so far) at each update: the second half's rate
    timeline: list[tuple[float, int]] = field(default_factory=list)


def steady_rate(timeline: list[tuple[float, int]], end: float) -> float | None:
    """Samples per second over the second half of the updates made by
    ``end`` (``timeline``: (time, samples so far) per update, in order),
    from the time of the middle update to the time of the last; ``None``
    with fewer than two updates or no time between them.

    The first rounds of a run with many leaders carry a start-up transient
    (every leader pushes at once, and the servers' queue takes rounds to
    spread), which a whole run's mean keeps and a long training run does not.
    """
    done = [(t, n) for t, n in timeline if t <= end]
    if len(done) < 2:
        return None
    (t0, n0), (t1, n1) = done[(len(done) - 1) // 2], done[-1]
    return (n1 - n0) / (t1 - t0) if t1 > t0 else None


_POLL_S = 1e9
"""A polling wait's work: longer than any run (it is killed when the wait ends)."""


def _even_bytes(total: float, count: int) -> list[int]:
    """``total`` bytes (rounded) cut into ``count`` whole parts as even as can be."""
    edges = [round(round(total) * i / count) for i in range(count + 1)]
    return [b - a for a, b in itertools.pairwise(edges)]


class _Sim:
    def __init__(self, job: SimJob) -> None:
        self.job = job
        self.sg = sg = load()
        self.engine = sg.Engine(["hybridagg-simulate", *SIMGRID_CONFIG])
        self.state = _State(unclaimed=int(job.target_samples or 0))
        if job.epoch_samples and job.target_samples and job.mode != "sync":
            chunk = job.chunk_samples or int(job.workers[0]["batch"])
            self.state.chunks = Chunks(
                job.target_samples // job.epoch_samples, job.epoch_samples, chunk
            )
        self._latency: dict[tuple[int, int], float] = {}
        self._rings: dict[tuple[tuple[int, ...], bool], float] = {}
        self._eval_bucket = 0  # rank 0's last validation, as eval_every buckets
        self._build_platform()

    # ------------------------------------------------------------- platform
    def _link(self, zone, name: str, spec: dict[str, float]):
        link = zone.create_split_duplex_link(name, float(spec["bandwidth"]))
        link.set_latency(float(spec["latency"]) / 2)
        return link.seal()

    def _attach(self, zone, a, b, *links) -> None:
        up = [
            self.sg.LinkInRoute(link, self.sg.LinkInRoute.Direction.UP)
            for link in links
        ]
        zone.add_route(a, b, None, None, up, True)

    def _uplink(self, zone, n: int) -> list:
        """Node ``n``'s links up to the core router: its NIC, then the core
        switch (when it limits). Routes are symmetrical, so a message
        between nodes crosses the core's UP direction on the way in and its
        DOWN on the way out: all of them share its bandwidth, whichever way
        they go."""
        nic = self._link(zone, f"nic{n}", self.job.inter)
        return [nic] if self.core is None else [nic, self.core]

    def _build_platform(self) -> None:
        sg, job = self.sg, self.job
        zone = sg.NetZone.create_dijkstra_zone("cluster")
        core = zone.create_router("core")
        self.worker_host: list[Any] = []
        self.server_host: list[Any] = []
        node_hosts: list[list[Any]] = []
        node_router: list[Any] = []
        self.core = (
            None if job.core is None else self._link(zone, "core-switch", job.core)
        )
        if job.server_bank:
            self._build_bank(zone, core)
        for n, node in enumerate(job.nodes):
            if node["shared"]:
                host = zone.create_host(f"{node['name']}", float(node["speed"]))
                host.core_count = int(node["cores"])
                host.seal()
                self._attach(zone, host.netpoint, core, *self._uplink(zone, n))
                node_hosts.append([host])
                node_router.append(None)
            else:
                router = zone.create_router(f"r{n}")
                self._attach(zone, router, core, *self._uplink(zone, n))
                node_hosts.append([])
                node_router.append(router)
        for r, w in enumerate(job.workers):
            node = job.nodes[w["node"]]
            if node["shared"]:
                self.worker_host.append(node_hosts[w["node"]][0])
                continue
            host = zone.create_host(
                f"{node['name']}d{w['device']}", float(node["speed"])
            )
            host.seal()
            self._attach(
                zone,
                host.netpoint,
                node_router[w["node"]],
                self._link(zone, f"l{r}", node["intra"]),
            )
            self.worker_host.append(host)
        for s, srv in enumerate([] if job.server_bank else job.servers):
            node = job.nodes[srv["node"]]
            if node["shared"]:
                self.server_host.append(node_hosts[srv["node"]][0])
                continue
            host = zone.create_host(f"server{s}", float(srv["speed"]))
            host.seal()
            self._attach(
                zone,
                host.netpoint,
                node_router[srv["node"]],
                self._link(zone, f"sl{s}", node["intra"]),
            )
            self.server_host.append(host)
        # namespaces of one machine: what they execute runs on its cores
        self.machine = None
        if job.machine:
            self.machine = zone.create_host("machine", 1.0)
            self.machine.core_count = int(job.machine["cores"])
            self.machine.seal()
        zone.seal()
        self.host_node = {}
        for r, w in enumerate(job.workers):
            self.host_node[self.worker_host[r].name] = w["node"]
        for host, srv in zip(self.server_host, job.servers, strict=False):
            self.host_node[host.name] = srv["node"]
        # the bytes of one push (or reply) to each simulated server: a
        # pipelined group's leader (its first stage) sends its own part
        self.shard = job.grad_bytes / len(self.server_host) if self.server_host else 0
        self.group_shard = [
            self.shard
            if job.pipeline_of(g) is None
            else job.pipelines[g]["parts"][0] / max(1, len(self.server_host))
            for g in range(len(job.groups))
        ]
        # a leader's exchange with a server on another host goes in parts
        # (the run's client cuts each server's float32 shard so; a bank's
        # parts are its servers' parts side by side); a copy on a node of
        # shared cores is one (its fitted transfer is the pipelined one's)
        cut = job.exchange_parts()
        self.parts = [
            [
                1
                if job.pipeline_of(g) is not None
                or server.name == self.worker_host[ranks[0]].name
                else cut
                for server in self.server_host
            ]
            for g, ranks in enumerate(job.groups)
        ]
        # the parts' bytes: a server's shard cut evenly into whole bytes, a
        # bank's servers' parts side by side
        side = len(job.servers) // len(self.server_host) if self.server_host else 1
        self.part_sizes = [
            [side * b for b in _even_bytes(shard / side, cut)]
            for shard in self.group_shard
        ]

    def _build_bank(self, zone, core) -> None:
        """The servers as one bank (:func:`hybridagg.sim.job.bank_servers`):
        one host of a server's speed behind the servers' device links and
        node links side by side (``servers x`` the bandwidth, the same
        latencies: ``intra + inter`` from a leader), so a push of the whole
        gradient meets what its shards would on the servers' side. (Pooling
        the bank's link with the server nodes' own links was tried: it moved
        async at 256 ranks 6.5% from the servers simulated one by one, this
        0.4%.)"""
        job, count = self.job, len(self.job.servers)
        node = job.nodes[job.servers[0]["node"]]
        router = zone.create_router("bank")
        wide = {
            "bandwidth": count * job.inter["bandwidth"],
            "latency": job.inter["latency"],
        }
        nic = self._link(zone, "banknic", wide)
        self._attach(zone, router, core, nic, *([self.core] if self.core else []))
        host = zone.create_host("serverbank", float(job.servers[0]["speed"]))
        host.seal()
        device = {
            "bandwidth": count * node["intra"]["bandwidth"],
            "latency": node["intra"]["latency"],
        }
        self._attach(zone, host.netpoint, router, self._link(zone, "banksl", device))
        self.server_host.append(host)

    # ------------------------------------------------------------ transfers
    def _shared_node(self, host) -> dict[str, Any] | None:
        node = self.job.nodes[self.host_node[host.name]]
        return node if node["shared"] else None

    def latency(self, a, b) -> float:
        """Seconds of latency of one message from host ``a`` to host ``b``."""
        if a.name == b.name:
            node = self._shared_node(a)
            return float(node["intra"]["latency"]) if node else 0.0
        key = (id(a), id(b))
        if key not in self._latency:
            self._latency[key] = a.route_to(b)[1]
        return self._latency[key]

    def transfer(self, a, b, nbytes: float, *, server: bool = False) -> None:
        """Move ``nbytes`` from host ``a`` to ``b`` and wait: a flow (its
        route's latency, then the bytes), or on a node of shared cores a
        memory copy executed on its cores after the node's latency (the
        analytic model charges both the same way).

        The calling actor must be on ``a`` (SimGrid 3.32's Python binding hangs
        on an execution moved to another host, so copies run where their actor
        is). ``server``: a leader-server transfer (the node's ``server_link``
        when its profile was calibrated on bench/ps.py).
        """
        sg = self.sg
        if a.name != b.name:
            kernel = self._kernel(nbytes)
            sg.Comm.sendto_async(a, b, round(nbytes)).wait()
            for actor in kernel:
                actor.join()
            return
        node = self._shared_node(a)
        if node is None:
            return
        link = node.get("server_link") if server else None
        bandwidth, latency = (
            (link["bandwidth"], link["latency"])
            if link
            else (node["memcpy_Bps"], node["intra"]["latency"])
        )
        if latency > 0:
            sg.this_actor.sleep_for(float(latency))
        self._execute(nbytes / float(bandwidth) * a.speed)

    def _kernel(self, nbytes: float) -> list:
        """On one machine's namespaces, the kernel's work of moving
        ``nbytes`` between two of them: ``bytes / kernel_Bps`` on a core at
        each end, started now (join them); elsewhere none (a NIC moves the
        bytes)."""
        if self.machine is None or nbytes <= 0:
            return []
        seconds = nbytes / float(self.job.machine["kernel_Bps"])
        return [self._on_machine(seconds), self._on_machine(seconds)]

    def _on_machine(self, seconds: float):
        """An actor that executes ``seconds`` on the machine's cores (SimGrid
        3.32's Python binding hangs on an execution moved to another host,
        so an actor of its own runs it there)."""
        return self.sg.Actor.create("cpu", self.machine, self._cpu, seconds)

    def _cpu(self, seconds: float) -> None:
        self.sg.Actor.self().daemonize()
        self.sg.this_actor.exec_async(seconds).wait()

    def _post(self, box, payload: Any, nbytes: float, src, dst):
        """Send ``payload`` carrying ``nbytes`` from host ``src`` to ``box``,
        whose receiver is on ``dst``, without waiting: a message, or between
        namespaces of one machine a courier on ``dst`` that moves the bytes
        (:meth:`transfer`: the flow and the kernel's work) and then posts
        the payload there. Returns the courier (``None``: a message)."""
        if self.machine is None or src.name == dst.name or nbytes <= 0:
            box.put_init(payload, round(nbytes)).detach()
            return None
        return self.sg.Actor.create(
            "courier", dst, self._courier, box, payload, nbytes, src, dst
        )

    def _courier(self, box, payload: Any, nbytes: float, src, dst) -> None:
        self.sg.Actor.self().daemonize()
        self.transfer(src, dst, nbytes)
        box.put_init(payload, 0).detach()

    def _join(self, barrier) -> None:
        """Wait at ``barrier`` for the group's other ranks to start their
        ring; on one machine's namespaces the waiting rank polls a core
        meanwhile (its posted ring tests its requests in a loop: py-spy saw
        a quarter of a waiting rank's samples there, bench/RESULTS.md), an
        execution longer than any run, killed when the wait ends."""
        spinner = None if self.machine is None else self._on_machine(_POLL_S)
        barrier.wait()
        if spinner is not None:
            spinner.kill()

    def _ring_latency(self, ranks: list[int], closed: bool) -> float:
        """The largest latency of the ring (``closed``) or chain over ``ranks``
        (memoised: every rank asks every step, and a ring has 1,024 links)."""
        key = (tuple(ranks), closed)
        if key not in self._rings:
            hosts = [self.worker_host[r] for r in ranks]
            count = len(ranks) if closed else len(ranks) - 1
            self._rings[key] = max(
                self.latency(hosts[i], hosts[(i + 1) % len(ranks)])
                for i in range(count)
            )
        return self._rings[key]

    # --------------------------------------------------------------- actors
    def _count(self, samples: int) -> None:
        """An update happened; stop once the steps or samples are reached."""
        st, job = self.state, self.job
        st.version += 1
        st.samples += samples
        st.timeline.append((self.engine.clock, st.samples))
        done = (job.steps is not None and st.version >= job.steps) or (
            job.target_samples is not None and st.samples >= job.target_samples
        )
        if done and not st.stopped:
            st.stopped, st.stop_time = True, self.engine.clock
            st.stop_updates, st.stop_samples = st.version, st.samples

    def worker(self, group: int, position: int) -> None:
        """One worker: compute (each bucket handed to this rank's reduction
        actors when backward fills it), the end of the group's reduction,
        and (the leader) the exchange with the servers, then its hop of the
        broadcast.

        The members meet at the group's barrier where a step's data must all
        have arrived: after the reduction, after the leader's exchange, after
        the broadcast's flows (sync: after the reduction only; hierarchical
        sync: its last broadcast already kept every group in step). A member
        reads the stop decision only after a barrier that follows the
        leader's writing it, and before the leader can write the next one
        (behind the next step's barrier).
        """
        job, st = self.job, self.state
        ranks = job.groups[group]
        n = len(ranks)
        rank = ranks[position]
        host = self.worker_host[rank]
        shared = self.groups_shared[group]
        leader = position == 0
        barrier = shared["barrier"]
        reduction = self.reduction.get(rank)  # (ready, done) semaphores
        last_bucket = len(job.buckets) - 1
        # nothing overlaps the last bucket's reduction: the worker runs it
        # itself after the actors' buckets (an actor costs simulated events;
        # one bucket needs none); hierarchical with several buckets: the
        # stage actors run every bucket, pipelined
        inline = (n > 1 or job.hierarchical) and (
            not job.hierarchical or last_bucket == 0
        )
        nbytes = job.grad_bytes
        chain_rest = (n - 2) * self._ring_latency(ranks, False) if n > 2 else 0.0
        nxt = self.worker_host[ranks[(position + 1) % n]]
        batch = job.workers[rank]["batch"]
        step_samples = sum(w["batch"] for w in job.workers)  # sync's update
        steps_done = 0
        releases = (
            0
            if reduction is None
            else len(job.buckets) if job.hierarchical else last_bucket
        )  # fmt: skip
        pool = job.mode != "sync" and job.target_samples is not None
        held: list[int] = []  # dynamic shares: batches claimed, not yet computed
        loader = self._loader(batch)
        while True:
            if leader:  # the weights this step's gradient is computed on
                shared["computed_on"] = shared["weights"]
            mine = batch
            if pool:
                mine = loader.next_batch() if loader else self._claim(held, batch)
                shared["samples_of"][position] = mine  # summed after the barrier
            # the gradient zeroed (and, after the reduction, checked)
            self._execute(job.workers[rank]["grad_s"])
            self._compute(rank, mine, releases)
            if reduction is not None:
                reduction[1].acquire()
            if inline:  # the last bucket (every stage), by this actor itself
                self._reduce_inline(group, position, job.buckets[-1][1])
            if job.mode == "sync":
                if barrier is not None and not job.hierarchical:
                    barrier.wait()
                self._execute(job.workers[rank]["update_s"])
                # every member counts the updates itself (the same rule as
                # _count), so no barrier is needed to stop together
                steps_done += 1
                if leader:
                    if group == 0:
                        self._count(step_samples)
                    st.group_times.setdefault(group, []).append(self.engine.clock)
                if (job.steps is not None and steps_done >= job.steps) or (
                    job.target_samples is not None
                    and steps_done * step_samples >= job.target_samples
                ):
                    return
                if rank == 0:  # the others wait for it at the next reduction
                    self._validate(host)
                continue
            if n > 1:
                barrier.wait()
            # (every member wrote its samples before the barrier, and none
            # rewrites them before the next step's: the barriers between)
            group_samples = sum(shared["samples_of"]) if pool else None
            if group_samples == 0:
                # an update that carries no samples ends the group's epoch
                # (the run's rule: every member has read its share), and
                # with one pool its training; every member sees it alike
                if loader is None or loader.next_epoch():
                    return
                if n > 1:  # every member has summed before any draws again
                    barrier.wait()
                continue
            if leader:
                shared["bcast"] = self._leader_step(group, ranks, group_samples)
                shared["stop"] = st.stopped  # read by all after the barrier
            if n > 1:
                barrier.wait()
            stop = shared["stop"]
            if shared["bcast"] and n > 1:
                # (the leader flattened the weights before the barrier)
                if position < n - 1:
                    self.transfer(host, nxt, nbytes)
                barrier.wait()
                if chain_rest > 0:
                    self.sg.this_actor.sleep_for(chain_rest)
                if not leader:  # the weights into its model
                    self._execute(job.workers[rank]["copy_s"])
            if leader:
                st.group_times.setdefault(group, []).append(self.engine.clock)
            if stop:
                return
            if rank == 0:  # its group waits for it at the next barrier
                self._validate(host)

    def stage(self, group: int, position: int) -> None:
        """One stage of a pipelined group (hybrid; :mod:`.pipelines`): the
        group's batch through the schedule (its exact time, every stage busy
        until the batch is through), then every stage's part of the gradient
        to the servers at once (the first stage's with the step's header,
        which the servers count as the update, and its reply), and each later
        stage's part of the new weights back once the update is made. The
        stages meet at the group's barrier after the batch is claimed, after
        the pushes and the leader's exchange, and after the replies."""
        job, st = self.job, self.state
        spec = job.pipelines[group]
        ranks = job.groups[group]
        rank = ranks[position]
        host = self.worker_host[rank]
        shared = self.groups_shared[group]
        leader = position == 0
        barrier = shared["barrier"]
        part = spec["parts"][position] / max(1, len(self.server_host))
        batch = int(job.workers[ranks[0]]["batch"])
        pool = job.target_samples is not None
        held: list[int] = []
        loader = self._loader(batch) if leader else None
        while True:
            if leader:
                shared["computed_on"] = shared["weights"]
                # the first stage's loader claims, as a worker's does
                mine = batch
                if pool:
                    mine = loader.next_batch() if loader else self._claim(held, batch)
                shared["samples_of"][0] = mine
                # an update with no samples ends the group's epoch (and with
                # one pool, or after the last epoch, its training)
                shared["over"] = mine == 0 and (loader is None or loader.next_epoch())
            barrier.wait()
            mine = shared["samples_of"][0]
            if shared["over"]:
                return
            if mine == 0:
                barrier.wait()  # every stage has read it before the next draw
                continue
            seconds = job.pipeline_step_seconds(group)
            self.sg.this_actor.sleep_for(seconds * mine / batch)
            # every stage pushes its part at once (the run's stage clients);
            # the leader's push carries the header the servers count
            if leader:
                self._leader_step(group, ranks, mine)
                shared["stop"] = st.stopped
            else:
                self._scatter(host, part, to_servers=True)
            barrier.wait()  # the update is made: each stage takes its part back
            if not leader:
                self._scatter(host, part, to_servers=False)
            barrier.wait()  # every stage holds its new weights
            if leader:
                st.group_times.setdefault(group, []).append(self.engine.clock)
            if shared["stop"]:
                return
            if rank == 0:
                self._validate(host)

    def _loader(self, batch: int) -> WorkerLoader | None:
        """A worker's loader drawing its epoch's chunks (``None``: one pool,
        a batch at a time, :meth:`_claim`; or no dynamic shares)."""
        if self.state.chunks is None:
            return None
        job = self.job
        return WorkerLoader(
            self.state.chunks, batch, job.claim_ahead, job.windows_ahead
        )

    def _claim(self, held: list[int], batch: int) -> int:
        """The samples of the next step under dynamic shares: the loader
        claims ahead of the step it computes (its read-ahead, ``held``), and
        what is claimed is this worker's to compute (0: the pool is empty)."""
        st = self.state
        while len(held) < 1 + self.job.claim_ahead and st.unclaimed > 0:
            take = min(batch, st.unclaimed)
            st.unclaimed -= take
            held.append(take)
        return held.pop(0) if held else 0

    def _scatter(self, host, nbytes: float, *, to_servers: bool) -> None:
        """``nbytes`` between ``host`` and every server at once (flows; a
        server on ``host``'s node of shared cores: a copy)."""
        flows, kernel = [], []
        for server in self.server_host:
            if server.name == host.name:
                self.transfer(host, server, nbytes, server=True)
                continue
            kernel += self._kernel(nbytes)
            if to_servers:
                flows.append(self.sg.Comm.sendto_async(host, server, round(nbytes)))
            else:
                flows.append(self.sg.Comm.sendto_async(server, host, round(nbytes)))
        for flow in flows:
            flow.wait()
        for actor in kernel:
            actor.join()

    def _validate(self, host) -> None:
        """Rank 0 validates once an ``--eval-every`` boundary of the updates
        has been crossed since its last validation (the run's rule,
        :class:`hybridagg.train.worker.validation.Validation`): with servers,
        it first pulls the weights from every server, then it evaluates."""
        job, st = self.job, self.state
        if not job.eval_every or job.validation_s <= 0:
            return
        bucket = st.version // job.eval_every
        if bucket <= self._eval_bucket:
            return
        self._eval_bucket = bucket
        if job.validation_pull:
            # a pull queues at each server behind the pushes before it
            for s in range(len(self.server_host)):
                self.sg.Mailbox.by_name(f"server{s}").put_init(PULL, 0).detach()
            box = self.sg.Mailbox.by_name("pull")
            for _ in self.server_host:
                box.get()
            self._copy_in(host, job.master_bytes / len(self.server_host))
            self._execute(PULL_COPIES * job.workers[0]["copy_s"])
        # (work on rank 0's host: on shared cores it contends with the rest)
        self._execute(job.validation_s * host.speed)

    def _serve_pull(self, host) -> None:
        """A server answers rank 0's pull: its part of the weights copied to
        reply from, then sent (on rank 0's node of shared cores: copied)."""
        job = self.job
        count = len(self.server_host)
        self._execute(job.workers[0]["copy_s"] / count)
        # to rank 0 on this node of shared cores a notice: it copies the
        # weights in itself (:meth:`_validate`)
        part = job.master_bytes / count
        rank0 = self.worker_host[0]
        size = 0 if rank0.name == host.name else part
        self._post(self.sg.Mailbox.by_name("pull"), PULL, size, host, rank0)

    # ----------------------------------------------------- the reduction
    def ring(self, group: int, position: int) -> None:
        """A rank's part of its group's ring all-reduce, one bucket after
        another as the reducer posts them: one flow per bucket carrying its
        ``2(n-1)/n`` share over the ring link, then the bucket's remaining
        ``2n-3`` phase latencies (every bucket pays the ring's ``2(n-1)``); the
        worker runs the last bucket itself (:meth:`_reduce_inline`)."""
        sg, job = self.sg, self.job
        sg.Actor.self().daemonize()
        ranks = job.groups[group]
        n = len(ranks)
        host = self.worker_host[ranks[position]]
        nxt = self.worker_host[ranks[(position + 1) % n]]
        ready, done = self.reduction[ranks[position]]
        joined = self.groups_shared[group]["ring_barrier"]
        per_link = 2 * (n - 1) / n * job.grad_bytes
        rest = (2 * n - 3) * self._ring_latency(ranks, True)
        while True:
            for _ready, share in job.buckets[:-1]:  # (the worker runs the last)
                ready.acquire()
                self._join(joined)  # a ring moves once every rank has the bucket
                self.transfer(host, nxt, per_link * share)
                if rest > 0:
                    sg.this_actor.sleep_for(rest)
            done.release()

    def _reduce_inline(self, group: int, position: int, share: float) -> None:
        """One bucket's whole reduction on this rank's own actor, as
        :meth:`ring` (flat) or the three stages one after another
        (hierarchical, one bucket: nothing to pipeline)."""
        sg, job = self.sg, self.job
        ranks = job.groups[group]
        n = len(ranks)
        host = self.worker_host[ranks[position]]
        if not job.hierarchical:
            if n > 1:  # a ring moves once every rank has the bucket
                self._join(self.groups_shared[group]["ring_barrier"])
            self.transfer(
                host, self.worker_host[ranks[(position + 1) % n]],
                2 * (n - 1) / n * job.grad_bytes * share,
            )  # fmt: skip
            rest = (2 * n - 3) * self._ring_latency(ranks, True)
            if rest > 0:
                sg.this_actor.sleep_for(rest)
            return
        shared = self.groups_shared[group]
        chain = (n - 2) * self._ring_latency(ranks, False) if n > 2 else 0.0
        if position > 0:
            self.transfer(
                host, self.worker_host[ranks[position - 1]], job.grad_bytes * share
            )
        if n > 1:
            shared["reduce_barrier"].wait()
        if position == 0:
            if chain > 0:
                sg.this_actor.sleep_for(chain)
            leaders = [g[0] for g in job.groups]
            count = len(leaders)
            self.transfer(
                host, self.worker_host[leaders[(group + 1) % count]],
                2 * (count - 1) / count * job.grad_bytes * share,
            )  # fmt: skip
            rest = (2 * count - 3) * self._ring_latency(leaders, True)
            if rest > 0:
                sg.this_actor.sleep_for(rest)
            self.cross_barrier.wait()
        if n > 1:
            shared["bcast_barrier"].wait()  # the leader has the sum
            if position < n - 1:
                self.transfer(
                    host, self.worker_host[ranks[position + 1]], job.grad_bytes * share
                )
            shared["bcast_barrier"].wait()
            if chain > 0:
                sg.this_actor.sleep_for(chain)

    def reduce_stage(self, group: int, position: int) -> None:
        """Hierarchical sync, per bucket: a pipelined chain reduce to the
        leader (member ``i`` sends the bucket to ``i-1``, every link one flow,
        then the chain's remaining ``n-2`` latencies)."""
        sg, job = self.sg, self.job
        sg.Actor.self().daemonize()
        ranks = job.groups[group]
        n = len(ranks)
        host = self.worker_host[ranks[position]]
        prev = self.worker_host[ranks[position - 1]] if position > 0 else None
        ready, _done = self.reduction[ranks[position]]
        shared = self.groups_shared[group]
        rest = (n - 2) * self._ring_latency(ranks, False) if n > 2 else 0.0
        while True:
            for _ready, share in job.buckets:
                ready.acquire()
                if prev is not None:
                    self.transfer(host, prev, job.grad_bytes * share)
                if n > 1:
                    shared["reduce_barrier"].wait()
                if position == 0:
                    if rest > 0:
                        sg.this_actor.sleep_for(rest)
                    shared["to_cross"].release()

    def cross_stage(self, group: int) -> None:
        """Hierarchical sync, on a leader, per bucket: its hop of the ring
        all-reduce across the leaders (as :meth:`ring`); the leaders meet
        when every hop is done (the sum is complete nowhere before)."""
        sg, job = self.sg, self.job
        sg.Actor.self().daemonize()
        leaders = [g[0] for g in job.groups]
        count = len(leaders)
        host = self.worker_host[leaders[group]]
        nxt = self.worker_host[leaders[(group + 1) % count]]
        shared = self.groups_shared[group]
        per_link = 2 * (count - 1) / count * job.grad_bytes
        rest = (2 * count - 3) * self._ring_latency(leaders, True)
        while True:
            for _ready, share in job.buckets:
                shared["to_cross"].acquire()
                self.transfer(host, nxt, per_link * share)
                if rest > 0:
                    sg.this_actor.sleep_for(rest)
                self.cross_barrier.wait()
                shared["to_bcast"].release()

    def bcast_stage(self, group: int, position: int) -> None:
        """Hierarchical sync, per bucket: the leader's sum down the group's
        pipelined chain (as the hybrid broadcast); the rank's reduction is
        done after the last bucket's."""
        sg, job = self.sg, self.job
        sg.Actor.self().daemonize()
        ranks = job.groups[group]
        n = len(ranks)
        host = self.worker_host[ranks[position]]
        nxt = self.worker_host[ranks[position + 1]] if position < n - 1 else None
        _ready, done = self.reduction[ranks[position]]
        shared = self.groups_shared[group]
        rest = (n - 2) * self._ring_latency(ranks, False) if n > 2 else 0.0
        while True:
            for _ready, share in job.buckets:
                if position == 0:
                    shared["to_bcast"].acquire()
                if n > 1:
                    shared["bcast_barrier"].wait()  # the leader has the sum
                    if nxt is not None:
                        self.transfer(host, nxt, job.grad_bytes * share)
                    shared["bcast_barrier"].wait()
                    if rest > 0:
                        sg.this_actor.sleep_for(rest)
            done.release()

    def _execute(self, amount: float) -> None:
        """Work on this actor's host (``amount``: seconds at speed 1), or on
        one machine's namespaces on that machine's cores."""
        if amount <= 0:
            return
        if self.machine is None:
            self.sg.this_actor.exec_async(amount).wait()
            return
        self._on_machine(amount / self.sg.this_actor.get_host().speed).join()

    def _compute(self, rank: int, samples: int, releases: int) -> None:
        """A worker's compute of ``samples``, handing bucket ``b`` to its
        reduction actors (``b < releases``) once backward has filled it.

        With ``--accumulate`` the passes before the last reduce nothing; the
        buckets fill during the last pass's backward, each handed over then
        (its reduction overlaps the rest of backward). Paced
        (``sleep_compute``): the model's own compute executes at once on the
        host (hidden under the sleeps, as the pacer's per-layer sleeps
        absorb it), each bucket is handed over when the step's clock
        reaches it, and the part the pacer cannot hide (``paced_tail``)
        executes after the last sleep, before the buckets that wait for it
        (those backward fills at its very end).
        """
        job, sg = self.job, self.sg
        reduction = self.reduction.get(rank)
        clock = self.engine.clock
        w = job.workers[rank]
        tail = 0.0
        if job.sleep_compute:
            total = job.compute_seconds(rank, samples, clock)  # the pacer's
            executed = job.executed_amount(rank, samples, clock)
            tail = executed * w["paced_tail"]
            self._execute(executed - tail)
        else:  # an amount: the host's speed (and sharing) sets the time
            total = job.executed_amount(rank, samples, clock)
        backward = total / max(1, int(job.accumulate)) * (1 - job.forward_share)
        spent = 0.0

        def until(point: float) -> None:  # compute up to ``point`` of ``total``
            nonlocal spent
            if job.sleep_compute:
                left = clock + point - self.engine.clock
                if left > 0:
                    sg.this_actor.sleep_for(left)
            elif point > spent:
                # (compute between two buckets is one activity: each costs a simcall)
                self._execute(point - spent)
            spent = max(spent, point)

        for ready, _share in job.buckets[:releases]:
            until(total - backward * (1 - ready))
            if tail > 0 and ready >= 1.0:
                self._execute(tail)
                tail = 0.0
            reduction[0].release()
        until(total)
        self._execute(tail)

    def _leader_step(
        self, group: int, ranks: list[int], samples: int | None = None
    ) -> bool:
        """The leader's part of a step after the all-reduce (``samples``: the
        group's, default every member's batch); whether the group broadcasts
        new weights now."""
        sg, job = self.sg, self.job
        shared = self.groups_shared[group]
        if samples is None:
            samples = sum(job.workers[r]["batch"] for r in ranks)
        host = self.worker_host[ranks[0]]
        shard = self.group_shard[group]
        # (a pipeline's stages: their parts' copies are not modelled)
        copy = (
            job.workers[ranks[0]]["copy_s"] if job.pipeline_of(group) is None else 0.0
        )
        bcast = False
        if shared["pending"]:  # --overlap: the previous push's replies
            shared["weights"] = self._replies(group, host)
            shared["pending"] = False
            self._execute(copy)  # the weights into the model
            bcast = True
        self._execute(copy)  # the gradient flattened for the push
        head = (group, shared["computed_on"], samples)
        for s, server in enumerate(self.server_host):
            if self.parts[group][s] > 1:
                continue  # (the group's pusher sends these, part by part)
            # on the server's node of shared cores a notice: the server
            # copies the push in itself (the receiver copies a large
            # message on shared memory)
            size = 0 if server.name == host.name else shard
            box = sg.Mailbox.by_name(f"server{s}")
            self._post(box, (*head, 0, 1), size, host, server)
        if max(self.parts[group], default=1) > 1:
            shared["outbox"].put_init(head, 0).detach()
        shared["pending"] = True
        if not job.overlap:
            shared["weights"] = self._replies(group, host)
            shared["pending"] = False
            self._execute(copy)  # the weights into the model
            bcast = True
        if bcast and len(ranks) > 1:
            self._execute(copy)  # the weights flattened for the group's broadcast
        return bcast

    def pusher(self, group: int) -> None:
        """The leader's sends of its pushes' parts to the servers on other
        hosts, as its client posts them: one part after another, each to
        every such server at once (a part reaches its server one part's
        transfer after the push begins, and the server updates and returns
        it while the next one moves)."""
        sg = self.sg
        sg.Actor.self().daemonize()
        outbox = self.groups_shared[group]["outbox"]
        targets = [s for s, count in enumerate(self.parts[group]) if count > 1]
        sizes = self.part_sizes[group]
        boxes = [sg.Mailbox.by_name(f"server{s}") for s in targets]
        host = self.worker_host[self.job.groups[group][0]]
        while True:
            head = outbox.get()
            for part, size in enumerate(sizes):
                payload = (*head, part, len(sizes))
                if self.machine is None:
                    flows = [box.put_async(payload, round(size)) for box in boxes]
                    for flow in flows:
                        flow.wait()
                    continue
                # (between one machine's namespaces couriers carry them: _post)
                couriers = [
                    self._post(box, payload, size, host, self.server_host[s])
                    for s, box in zip(targets, boxes, strict=True)
                ]
                for courier in couriers:
                    if courier is not None:
                        courier.join()

    def server(self, index: int) -> None:
        """Serve pushes in arrival order, part by part (a push from another
        host comes in parts, each updated and returned as it arrives, the
        first counted as the update); server 0 counts the versions and
        holds the reply to a group too far ahead (``--staleness-bound``: the
        run's own rule, :class:`hybridagg.ps.staleness.GroupBook`)."""
        sg, job, st = self.sg, self.job, self.state
        sg.Actor.self().daemonize()  # the run ends when the workers do
        me = sg.Mailbox.by_name(f"server{index}")
        me.set_receiver(sg.Actor.self())  # pushes move while the server works
        host = self.server_host[index]
        speed = float(job.servers[index]["speed"])
        book = GroupBook(len(job.groups), job.staleness_bound if index == 0 else None)
        version = 0
        held_version: dict[int, int] = {}  # the version a held reply carries
        pushes: dict[int, tuple[int, bool]] = {}  # group: (its version, held)
        master = job.master_bytes / len(job.servers)  # (a bank's too)
        while True:
            group, pulled, samples, part, parts = me.get()
            if group == PULL[0]:
                self._serve_pull(host)
                continue
            leader_host = self.worker_host[job.groups[group][0]]
            if leader_host.name == host.name:  # the push copied in
                self.transfer(leader_host, host, self.group_shard[group], server=True)
            seconds = master / parts * job.server_byte_s
            if part == 0:
                seconds += job.server_update_s
            self._execute(seconds * host.speed / speed)
            if part == 0:
                if index == 0:
                    st.staleness.append(version - pulled)
                    self._count(samples)
                version += 1
                book.record(group, version - 1 - pulled)
                pushes[group] = (version, book.too_far_ahead(group) and not st.stopped)
            mine, held = pushes[group]
            if not held:
                self._reply(index, group, mine, part if parts > 1 else None)
            if part < parts - 1:
                continue
            if held:  # (the run holds a push's reply once it is whole)
                book.hold(HeldReply(group, mine - 1 - pulled, 1.0))
                held_version[group] = mine
            for release in book.release(everyone=st.stopped):
                g = release.group
                self._reply(index, g, held_version.pop(g), None)

    def _reply(self, index: int, group: int, version: int, part: int | None) -> None:
        """Send part ``part`` (``None``: all) of server ``index``'s new
        weights to ``group``'s leader (of a pipelined group: its first
        stage's part of the shard)."""
        leader_host = self.worker_host[self.job.groups[group][0]]
        units, size = self.parts[group][index], self.group_shard[group]
        if part is not None:
            units, size = 1, self.part_sizes[group][part]
        # to a leader on this node of shared cores a notice: the leader
        # copies the reply in itself (:meth:`_replies`)
        if leader_host.name == self.server_host[index].name:
            size = 0
        box = self.groups_shared[group]["mailbox"]
        self._post(box, (version, units), size, self.server_host[index], leader_host)

    def _replies(self, group: int, host) -> int:
        """The leader of ``group`` (on ``host``) takes every server's reply,
        every part of it, copying in those from servers on its node of
        shared cores (the receiver of a large message on shared memory
        copies it); returns the newest version."""
        me = self.groups_shared[group]["mailbox"]
        missing, version = sum(self.parts[group]), 0
        while missing > 0:
            got, units = me.get()
            version, missing = max(version, got), missing - units
        self._copy_in(host, self.group_shard[group])
        return version

    def _copy_in(self, host, nbytes: float) -> None:
        """``nbytes`` from each server on ``host``'s node of shared cores,
        copied in by the receiver on ``host`` (its notice has arrived)."""
        for server in self.server_host:
            if server.name == host.name:
                self.transfer(server, host, nbytes, server=True)

    def _start_leader(self, group: int) -> None:
        """The leader's mailbox takes replies at once (they move while it computes)."""
        self.groups_shared[group]["mailbox"].set_receiver(self.sg.Actor.self())
        self.worker(group, 0)

    def _start_stage(self, group: int) -> None:
        """A pipelined group's first stage: its mailbox takes the replies."""
        self.groups_shared[group]["mailbox"].set_receiver(self.sg.Actor.self())
        self.stage(group, 0)

    def run(self) -> dict[str, Any]:
        sg, job = self.sg, self.job
        self.groups_shared = [
            {
                "barrier": sg.Barrier(len(ranks)) if len(ranks) > 1 else None,
                # the group's rings: every rank's hop of a bucket starts once
                # every rank has it (each phase needs its neighbour's data)
                "ring_barrier": sg.Barrier(len(ranks)) if len(ranks) > 1 else None,
                "mailbox": sg.Mailbox.by_name(f"leader{g}"),
                "outbox": sg.Mailbox.by_name(f"outbox{g}"),
                "bcast": False,
                "stop": False,
                "pending": False,
                "weights": 0,
                "computed_on": 0,
                "samples_of": [0] * len(ranks),
            }
            for g, ranks in enumerate(job.groups)
        ]
        for g, ranks in enumerate(job.groups):
            if job.hierarchical:
                self.groups_shared[g].update(
                    reduce_barrier=sg.Barrier(len(ranks)) if len(ranks) > 1 else None,
                    bcast_barrier=sg.Barrier(len(ranks)) if len(ranks) > 1 else None,
                    to_cross=sg.Semaphore(0),
                    to_bcast=sg.Semaphore(0),
                )
        self.cross_barrier = sg.Barrier(len(job.groups)) if job.hierarchical else None
        self.reduction = {}
        for g, ranks in enumerate(job.groups):
            if job.pipeline_of(g) is not None:
                continue  # (a pipeline's stages reduce nothing)
            if len(job.buckets) == 1 or (len(ranks) == 1 and not job.hierarchical):
                continue  # the worker reduces its one bucket itself
            for i, r in enumerate(ranks):
                self.reduction[r] = (sg.Semaphore(0), sg.Semaphore(0))
                host = self.worker_host[r]
                if not job.hierarchical:
                    sg.Actor.create(f"ring{r}", host, self.ring, g, i)
                    continue
                sg.Actor.create(f"reduce{r}", host, self.reduce_stage, g, i)
                sg.Actor.create(f"bcast{r}", host, self.bcast_stage, g, i)
                if i == 0:
                    sg.Actor.create(f"cross{r}", host, self.cross_stage, g)
        for s in range(len(self.server_host)):
            sg.Actor.create(f"server{s}", self.server_host[s], self.server, s)
        for g, ranks in enumerate(job.groups):
            if max(self.parts[g], default=1) > 1:
                sg.Actor.create(
                    f"pusher{g}", self.worker_host[ranks[0]], self.pusher, g
                )
        for g, ranks in enumerate(job.groups):
            if job.pipeline_of(g) is not None:
                sg.Actor.create(
                    f"leader{g}", self.worker_host[ranks[0]], self._start_stage, g
                )
                for i, r in enumerate(ranks[1:], start=1):
                    sg.Actor.create(f"stage{r}", self.worker_host[r], self.stage, g, i)
                continue
            sg.Actor.create(
                f"leader{g}", self.worker_host[ranks[0]], self._start_leader, g
            )
            for i, r in enumerate(ranks[1:], start=1):
                sg.Actor.create(f"worker{r}", self.worker_host[r], self.worker, g, i)
        start = time.perf_counter()
        self.engine.run()
        wall = time.perf_counter() - start
        st = self.state
        end = st.stop_time if st.stop_time is not None else self.engine.clock
        updates = st.stop_updates if st.stop_time is not None else st.version
        samples = st.stop_samples if st.stop_time is not None else st.samples
        per_group = []
        for g in range(len(job.groups)):
            times = [
                t for t in st.group_times.get(g, []) if t <= end
            ] or st.group_times.get(g, [])
            per_group.append(times[-1] / len(times) if times else None)
        whole = samples / end if end > 0 else 0.0
        steady = steady_rate(st.timeline, end)
        return {
            "time_s": end,
            "updates": updates,
            "samples": samples,
            "samples_per_sec": whole,
            "steady_samples_per_sec": whole if steady is None else steady,
            "ideal_samples_per_sec": job.ideal_samples_per_sec(end),
            "group_update_s": per_group,
            "mean_staleness": (sum(st.staleness) / len(st.staleness))
            if st.staleness
            else 0.0,
            "wall_s": wall,
            "server_actors": len(self.server_host),  # 1 for a bank
        }


def run(job: SimJob) -> dict[str, Any]:
    """Simulate ``job`` in this process (once per process: SimGrid's rule)."""
    return _Sim(job).run()


def main(argv: list[str] | None = None) -> int:
    """``python -m hybridagg.sim.engine JOB.json RESULT.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(
            "usage: python -m hybridagg.sim.engine JOB.json RESULT.json",
            file=sys.stderr,
        )
        return 2
    with open(args[0]) as f:
        job = SimJob.from_dict(json.load(f))
    result = run(job)
    with open(args[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
