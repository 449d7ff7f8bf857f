"""The profile file: what a model needs on the machine that measured it (pure logic).

``hybridagg profile`` writes it (JSON); ``hybridagg simulate`` reads it.
Every figure is in seconds, bytes or bytes per second:

* ``buckets``: when backward has filled each of the reducer's gradient
  buckets, so the all-reduce can overlap backward as it does in a run;
* ``compute``: forward and backward seconds per sample on the profiled
  device, and each layer's share (its own floating-point operations, from
  :func:`hybridagg.train.pacing.module_costs`, and its measured seconds);
* ``memory``: parameter bytes and activation bytes per sample;
* ``units``: the model cut into pipeline units (a layer with parameters
  and the parameter-free layers after it, as a pipelined group of
  ``hybridagg train`` cuts it): each unit's cost (its floating-point
  operations on one sample; its parameters where none is counted, as the
  run's partition does), parameters and output bytes per sample (what
  crosses to the next stage); empty for a model that cannot be pipelined;
* ``allreduce``: latency and bandwidth of an all-reduce inside a group
  (``time = 2(n-1)(latency + bytes / (n x bandwidth))``, fitted on measured
  sizes), ``None`` when measured with one rank;
* ``server``: a server's seconds per update and per byte of its shard and
  of a reply's momentum lookahead (``lookahead_per_byte``), and
  (calibrated) a leader's transfer to it, latency and bandwidth, and its
  measured capacity;
* ``allreduce_by_ranks``: calibrated all-reduce fits per group size;
* ``networks``: per cluster (by its file's name), the links between its
  nodes as calibrated on the all-reduce across them: a message's latency
  and the core's bandwidth that all of them share;
* ``grad_s``, ``update_s``, ``copy_s``: a worker's own work per update
  besides compute and communication, on the profiled device: ``grad_s``,
  zeroing the gradient
  before a step and checking the reduced one (every worker, every step),
  ``update_s``, the run's optimizer step over the whole model (sync mode's,
  on every worker after the reduction), and ``copy_s``, one copy of the whole model
  between its tensors and a flat buffer (with servers: the leader flattens
  the gradient before a push and copies the reply's weights into the
  model; in a group of several ranks it flattens the weights for the
  group's broadcast and each member copies them in); 0: not measured;
* ``validation_s``: one validation as ``hybridagg train`` runs it on rank 0
  every ``--eval-every`` updates (the data file's validation split, on the
  profiled device), which a run's wall time includes; 0 when the profile
  had no data file;
* ``machine``: the profiled machine (cores, one core's memory-copy
  bandwidth, the device and ``--amp`` precision the compute was timed in),
  which is also the default cluster of ``hybridagg simulate``.

Calibrated parameters (fitted on microbenchmarks by
:func:`hybridagg.sim.calibrate.calibrate`) belong in the same file, so that
a prediction names every number it used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "AllreduceFit",
    "LayerCost",
    "MachineInfo",
    "NetworkFit",
    "Profile",
    "ServerFit",
    "UnitCost",
    "load_profile",
    "save_profile",
]

AMP_MODES = ("none", "bf16", "fp16")  # hybridagg train's --amp (a layer above)

FORMAT = "hybridagg-profile"
VERSION = 1


def _check(where: str, name: str, value: Any, *, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ValueError(
            f"{where}{name} must be {'>= 0' if zero else 'positive'}, got {value!r}"
        )
    return value


@dataclass(frozen=True)
class LayerCost:
    """One module's own work on one sample."""

    name: str
    flops: float
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class UnitCost:
    """One pipeline unit of the model (what a stage of a pipelined group holds
    a run of)."""

    cost: float
    """its floating-point operations on one sample (its parameters where no
    operation is counted): the unit's share of the model's time"""
    parameters: int
    """its parameters"""
    output_bytes: float
    """bytes per sample of its output (what crosses to the next unit)"""


@dataclass(frozen=True)
class AllreduceFit:
    """An all-reduce's cost inside a group: ``2(n-1)(latency + bytes/(n bandwidth))``."""

    latency_s: float
    bandwidth_Bps: float
    ranks: int
    points: tuple[tuple[float, float], ...] = ()
    """the measured (bytes, seconds) it was fitted on"""

    def seconds(self, nbytes: float, ranks: int) -> float:
        """The fitted time of one all-reduce of ``nbytes`` over ``ranks``."""
        if ranks <= 1:
            return 0.0
        return (
            2 * (ranks - 1) * (self.latency_s + nbytes / (ranks * self.bandwidth_Bps))
        )


@dataclass(frozen=True)
class NetworkFit:
    """A cluster's links between nodes as hybridagg's ring all-reduce found
    them (``bench/allreduce.py`` run across the cluster's nodes, fitted by
    :func:`hybridagg.sim.calibrate.fit_network`): they replace the cluster
    file's nominal figures when ``hybridagg simulate`` runs on that cluster.
    """

    cluster: str
    """the name of the cluster file it was measured on (it applies there only)"""
    latency_s: float
    """one message's latency between nodes, on top of the node's own links"""
    core_Bps: float
    """the core's bandwidth that every message between nodes shares (0: the
    node links delivered their nominal rate, nothing else limits)"""
    ranks: int
    """the ring's ranks, placed on the cluster's devices in order"""
    crossings: int
    """how many of the ring's links cross between nodes"""
    points: tuple[tuple[float, float], ...] = ()
    """the measured (bytes, seconds) it was fitted on"""
    kernel_Bps: float = 0.0
    """on a cluster of namespaces of one machine (the cluster file's
    ``machine``): the bytes per second one core moves at each end of a
    message between namespaces, in place of ``core_Bps`` (0: not fitted)"""


@dataclass(frozen=True)
class ServerFit:
    """A server's update cost: ``seconds_per_update + bytes x seconds_per_byte``,
    and (calibrated on ``bench/ps.py``) a leader's transfer to it."""

    seconds_per_update: float
    seconds_per_byte: float
    points: tuple[tuple[float, float], ...] = ()
    transfer_latency_s: float = 0.0
    """one way's latency of a leader-server message (0: not measured)"""
    transfer_Bps: float = 0.0
    """a leader-server transfer's bandwidth (0: not measured; the node's
    copies or links then carry it)"""
    capacity: tuple[tuple[float, float, float], ...] = ()
    """the measured capacity: (leaders, bytes of the model, updates per second)"""
    lookahead_per_byte: float = 0.0
    """seconds per byte of a shard to move a reply's weights along the
    momentum (``--lookahead``, on by default in hybrid and async; 0: not
    measured)"""

    def seconds(self, nbytes: float) -> float:
        """The time of one update of a shard of ``nbytes``."""
        return self.seconds_per_update + nbytes * self.seconds_per_byte


@dataclass(frozen=True)
class MachineInfo:
    """The profiled machine."""

    cores: int
    memcpy_Bps: float
    """one core's memory-copy bandwidth"""
    device: str = "cpu"
    """the device the compute was timed on (``cpu``, ``cuda:0``)"""
    amp: str = "none"
    """the autocast precision the forward was timed in (``--amp``)"""


@dataclass(frozen=True)
class Profile:
    """A validated profile (see the module)."""

    model: str
    parameters: int
    sample_shape: tuple[int, ...]
    forward_s_per_sample: float
    backward_s_per_sample: float
    parameter_bytes: float
    activation_bytes_per_sample: float
    server: ServerFit
    machine: MachineInfo
    allreduce: AllreduceFit | None = None
    layers: tuple[LayerCost, ...] = ()
    buckets: tuple[tuple[float, float], ...] = ()
    """the gradient's buckets in the order backward fills them: (the share of
    backward done when the bucket is full, its share of the gradient's
    bytes); empty: the whole gradient is ready when backward ends"""
    batch: int = 0
    """the batch the compute was measured at"""
    allreduce_by_ranks: tuple[AllreduceFit, ...] = ()
    """all-reduce fits per group size, calibrated on ``bench/allreduce.py``"""
    validation_s: float = 0.0
    """seconds of one validation of the data file's validation split on the
    profiled device (``hybridagg train`` runs one on rank 0 every
    ``--eval-every`` updates); 0: not measured"""
    validation_samples: int = 0
    """the samples that validation went over"""
    units: tuple[UnitCost, ...] = ()
    """the model's pipeline units in order (empty: it cannot be pipelined)"""
    grad_s: float = 0.0
    """seconds of a worker's gradient bookkeeping each step on the profiled
    device: zeroing the gradient before backward and checking that the
    reduced one is finite (every mode); 0: not measured"""
    update_s: float = 0.0
    """seconds of a worker's own update of the whole model on the profiled
    device: the run's optimizer step (every worker's after a sync
    reduction); 0: not measured"""
    copy_s: float = 0.0
    """seconds of one copy of the whole model between its tensors and a
    flat buffer on the profiled device (a push's flattened gradient, a
    reply's weights copied into the model); 0: not measured"""
    networks: tuple[NetworkFit, ...] = ()
    """clusters' links between nodes, calibrated on ``bench/allreduce.py``
    across them (one per cluster name)"""

    def network_for(self, cluster: str) -> NetworkFit | None:
        """The links calibrated on the cluster named ``cluster``, if any."""
        return next((n for n in self.networks if n.cluster == cluster), None)

    def allreduce_for(self, ranks: int) -> AllreduceFit | None:
        """The all-reduce fit measured at the group size nearest ``ranks``
        (the calibrated ones first, else the profile's own)."""
        fits = self.allreduce_by_ranks or ((self.allreduce,) if self.allreduce else ())
        if not fits:
            return None
        return min(fits, key=lambda f: (abs(f.ranks - ranks), -f.ranks))

    notes: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def sample_seconds(self) -> float:
        """Forward and backward seconds per sample on the profiled device."""
        return self.forward_s_per_sample + self.backward_s_per_sample

    @property
    def paced_tail_share(self) -> float:
        """The share of a step's compute that ``--sample-ms``'s pacer cannot
        hide under its sleeps: the first layer's backward. The pacer sleeps
        each layer's share of the step before that layer's backward runs, so
        the first layer's backward comes after the step's last sleep."""
        if not self.layers or self.sample_seconds <= 0:
            return 0.0
        return min(1.0, self.layers[0].backward_s / self.sample_seconds)

    def gradient_bytes(self, wire: str = "fp32") -> float:
        """Bytes of one gradient (or one copy of the weights) on ``wire``."""
        return self.parameters * (4 if wire == "fp32" else 2)

    def as_dict(self) -> dict[str, Any]:
        """Plain values (the file's content, ``format`` and ``version`` first)."""
        return {"format": FORMAT, "version": VERSION, **asdict(self)}


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as JSON (through a temporary file and a rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(profile.as_dict(), indent=2) + "\n")
    tmp.replace(path)
    return path


def _amp(value: Any, where: str) -> str:
    if value not in AMP_MODES:
        raise ValueError(
            f"{where}amp must be one of {', '.join(AMP_MODES)}, got {value!r}"
        )
    return value


def _points(where: str, data: Any) -> tuple[tuple[float, float], ...]:
    if not isinstance(data, list):
        raise ValueError(f"{where}points must be a list of [bytes, seconds]")
    out = []
    for i, p in enumerate(data):
        if not (isinstance(p, list) and len(p) == 2):
            raise ValueError(f"{where}points[{i}] must be [bytes, seconds], got {p!r}")
        out.append(
            (
                _check(where, f"points[{i}][0]", p[0], zero=True),
                _check(where, f"points[{i}][1]", p[1], zero=True),
            )
        )
    return tuple(out)


def _capacity(where: str, data: Any) -> tuple[tuple[float, float, float], ...]:
    if not isinstance(data, list):
        raise ValueError(
            f"{where}capacity must be a list of [leaders, bytes, updates/s]"
        )
    out = []
    for i, p in enumerate(data):
        if not (isinstance(p, list) and len(p) == 3):
            raise ValueError(
                f"{where}capacity[{i}] must be [leaders, bytes, updates/s], got {p!r}"
            )
        out.append(tuple(_check(where, f"capacity[{i}]", v) for v in p))
    return tuple(out)  # type: ignore[return-value]


def _allreduce(ar: dict, where: str) -> AllreduceFit:
    ranks = _need(ar, "ranks", where)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"{where}ranks must be an integer >= 2, got {ranks!r}")
    return AllreduceFit(
        latency_s=_check(where, "latency_s", _need(ar, "latency_s", where), zero=True),
        bandwidth_Bps=_check(where, "bandwidth_Bps", _need(ar, "bandwidth_Bps", where)),
        ranks=ranks,
        points=_points(where, ar.get("points", [])),
    )


def _entries(data: Any, name: str, where: str, what: str) -> Iterator[tuple[str, dict]]:
    """Each mapping of the list ``data`` (the file's ``name``), with where it is."""
    if not isinstance(data, list):
        raise ValueError(f"{where}{name} must be a list of {what}")
    for i, item in enumerate(data):
        at = f"{where}{name}[{i}]."
        if not isinstance(item, dict):
            raise ValueError(f"{at[:-1]} must be a mapping")
        yield at, item


def _networks(data: Any, where: str) -> tuple[NetworkFit, ...]:
    fits = []
    for fw, fit in _entries(data, "networks", where, "fits"):
        name = _need(fit, "cluster", fw)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{fw}cluster must be a cluster's name, got {name!r}")
        counts = {}
        for key, least in (("ranks", 2), ("crossings", 1)):
            value = _need(fit, key, fw)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"{fw}{key} must be an integer >= {least}, got {value!r}"
                )
            counts[key] = value
        fits.append(
            NetworkFit(
                cluster=name,
                latency_s=_check(
                    fw, "latency_s", _need(fit, "latency_s", fw), zero=True
                ),
                core_Bps=_check(fw, "core_Bps", _need(fit, "core_Bps", fw), zero=True),
                kernel_Bps=_check(
                    fw, "kernel_Bps", fit.get("kernel_Bps", 0.0), zero=True
                ),
                points=_points(fw, fit.get("points", [])),
                **counts,
            )
        )
    names = [f.cluster for f in fits]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where}networks: clusters {dup} are fitted twice")
    return tuple(fits)


def _section(
    data: dict, name: str, where: str, *, optional: bool = False
) -> dict | None:
    value = data.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{where}{name} is missing or not a mapping")
    return value


def _need(data: dict, key: str, where: str) -> Any:
    if key not in data:
        raise ValueError(f"{where}{key} is missing")
    return data[key]


def profile_from_dict(data: Any, source: str = "") -> Profile:
    """A :class:`Profile` from the file's content.

    Raises:
        ValueError: A missing, unknown or bad field, naming it and the file.
    """
    where = f"profile {source}: " if source else "profile: "
    if not isinstance(data, dict):
        raise ValueError(f"{where}must be a JSON object")
    if data.get("format") != FORMAT:
        raise ValueError(
            f"{where}format must be {FORMAT!r}, got {data.get('format')!r} (not a profile file?)"
        )
    if data.get("version") != VERSION:
        raise ValueError(
            f"{where}version {data.get('version')!r} is not supported (this hybridagg reads {VERSION})"
        )
    known = {f for f in Profile.__dataclass_fields__} | {"format", "version"}
    extra = sorted(set(data) - known)
    if extra:
        raise ValueError(f"{where}unknown field(s) {', '.join(extra)}")
    model = _need(data, "model", where)
    if not isinstance(model, str) or not model:
        raise ValueError(f"{where}model must be a non-empty string")
    params = _need(data, "parameters", where)
    if isinstance(params, bool) or not isinstance(params, int) or params < 1:
        raise ValueError(f"{where}parameters must be an integer >= 1, got {params!r}")
    shape = _need(data, "sample_shape", where)
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape
    ):
        raise ValueError(
            f"{where}sample_shape must be a list of positive integers, got {shape!r}"
        )
    srv = _section(data, "server", where)
    server = ServerFit(
        seconds_per_update=_check(
            f"{where}server.",
            "seconds_per_update",
            _need(srv, "seconds_per_update", f"{where}server."),
            zero=True,
        ),
        seconds_per_byte=_check(
            f"{where}server.",
            "seconds_per_byte",
            _need(srv, "seconds_per_byte", f"{where}server."),
            zero=True,
        ),
        points=_points(f"{where}server.", srv.get("points", [])),
        transfer_latency_s=_check(
            f"{where}server.",
            "transfer_latency_s",
            srv.get("transfer_latency_s", 0.0),
            zero=True,
        ),
        transfer_Bps=_check(
            f"{where}server.", "transfer_Bps", srv.get("transfer_Bps", 0.0), zero=True
        ),
        capacity=_capacity(f"{where}server.", srv.get("capacity", [])),
        lookahead_per_byte=_check(
            f"{where}server.",
            "lookahead_per_byte",
            srv.get("lookahead_per_byte", 0.0),
            zero=True,
        ),
    )
    mach = _section(data, "machine", where)
    cores = _need(mach, "cores", f"{where}machine.")
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"{where}machine.cores must be an integer >= 1, got {cores!r}")
    machine = MachineInfo(
        cores=cores,
        memcpy_Bps=_check(
            f"{where}machine.",
            "memcpy_Bps",
            _need(mach, "memcpy_Bps", f"{where}machine."),
        ),
        device=str(mach.get("device", "cpu")),
        amp=_amp(mach.get("amp", "none"), f"{where}machine."),
    )
    ar = _section(data, "allreduce", where, optional=True)
    allreduce = None if ar is None else _allreduce(ar, f"{where}allreduce.")
    by_ranks = data.get("allreduce_by_ranks", [])
    fits = [
        _allreduce(fit, fw)
        for fw, fit in _entries(by_ranks, "allreduce_by_ranks", where, "fits")
    ]
    layers = []
    for i, layer in enumerate(data.get("layers", [])):
        lw = f"{where}layers[{i}]."
        if not isinstance(layer, dict) or not isinstance(layer.get("name"), str):
            raise ValueError(f"{lw[:-1]} must be a mapping with a name")
        layers.append(
            LayerCost(
                name=layer["name"],
                flops=_check(lw, "flops", _need(layer, "flops", lw), zero=True),
                forward_s=_check(
                    lw, "forward_s", _need(layer, "forward_s", lw), zero=True
                ),
                backward_s=_check(
                    lw, "backward_s", _need(layer, "backward_s", lw), zero=True
                ),
            )
        )
    buckets = []
    for i, b in enumerate(data.get("buckets", [])):
        if not (isinstance(b, list) and len(b) == 2):
            raise ValueError(f"{where}buckets[{i}] must be [ready share, bytes share]")
        ready = _check(where, f"buckets[{i}][0]", b[0], zero=True)
        share = _check(where, f"buckets[{i}][1]", b[1])
        if ready > 1 or share > 1:
            raise ValueError(f"{where}buckets[{i}] shares must be at most 1, got {b}")
        buckets.append((ready, share))
    if buckets and abs(sum(b[1] for b in buckets) - 1) > 1e-6:
        raise ValueError(f"{where}buckets' byte shares must sum to 1")
    if [b[0] for b in buckets] != sorted(b[0] for b in buckets):
        raise ValueError(f"{where}buckets must be in the order backward fills them")
    batch = data.get("batch", 0)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"{where}batch must be an integer >= 0, got {batch!r}")
    vsamples = data.get("validation_samples", 0)
    if isinstance(vsamples, bool) or not isinstance(vsamples, int) or vsamples < 0:
        raise ValueError(
            f"{where}validation_samples must be an integer >= 0, got {vsamples!r}"
        )
    units = _units(data.get("units", []), where, params)
    notes = data.get("notes", {})
    if not isinstance(notes, dict):
        raise ValueError(f"{where}notes must be a mapping")
    return Profile(
        model=model,
        parameters=params,
        sample_shape=tuple(shape),
        forward_s_per_sample=_check(
            where, "forward_s_per_sample", _need(data, "forward_s_per_sample", where)
        ),
        backward_s_per_sample=_check(
            where,
            "backward_s_per_sample",
            _need(data, "backward_s_per_sample", where),
            zero=True,
        ),
        parameter_bytes=_check(
            where, "parameter_bytes", _need(data, "parameter_bytes", where)
        ),
        activation_bytes_per_sample=_check(
            where,
            "activation_bytes_per_sample",
            data.get("activation_bytes_per_sample", 0),
            zero=True,
        ),
        server=server,
        machine=machine,
        allreduce=allreduce,
        layers=tuple(layers),
        buckets=tuple(buckets),
        batch=batch,
        allreduce_by_ranks=tuple(fits),
        validation_s=_check(
            where, "validation_s", data.get("validation_s", 0.0), zero=True
        ),
        validation_samples=vsamples,
        units=units,
        grad_s=_check(where, "grad_s", data.get("grad_s", 0.0), zero=True),
        update_s=_check(where, "update_s", data.get("update_s", 0.0), zero=True),
        copy_s=_check(where, "copy_s", data.get("copy_s", 0.0), zero=True),
        networks=_networks(data.get("networks", []), where),
        notes=notes,
    )


def _units(data: Any, where: str, parameters: int) -> tuple[UnitCost, ...]:
    """The ``units`` list, checked (their parameters must add up to the model's)."""
    units = []
    for uw, unit in _entries(data, "units", where, "units"):
        count = _need(unit, "parameters", uw)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{uw}parameters must be an integer >= 0, got {count!r}")
        units.append(
            UnitCost(
                cost=_check(uw, "cost", _need(unit, "cost", uw), zero=True),
                parameters=count,
                output_bytes=_check(
                    uw, "output_bytes", _need(unit, "output_bytes", uw), zero=True
                ),
            )
        )
    if units and sum(u.parameters for u in units) != parameters:
        raise ValueError(
            f"{where}units hold {sum(u.parameters for u in units)} parameters, "
            f"the model {parameters}"
        )
    if units and not any(u.cost > 0 for u in units):
        raise ValueError(f"{where}units must have a cost above 0 somewhere")
    return tuple(units)


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file.

    Raises:
        ValueError: A missing file, bad JSON or a bad field, naming the file.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"profile {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"profile {path} is not valid JSON: {exc}") from None
    return profile_from_dict(data, str(path))
