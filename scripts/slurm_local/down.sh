#!/usr/bin/env bash
# Stops what scripts/slurm_local/up.sh started: every job first (their steps' processes with them),
# then the daemons; nothing of it is left running.
set -uo pipefail
DIR="$(realpath -m "${SLURM_LOCAL_DIR:-.slurm-local}")"
export SLURM_CONF="$DIR/slurm.conf"
[ -f "$SLURM_CONF" ] || exit 0
if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
    scancel --full --quiet -u "$(id -un)" 2>/dev/null
    for _ in $(seq 1 30); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
fi
pids=()
for f in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"; do
    [ -f "$f" ] && pids+=("$(cat "$f")")
done
[ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null
for _ in $(seq 1 40); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && break
    sleep 0.25
done
for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
# a step daemon whose slurmd is gone would outlive it
pkill -9 -f "slurmstepd.*" 2>/dev/null
rm -f "$DIR"/*.pid
echo "slurm-local: stopped"
