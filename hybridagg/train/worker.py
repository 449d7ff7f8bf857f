"""The worker role of ``hybridagg train``: data, steps, validation, checkpoints, report."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..data import HDF5Loader
from ..data.loader import load_split_info
from ..optimizer import DistributedOptimizer, broadcast_parameters
from ..ps.compensation import Compensation
from .adaptive import AdaptiveBatches, server_batching
from .checkpoint import Checkpointer, load_part
from .common import make_optimizer, manifest, progress_bar, rng_state, set_rng_state
from .emulation import Pacer, ideal_samples_per_sec
from .evaluate import Evaluator, load_flat
from .metrics import MetricsWriter, format_table, merge_parts, summary_row
from .models import build_model

__all__ = ["WorkerRole"]


class WorkerRole:
    """A worker rank's part of a training run."""

    def __init__(self, cfg, topo, resume, manifest, stop) -> None:
        self.cfg, self.topo, self.resume, self.manifest = cfg, topo, resume, manifest
        self.stop = stop
        self.rank = topo.rank
        self.world = topo.comms.world

    # --- set-up ----------------------------------------------------------------
    def _setup_local(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        info = load_split_info([cfg.data], "train")[0]
        # windows (the shuffle buffer and the dynamic chunk) of up to 8 blocks,
        # but at least 8 windows per worker and epoch so shares can balance
        blocks = -(-info.length // info.block_samples)
        self.window_blocks = max(1, min(8, blocks // (8 * self.topo.num_workers)))
        self.sample_shape, self.num_classes = info.sample_shape, info.num_classes
        self.device = torch.device(cfg.device)
        model = build_model(cfg.model, info.sample_shape, info.num_classes)
        self.model = model.to(self.device)
        self.optimizer = make_optimizer(cfg, self.model)
        self.evaluator = (
            Evaluator(cfg, self.model, self.device) if self.rank == 0 else None
        )
        self.part, self.done_already = None, False
        if self.resume is None:
            return
        self.part = load_part(self.resume, self.rank)
        if self.part is None:
            done = self.manifest.get("done_groups", [])
            if cfg.mode == "sync" or self.topo.group not in done:
                raise ValueError(
                    f"checkpoint {self.resume} has no part for rank {self.rank}"
                )
            self.done_already = True
            return
        if cfg.mode == "sync":
            first = self.part if self.rank == 0 else load_part(self.resume, 0)
            try:
                self.model.load_state_dict(first["model"])
                self.optimizer.load_state_dict(first["optimizer"])
            except (RuntimeError, KeyError, ValueError) as exc:
                raise ValueError(
                    f"checkpoint {self.resume} does not fit model {cfg.model!r}: {exc}"
                ) from None
        set_rng_state(self.part["rng"])

    def _setup_data(self) -> None:
        cfg, topo = self.cfg, self.topo
        self.loader = HDF5Loader(
            cfg.data,
            batch_size=cfg.batch_size,
            comm=topo.comms.workers,
            shares="static" if cfg.mode == "sync" else "dynamic",
            seed=cfg.seed,
            window_blocks=self.window_blocks,
            normalize=True,
            device=self.device,
        )
        if self.part is not None:
            self.loader.load_state_dict(self.part["loader"])
        elif cfg.mode != "sync" and self.resume is not None:
            # a finished group still takes part in the collective resume
            self.loader.load_state_dict(
                {
                    "kind": "dynamic",
                    "epoch": 0,
                    "carry": [],
                    "taken": [],
                    "counter": None,
                    "n_windows": self.loader.windows_per_epoch,
                }
            )

    def _make_dopt(self) -> DistributedOptimizer:
        cfg, topo = self.cfg, self.topo
        return DistributedOptimizer(
            self.optimizer,
            self.model.named_parameters(),
            topo,
            mode=cfg.mode,
            model=self.model,
            allreduce_backend=cfg.allreduce_backend,
            compensation=Compensation(
                reference_batch=cfg.batch_size,
                warmup_updates=cfg.warmup_updates,
                staleness=cfg.damping,
                lookahead=cfg.lookahead,
                lookahead_horizon=cfg.lookahead_horizon,
            ),
            staleness_bound=cfg.staleness_bound,
            max_updates=cfg.steps if cfg.mode != "sync" else None,
            overlap=cfg.overlap,
            server_batching=server_batching(cfg, topo),
        )

    def run(self) -> dict | None:
        cfg, topo, world = self.cfg, self.topo, self.world
        err, self.evaluator = None, None
        try:
            self._setup_local()
        except (ValueError, TypeError, OSError) as exc:
            err = exc
        world.check(err, what="set-up")
        err = None
        try:
            self._setup_data()
        except (ValueError, TypeError, OSError) as exc:
            err = exc
        world.check(err, what="data")
        if self.part is None and not self.done_already:
            broadcast_parameters(self.model.state_dict(), 0, topo)
        self.metrics = MetricsWriter(cfg.metrics, self.rank)
        self.ck = Checkpointer(cfg.checkpoint, self.rank) if cfg.checkpoint else None
        self.opt = self._make_dopt()  # the servers receive their shards here
        world.barrier(what="start of training")
        self.start = time.perf_counter()
        self.adaptive = AdaptiveBatches(
            cfg, topo, self.opt, self.loader, self.metrics, self.start
        )
        self._restore_counters()
        if not self.done_already:
            self._loop()
        self._finish_training()
        if self.evaluator is not None:
            self.evaluator.close()
        return self._report()

    def _restore_counters(self) -> None:
        part = self.part or {}
        self.steps = int(part.get("step", 0))
        self.samples = 0
        self.offset = float(part.get("train_time_s", 0.0))
        self.ckpt_number = int(self.resume.name.split("-")[1]) if self.resume else 0
        self.eval_seconds = 0.0
        self.busy = 0.0
        self.wait_total = 0.0
        self.stale_sum, self.stale_n = 0, 0
        self.first_target = part.get("time_to_target_s")
        self.last_accuracy = None
        self.last_loss = None
        self.epochs_done = int(part.get("epochs_done", 0))
        if self.cfg.mode == "sync":
            self.opt.updates = int(part.get("updates", 0))
        elif self.resume is not None and not self.done_already:
            self.opt.refresh_from_servers()
        self.last_eval_bucket = self.opt.server_version // self.cfg.eval_every
        self.last_ckpt_update = self.opt.updates

    def _train_time(self) -> float:
        return self.offset + time.perf_counter() - self.start - self.eval_seconds

    def _loop(self) -> None:
        cfg, opt, loader = self.cfg, self.opt, self.loader
        pacer = Pacer(cfg.parsed_slowdown(), self.rank, cfg.sample_ms, self.start)
        bar = progress_bar(cfg, self.rank, self.opt.server_version)
        loss_fn = torch.nn.functional.cross_entropy
        if cfg.adaptive_batch and self.resume is None:
            self.adaptive.probe(self.model, loss_fn, pacer)
        batches, exhausted = iter(loader), False
        while True:
            if (
                cfg.steps is not None
                and cfg.mode == "sync"
                and opt.updates >= cfg.steps
            ):
                break
            if opt.should_stop:
                break
            x = y = None
            wait0 = loader.stats.wait_seconds
            if not exhausted:
                try:
                    x, y = next(batches)
                except StopIteration:
                    exhausted = True
            waited = loader.stats.wait_seconds - wait0
            n = 0 if y is None else len(y)
            opt.set_samples(n)
            opt.zero_grad()
            t0 = time.perf_counter()
            loss_value = None
            if n:
                loss = loss_fn(self.model(x), y)
                loss.backward()
                loss_value = float(loss.detach())
            compute = time.perf_counter() - t0
            slept = pacer.pace(n, compute)
            left = loader.batches_left  # None: unknown (dynamic shares)
            more = 0.0 if left == 0 else 1.0
            opt.share([float(self.stop.is_set()), compute + slept, float(n), more])
            t1 = time.perf_counter()
            opt.step()
            comm_s = time.perf_counter() - t1
            self.steps += 1
            self.samples += n
            self.busy += compute + slept + comm_s + waited
            self.wait_total += waited
            total = opt.last_total_samples
            staleness = opt.last_staleness
            if self.topo.is_leader and total > 0 and cfg.mode != "sync":
                self.stale_sum += staleness
                self.stale_n += 1
            self.metrics.write(
                "step",
                t=time.perf_counter() - self.start,
                group=self.topo.group,
                role=self.topo.role,
                step=self.steps,
                version=opt.server_version,
                epoch=self.epochs_done,
                batch=n,
                compute_s=compute,
                pace_s=slept,
                comm_s=comm_s,
                reduce_s=opt.reducer.last_comm_seconds,
                data_wait_s=waited,
                staleness=staleness,
                loss=loss_value,
            )
            signalled = bool(opt.shared[:, 0].max() > 0)
            if cfg.adaptive_batch:
                self.adaptive.after_step()
            if bar is not None:
                bar.update(opt.server_version - bar.n)
                if loss_value is not None:
                    self.last_loss = f"{loss_value:.3f}"
                bar.set_postfix(
                    batch=loader.batch_size,
                    loss=self.last_loss,
                    acc=self.last_accuracy,
                    refresh=False,
                )
            if self.rank == 0:
                self._maybe_evaluate()
            if total == 0:  # every worker in the reduction ran out: epoch over
                if self._end_epoch():
                    break
                batches, exhausted = iter(loader), False
                continue
            last = False
            if opt.shared[:, 3].max() == 0:
                # Static shares: every worker took its last batch of the epoch
                # in this update, so the epoch ends here, without a round of
                # an empty update to find out (a whole gradient all-reduce).
                # (before the checkpoint, which then holds the epoch counted
                # and the loader between epochs)
                if next(batches, None) is not None:
                    raise RuntimeError("the loader gave a batch after its last one")
                last = self._end_epoch()
                batches, exhausted = iter(loader), False
            self._maybe_checkpoint(signalled)
            if signalled:
                if cfg.mode == "sync":
                    break  # every worker saw it at this update (and checkpointed)
                if self.topo.is_leader:
                    opt.request_stop()  # the servers stop every group after a checkpoint
            if last:
                break
        if bar is not None:
            bar.close()
        batches = None

    def _end_epoch(self) -> bool:
        """Count an epoch that every worker finished; whether training ends with it."""
        self.epochs_done += 1
        cfg = self.cfg
        return cfg.max_epochs is not None and self.epochs_done >= cfg.max_epochs

    # --- validation --------------------------------------------------------------
    def _maybe_evaluate(self, final: bool = False) -> None:
        opt, cfg = self.opt, self.cfg
        bucket = opt.server_version // cfg.eval_every
        if not final and bucket <= self.last_eval_bucket:
            return
        self.last_eval_bucket = bucket
        t0 = time.perf_counter()
        if cfg.mode == "sync" or final:
            model = self.model
        else:
            weights, buffers = opt.pull_state()
            model = self.evaluator.scratch(self.model)
            load_flat(model, weights, buffers)
        accuracy, loss = self.evaluator.evaluate(model)
        seconds = time.perf_counter() - t0
        self.eval_seconds += seconds
        train_time = self._train_time()
        self.last_accuracy = f"{accuracy:.3f}"
        self.final_accuracy = accuracy
        target = cfg.target_accuracy
        if target is not None and accuracy >= target and self.first_target is None:
            self.first_target = train_time
        self.metrics.write(
            "eval",
            t=time.perf_counter() - self.start,
            version=opt.server_version,
            accuracy=accuracy,
            loss=loss,
            eval_s=seconds,
            train_time_s=train_time,
            final=final,
        )

    # --- checkpoints ----------------------------------------------------------------
    def _part_state(self) -> dict:
        return {
            "loader": self.loader.state_dict(),
            "rng": rng_state(),
            "step": self.steps,
            "epochs_done": self.epochs_done,
            "train_time_s": self._train_time(),
            "time_to_target_s": self.first_target,
        }

    def _maybe_checkpoint(self, signalled: bool) -> bool:
        cfg, opt = self.cfg, self.opt
        if self.ck is None:
            return False
        if cfg.mode != "sync":
            number = opt.checkpoint_due
            if not number:
                return False
            t0 = time.perf_counter()
            self.ck.write(number, self._part_state())
            self.topo.comms.group.barrier(what=f"group's parts of checkpoint {number}")
            opt.checkpointed(number)
            self._log_checkpoint(number, t0, opt.server_version)
            return True
        due = cfg.checkpoint_every and opt.updates % cfg.checkpoint_every == 0
        if not (due or signalled) or opt.updates == self.last_ckpt_update:
            return False
        self._sync_checkpoint()
        return True

    def _sync_checkpoint(self) -> None:
        opt = self.opt
        self.ckpt_number += 1
        number = self.ckpt_number
        t0 = time.perf_counter()
        state = self._part_state()
        state["updates"] = opt.updates
        if self.rank == 0:
            state["model"] = self.model.state_dict()
            state["optimizer"] = self.optimizer.state_dict()
        self.ck.write(number, state)
        self.topo.comms.workers.barrier(what=f"parts of checkpoint {number}")
        if self.rank == 0:
            self.ck.commit(number, manifest(self.cfg, self.topo, updates=opt.updates))
        self.last_ckpt_update = opt.updates
        self._log_checkpoint(number, t0, opt.updates)

    def _log_checkpoint(self, number: int, t0: float, version: int) -> None:
        self.metrics.write(
            "checkpoint",
            t=t0 - self.start,
            number=number,
            seconds=time.perf_counter() - t0,
            version=version,
        )

    # --- the end -------------------------------------------------------------------------
    def _finish_training(self) -> None:
        cfg = self.cfg
        if (
            cfg.mode == "sync"
            and self.ck is not None
            and self.opt.updates != self.last_ckpt_update
        ):
            self._sync_checkpoint()
        self.end = time.perf_counter()
        self.final_version = self.opt.finish()
        self.loader.close()
        self.final_accuracy = None
        if self.rank == 0:
            self._maybe_evaluate(final=True)

    def _report(self) -> dict | None:
        cfg, topo, world = self.cfg, self.topo, self.world
        mine = {
            "role": "worker",
            "samples": self.samples,
            "busy_s": self.busy,
            "wait_s": self.wait_total,
            "wall_s": self.end - self.start,
            "stale_sum": self.stale_sum,
            "stale_n": self.stale_n,
        }
        reports = world.allgather(mine, what="run report")
        self.metrics.close()
        world.barrier(what="metrics written")
        topo.comms.free()
        if self.rank != 0:
            return None
        if cfg.metrics:
            merge_parts(cfg.metrics, topo.world_size)
        workers = [r for r in reports if r["role"] == "worker"]
        wall = max(r["wall_s"] for r in workers)
        samples = sum(r["samples"] for r in workers)
        busy = sum(r["busy_s"] for r in workers)
        stale_n = sum(r["stale_n"] for r in workers)
        if cfg.sample_ms > 0:
            ideal = ideal_samples_per_sec(
                cfg.parsed_slowdown(), topo.num_workers, cfg.sample_ms, wall
            )
        else:
            ideal = None
        updates = self.opt.updates if cfg.mode == "sync" else (self.final_version or 0)
        summary = {
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
            "wall_s": wall,
            "time_to_target_s": self.first_target,
            "target_accuracy": cfg.target_accuracy,
            "final_accuracy": self.final_accuracy,
            "steps": updates,
            "epochs": self.epochs_done,
            "stall_fraction": sum(r["wait_s"] for r in workers) / busy if busy else 0.0,
            "mean_staleness": (sum(r["stale_sum"] for r in workers) / stale_n)
            if stale_n
            else 0.0,
            "slowdown": cfg.slowdown,
            "sample_ms": cfg.sample_ms,
            "damping": cfg.damping if cfg.mode != "sync" else None,
            "lookahead": cfg.lookahead and cfg.mode != "sync",
            "lookahead_horizon": cfg.lookahead_horizon,
            "seed": cfg.seed,
            "resumed_from": str(self.resume) if self.resume else None,
        }
        if cfg.summary:
            Path(cfg.summary).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.summary).write_text(json.dumps(summary, indent=1) + "\n")
        if cfg.progress:
            print(format_table([summary_row(summary)]), flush=True)
        return summary
