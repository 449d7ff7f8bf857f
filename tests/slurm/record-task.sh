#!/usr/bin/env bash
# record-task.sh DIR CMD [ARGS...] - test helper for the Slurm templates (their
# TASK_WRAPPER knob): write where Slurm put this task (its SLURM_*, SLURMD_*
# and HYBRIDAGG_* variables) to DIR/task-<SLURM_PROCID>.env, then exec CMD.
set -euo pipefail
dir="$1"
shift
mkdir -p "$dir"
env | grep -E '^(SLURM_|SLURMD_|HYBRIDAGG_)' | sort >"$dir/task-${SLURM_PROCID:?not an srun task}.env"
exec "$@"
