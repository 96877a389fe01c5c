#!/usr/bin/env bash
# A real Slurm (Debian's slurm-wlm) as two nodes on this machine, 127.0.0.1 and 127.0.0.2: one slurmctld
# and two `slurmd -N NAME` on ports of their own, no munge (auth/none). Everything it writes lies under
# $SLURM_LOCAL_DIR (default .slurm-local/); clients find it with SLURM_CONF=$SLURM_LOCAL_DIR/slurm.conf.
# Stop it with scripts/slurm_local/down.sh. Each node claims 2 CPUs and 8 GPUs (regular files standing in
# for devices) so that a written job's `#SBATCH --gpus-per-node` is accepted unchanged.
set -euo pipefail
DIR="$(realpath -m "${SLURM_LOCAL_DIR:-.slurm-local}")"
PORT="${SLURM_LOCAL_PORT:-16817}"  # slurmctld; the two slurmd take the next two
GPUS="${SLURM_LOCAL_GPUS:-8}"
CPUS="${SLURM_LOCAL_CPUS:-2}"
NODES=(127.0.0.1 127.0.0.2)
for tool in slurmctld slurmd sbatch sinfo; do
    command -v "$tool" >/dev/null || { echo "slurm-local: $tool not found: apt-get install slurmctld slurmd slurm-client" >&2; exit 1; }
done
export SLURM_CONF="$DIR/slurm.conf"
if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
    echo "slurm-local: already running ($SLURM_CONF)"; exit 0
fi
mkdir -p "$DIR/state" "$DIR/log" "$DIR/dev"
for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done
for i in $(seq 0 $((GPUS - 1))); do : > "$DIR/dev/gpu$i"; done
{
    echo "ClusterName=rlrecipe-local"
    echo "SlurmctldHost=localhost(127.0.0.1)"
    echo "SlurmctldPort=$PORT"
    echo "SlurmUser=root"
    echo "AuthType=auth/none"
    echo "CredType=cred/none"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
    # linuxproc follows every descendant of a step, also those in sessions of their own (torchrun's ranks)
    echo "ProctrackType=proctrack/linuxproc"
    # affinity binds a step's tasks to the CPUs the step was given: a step held to one CPU shows it
    echo "TaskPlugin=task/affinity"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "GresTypes=gpu"
    echo "MpiDefault=none"
    echo "ReturnToService=2"
    echo "SlurmdParameters=config_overrides"  # two slurmd on one machine claim more than it has
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/none"
    echo "KillWait=5"
    echo "MinJobAge=300"
    echo "SchedulerParameters=defer_batch"
    for i in "${!NODES[@]}"; do
        n="${NODES[$i]}"
        echo "NodeName=$n NodeAddr=$n Port=$((PORT + 1 + i)) CPUs=$CPUS RealMemory=4000 Gres=gpu:$GPUS State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} > "$SLURM_CONF"
{
    for n in "${NODES[@]}"; do
        echo "NodeName=$n Name=gpu File=$DIR/dev/gpu[0-$((GPUS - 1))]"
    done
} > "$DIR/gres.conf"
slurmctld -c -f "$SLURM_CONF"  # -c: no state from an earlier start
for n in "${NODES[@]}"; do slurmd -N "$n" -f "$SLURM_CONF"; done
for _ in $(seq 1 60); do
    if [ "$(sinfo -h -o '%t' 2>/dev/null | grep -c -E '^idle')" -ge 1 ] && \
       [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c -E ' idle$')" -eq "${#NODES[@]}" ]; then
        echo "slurm-local: up, nodes ${NODES[*]} idle (SLURM_CONF=$SLURM_CONF)"; exit 0
    fi
    sleep 0.5
done
echo "slurm-local: nodes not idle after 30 s:" >&2
sinfo -N -l >&2 || true
tail -20 "$DIR/log/"*.log >&2 || true
exit 1
