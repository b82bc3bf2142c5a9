#!/usr/bin/env bash
# End-to-end test of `partrain launch slurm` against a real SLURM (issue 38 item 3). Not part of the
# pytest suite: it needs root, slurm-wlm and munge (`apt-get install -y slurm-wlm munge`).
#
# It brings up munged, slurmctld and two slurmd (fake nodes n1 and n2, both on this host) with every
# file in one temporary folder, in a private mount namespace whose /etc/hosts also names n1 and n2 (the
# host's file is not touched), submits the scripts `partrain launch slurm` writes, and checks:
#   1. a 1-node x 2-task job completes (summary written, checkpoint verifies);
#   2. a 2-node x 2-task job completes;
#   3. `scancel` saves a checkpoint and the job is not requeued;
#   4. the time-limit warning (USR1 to the batch shell, as `--signal=B:USR1@120` sends it) saves,
#      requeues, and the requeued job resumes and ends with the same losses as an uninterrupted run.
# It prints PASS/FAIL per check, exits 1 when any check fails, and stops only the daemons it started.
#
#   sudo tests/e2e/slurm.sh            # KEEP=1 keeps the temporary folder for a look afterwards
set -u

if [ -z "${PARTRAIN_E2E_IN_NAMESPACE:-}" ]; then  # re-run inside a private mount namespace (own /etc/hosts)
  [ "$(id -u)" -eq 0 ] || { echo "tests/e2e/slurm.sh: needs root (daemons, a mount namespace)"; exit 2; }
  for tool in slurmctld slurmd munged sbatch scontrol unshare; do
    command -v "$tool" >/dev/null || { echo "tests/e2e/slurm.sh: $tool not found: apt-get install -y slurm-wlm munge"; exit 2; }
  done
  exec env PARTRAIN_E2E_IN_NAMESPACE=1 unshare -m --propagation private bash "$0" "$@"
fi

REPO=$(cd "$(dirname "$0")/../.." && pwd)
if [ -x "$REPO/.venv/bin/partrain" ]; then export PATH="$REPO/.venv/bin:$PATH"; fi  # jobs inherit PATH
command -v partrain >/dev/null || { echo "partrain is not on PATH (activate its environment)"; exit 2; }

T=$(mktemp -d /tmp/partrain-slurm-e2e.XXXXXX)
chmod 755 "$T"
export SLURM_CONF="$T/slurm.conf"
FAILED=0
PIDS=()
started=$(date +%s)

say() { echo "[$(( $(date +%s) - started ))s] $*"; }
check() {  # check NAME CONDITION-EXIT-CODE DETAIL
  if [ "$2" -eq 0 ]; then echo "PASS $1${3:+: $3}"; else echo "FAIL $1${3:+: $3}"; FAILED=1; fi
}

cleanup() {
  scancel --quiet --full $(squeue -h -o %i 2>/dev/null) 2>/dev/null
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  done
  if [ -n "${KEEP:-}" ]; then echo "kept $T"; else rm -rf "$T"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- the fake cluster ------------------------------------------------------------------------------
cp /etc/hosts "$T/hosts" && echo "127.0.0.1 n1 n2" >>"$T/hosts"
mount --bind "$T/hosts" /etc/hosts || { echo "cannot bind-mount $T/hosts on /etc/hosts"; exit 2; }

mkdir -p "$T/munge" "$T/state" "$T/spool/n1" "$T/spool/n2" "$T/jobs" "$T/cache"
chmod 755 "$T/munge"
dd if=/dev/urandom of="$T/munge/munge.key" bs=1024 count=1 status=none && chmod 400 "$T/munge/munge.key"
SOCKET="$T/munge/munge.socket"
munged --force --socket="$SOCKET" --key-file="$T/munge/munge.key" --pid-file="$T/munge/munged.pid" \
  --log-file="$T/munge/munged.log" --seed-file="$T/munge/munged.seed" || { echo "munged did not start"; exit 2; }
PIDS+=("$(cat "$T/munge/munged.pid")")

PORT=$(( 17000 + RANDOM % 2000 ))
cat >"$SLURM_CONF" <<EOF
ClusterName=partrain-e2e
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$(( PORT + 1 ))
AuthType=auth/munge
AuthInfo=socket=$SOCKET
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool/%n
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd-%n.pid
SlurmctldLogFile=$T/slurmctld.log
SlurmdLogFile=$T/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=30
JobCompType=jobcomp/filetxt
JobCompLoc=$T/jobcomp.txt
NodeName=n1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$(( PORT + 2 )) CPUs=2 RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$(( PORT + 3 )) CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=e2e Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF

slurmctld -i || { echo "slurmctld did not start: $(tail -5 "$T/slurmctld.log")"; exit 2; }
sleep 1; PIDS+=("$(cat "$T/slurmctld.pid")")
for node in n1 n2; do
  slurmd -N "$node" || { echo "slurmd $node did not start: $(tail -5 "$T/slurmd-$node.log")"; exit 2; }
  sleep 1; PIDS+=("$(cat "$T/slurmd-$node.pid")")
done
for _ in $(seq 60); do
  [ "$(sinfo -h -o '%t' | sort -u | tr '\n' ' ')" = "idle " ] && break
  sleep 1
done
say "cluster up: $(sinfo -h -o '%P %D %t %c' | tr '\n' ' ')"

# ---- helpers ------------------------------------------------------------------------------------------
job_field() { scontrol show job "$1" -o 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p"; }

wait_state() {  # wait_state JOB SECONDS STATE...: until the job is in one of STATEs
  local job=$1 limit=$2; shift 2
  for _ in $(seq "$limit"); do
    local state; state=$(job_field "$job" JobState)
    for want in "$@"; do [ "$state" = "$want" ] && return 0; done
    sleep 1
  done
  say "job $job: $(job_field "$job" JobState) after ${limit}s, wanted $*"
  return 1
}

COMMON=(recipe=gpt-dp data.max_bytes=400000 "data.cache_dir=$T/cache" train.eval_every=0 train.log_every=1)

submit() {  # submit NAME OVERRIDES...: write the script with `partrain launch slurm`, sbatch it from $T/jobs/NAME
  local name=$1; shift
  mkdir -p "$T/jobs/$name"
  (cd "$T/jobs/$name" && partrain launch slurm "${COMMON[@]}" "$@" --out job.sbatch >launch.log 2>&1) || {
    echo "launch slurm failed:" >&2; cat "$T/jobs/$name/launch.log" >&2; return 1; }
  (cd "$T/jobs/$name" && sbatch --parsable job.sbatch)
}

run_dir_of() { dirname "$(find "$T/jobs/$1/runs" -name metrics.jsonl 2>/dev/null | head -1)"; }
steps_done() { local d; d=$(run_dir_of "$1"); [ -f "$d/metrics.jsonl" ] && wc -l <"$d/metrics.jsonl" || echo 0; }
wait_steps() {  # wait_steps NAME N SECONDS
  for _ in $(seq "$3"); do [ "$(steps_done "$1")" -ge "$2" ] && return 0; sleep 1; done; return 1
}
losses() {  # "step:loss ..." of a run folder's metrics.jsonl, the last record of each step
  python3 -c 'import json, sys
steps = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r and "step" in r}
print(" ".join("%d:%.6f" % (s, steps[s]) for s in sorted(steps)))' "$1/metrics.jsonl"
}
show_output() { say "output of $1:"; sed 's/^/    /' "$T/jobs/$1"/*.out 2>/dev/null | tail -25; }

# ---- 1. one node, two tasks ---------------------------------------------------------------------------
job=$(submit one train.steps=6 checkpoint.every_steps=3) || exit 1
say "1-node job $job submitted"
wait_state "$job" 300 COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL
state=$(job_field "$job" JobState); dir=$(run_dir_of one)
ok=1; [ "$state" = COMPLETED ] && [ -f "$dir/summary.json" ] && partrain checkpoint verify "$dir/checkpoints" >/dev/null && ok=0
check "1-node x 2-task job completes" $ok "state $state, exit $(job_field "$job" ExitCode), $(steps_done one) steps, checkpoints verify"
[ $ok -eq 0 ] || show_output one

# ---- 2. two nodes, two tasks each -----------------------------------------------------------------------
job=$(submit two cluster.nodes=2 parallel.dp=4 train.steps=6 checkpoint.every_steps=3 "checkpoint.dir=$T/jobs/two/ckpt") || exit 1
say "2-node job $job submitted"
wait_state "$job" 300 COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL
state=$(job_field "$job" JobState)
ok=1; [ "$state" = COMPLETED ] && partrain checkpoint verify "$T/jobs/two/ckpt" >/dev/null && ok=0
check "2-node x 2-task job completes" $ok "state $state on $(job_field "$job" NodeList), exit $(job_field "$job" ExitCode), checkpoints verify"
[ $ok -eq 0 ] || show_output two

# ---- 3. scancel: saves, not requeued --------------------------------------------------------------------
job=$(submit cancel train.steps=100000 checkpoint.every_steps=100000) || exit 1
say "job $job submitted, to be cancelled"
if wait_steps cancel 3 300; then
  scancel "$job"; say "scancel $job at step $(steps_done cancel)"
  wait_state "$job" 120 CANCELLED COMPLETED FAILED
  sleep 10  # a requeue would show here (the script requeues nothing on SIGTERM)
  state=$(job_field "$job" JobState); restarts=$(job_field "$job" Restarts)
  dir=$(run_dir_of cancel); saved=$(ls -d "$dir"/checkpoints/step-* 2>/dev/null | grep -v partial | tail -1)
  ok=1; [ "$state" = CANCELLED ] && [ "$restarts" = 0 ] && [ -n "$saved" ] && partrain checkpoint verify "$saved" >/dev/null && ok=0
  check "scancel saves and does not requeue" $ok "state $state, restarts $restarts, saved ${saved##*/}"
else
  check "scancel saves and does not requeue" 1 "the job never reached step 3"
fi
[ $ok -eq 0 ] || show_output cancel

# ---- 4. time-limit warning: save, requeue, resume to the same losses ----------------------------------------
STEPS=24
ref=$(submit reference train.steps=$STEPS checkpoint.every_steps=1000) || exit 1
job=$(submit warned train.steps=$STEPS checkpoint.every_steps=1000) || exit 1
say "reference job $ref and job $job (to be warned) submitted"
if wait_steps warned 8 300; then
  scancel --batch --signal=USR1 "$job"; say "USR1 to the batch shell of $job at step $(steps_done warned)"
  wait_state "$job" 120 PENDING REQUEUED
  sleep 1; scontrol update JobId="$job" StartTime=now  # a requeued job waits ~2 min for BeginTime otherwise
  wait_state "$job" 300 COMPLETED FAILED CANCELLED
else
  say "job $job never reached step 8"
fi
wait_state "$ref" 300 COMPLETED FAILED CANCELLED
state=$(job_field "$job" JobState); restarts=$(job_field "$job" Restarts)
a=$(losses "$(run_dir_of reference)"); b=$(losses "$(run_dir_of warned)")
resumed=$(grep -c "resumed from" "$T/jobs/warned"/*.out 2>/dev/null)
ok=1; [ "$state" = COMPLETED ] && [ "$restarts" = 1 ] && [ -n "$a" ] && [ "$a" = "$b" ] && ok=0
check "time-limit warning saves, requeues and resumes to the same losses" $ok \
  "state $state, restarts $restarts, $(echo "$b" | wc -w) loss records, 'resumed from' lines: $resumed"
if [ $ok -ne 0 ]; then
  echo "  reference: $a"; echo "  warned:    $b"; show_output warned
fi

say "done"
[ $FAILED -eq 0 ] && echo "ALL PASSED" || echo "SOME CHECKS FAILED"
exit $FAILED
