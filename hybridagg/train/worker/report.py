"""The run's summary: rank 0 puts the workers' reports together."""

from __future__ import annotations

import json
from pathlib import Path

from ...topology import Topology
from ..chunks import job_counter_home
from ..config import TrainConfig
from ..emulation import ideal_samples_per_sec
from ..metrics import format_table, summary_row
from ..usage import cores_bound

__all__ = ["nonfinite_reason", "publish", "summarize"]


def summarize(
    cfg: TrainConfig,
    topo: Topology,
    reports: list[dict],
    *,
    updates: int,
    epochs: int,
    time_to_target_s: float | None,
    final_accuracy: float | None,
    resumed_from: Path | None,
    run_id: str,
    resharded: dict | None = None,
    accuracy_curve: list[tuple[float, float]] | None = None,
    accuracy_updates: list[int] | None = None,
    updates_to_target: int | None = None,
    final_loss: float | None = None,
) -> dict:
    """The summary of a run from every rank's report (``hybridagg train --summary``).

    Args:
        cfg: The run's options.
        topo: The topology.
        reports: Every rank's report (servers' included, left out here).
        updates: Model updates (all-reduce steps, or the final server version).
        epochs: Epochs finished.
        time_to_target_s: Training seconds to ``--target-accuracy``.
        final_accuracy: The accuracy at the end (``None`` with ``--loss mse``).
        resumed_from: The checkpoint this run resumed from.
        run_id: The run's id (its checkpoints' manifests carry it).
        resharded: ``{"from": sizes, "to": sizes}`` when it was written with
            other ranks, servers or groups (``None``: not resharded).
        accuracy_curve: ``(training seconds, accuracy)`` of each validation
            (compares modes at equal training time).
        accuracy_updates: The update (sync step or server version) of each
            point of ``accuracy_curve`` (what a table of updates to the
            target at another ``--eval-every`` is derived from).
        updates_to_target: The update at which the target was first reached.
        final_loss: The validation loss at the end (with ``--loss mse`` the
            mean squared error).

    ``efficiency`` (and ``ideal_samples_per_sec``) need an emulated speed:
    the ideal is the throughput the emulated per-sample time
    (``--sample-ms``) and ``--slowdown`` allow, so without ``--sample-ms``
    there is no ideal to compare with and both are ``None`` (``null`` in
    the JSON, ``-`` in the table); ``cores_bound_samples_per_sec`` is the
    bound a real run has.
    """
    workers = [r for r in reports if r["role"] == "worker"]
    wall = max(r["wall_s"] for r in workers)
    samples = sum(r["samples"] for r in workers)
    busy = sum(r["busy_s"] for r in workers)
    stale_n = sum(r["stale_n"] for r in workers)
    cpu_s, cores, bound = cores_bound(reports, samples)
    if cfg.sample_ms > 0:
        ideal = ideal_samples_per_sec(
            cfg.parsed_slowdown(), topo.num_workers, cfg.sample_ms, wall
        )
    else:
        ideal = None
    return {
        "mode": cfg.mode,
        "world_size": topo.world_size,
        "workers": topo.num_workers,
        "groups": [list(g) for g in topo.groups],
        "servers": len(topo.servers),
        "model": cfg.model,
        "batch_size": cfg.batch_size,
        "samples": samples,
        "samples_per_sec": samples / wall if wall > 0 else 0.0,
        "ideal_samples_per_sec": ideal,
        "efficiency": (samples / wall) / ideal if ideal else None,
        "cpu_s": cpu_s,
        "cores": cores,
        "cores_bound_samples_per_sec": bound,
        "wall_s": wall,
        "time_to_target_s": time_to_target_s,
        "updates_to_target": updates_to_target,
        "target_accuracy": cfg.target_accuracy,
        "final_accuracy": final_accuracy,
        "loss": cfg.loss,
        "final_loss": final_loss,
        "accuracy_curve": [[t, a] for t, a in (accuracy_curve or [])],
        "accuracy_updates": [int(v) for v in (accuracy_updates or [])],
        "steps": updates,
        "epochs": epochs,
        "stall_fraction": sum(r["wait_s"] for r in workers) / busy if busy else 0.0,
        "mean_staleness": (sum(r["stale_sum"] for r in workers) / stale_n)
        if stale_n
        else 0.0,
        "slowdown": cfg.slowdown,
        "sample_ms": cfg.sample_ms,
        "damping": cfg.damping if cfg.mode != "sync" else None,
        "lookahead": cfg.lookahead and cfg.mode != "sync",
        "lookahead_horizon": cfg.lookahead_horizon,
        "wire": cfg.wire,
        "chunk_counter": job_counter_home(cfg, topo),
        "amp": cfg.amp,
        "accumulate": cfg.accumulate,
        # --amp fp16: updates skipped because the gradient overflowed the loss
        # scale, summed over the reductions (sync: one; else one per group)
        "skipped_updates": sum(r.get("skipped_updates", 0) for r in workers),
        "seed": cfg.seed,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "run_id": run_id,
        "resharded": resharded,
        "saved_model": cfg.save_model,
    }


def publish(cfg: TrainConfig, summary: dict) -> None:
    """Write the summary to ``--summary`` and print its table on stdout.

    The table is printed with ``--no-progress`` too: that flag turns off the
    live bar (which a batch job's log file cannot show), not the result,
    and every Slurm template passes it.
    """
    if cfg.summary:
        Path(cfg.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.summary).write_text(json.dumps(summary, indent=1) + "\n")
    print(format_table([summary_row(summary)]), flush=True)


def nonfinite_reason(reports: list[dict]) -> str | None:
    """Why the run stopped on a NaN or an infinity, if any rank's report says so.

    A rank that found it itself is preferred over one that was told of it;
    among those, the lowest in ``reports``' order.
    """
    found = [r for r in reports if r.get("nonfinite")]
    if not found:
        return None
    own = [r for r in found if r.get("nonfinite_own")]
    return (own or found)[0]["nonfinite"]
