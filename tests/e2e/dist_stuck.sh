#!/usr/bin/env bash
# A rank that stops answering (SIGSTOP) or dies (SIGKILL) ends a CPU job
# (shared-memory collectives, --timeout 5) within seconds, with a message
# naming that rank: under the launcher, and with two ranks started by hand
# with srun's variables (no launcher to kill the peers). No process is left
# behind. And --gpus on a machine without a GPU is refused at once.
source "$STK_SRC/tests/e2e/lib.sh"
T="$STK_BIN/train"
$PY "$STK_SRC/tests/e2e/fm_subset.py" "$FASHION" raw 2048 1000
"$STK_BIN/prep" --quiet raw db
common=(--db db --model mlp --workers 1 --seed 3 --batch 32 --epochs 200 --log-every 1
        --timeout 5)

wait_for_step() { # RUN_DIR: until its first step line (or 60 s)
  for _ in $(seq 600); do
    grep -q '"type":"step"' "$1/metrics.jsonl" 2>/dev/null && return 0
    sleep 0.1
  done
  fail "no step line in $1"
}
# rank_pid LAUNCHER K: the pid of rank K among the launcher's children
rank_pid() {
  local p
  for p in $(pgrep -P "$1"); do
    tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "RANK=$2" && { echo "$p"; return; }
  done
}
now() { date +%s.%N; }
# within START LIMIT WHAT: fails unless less than LIMIT seconds passed
within() {
  local took
  took=$($PY -c "import time; print(round(time.time() - $1, 1))")
  $PY -c "import sys; sys.exit(0 if $took < $2 else 1)" || fail "$3 took $took s"
  echo "$took"
}
gone() { # PID...: every one has exited (within 5 s: a launcher's SIGKILL)
  local p
  for p in "$@"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || continue 2; sleep 0.1; done
    fail "process $p is still there"
  done
}

# ---- under the launcher --------------------------------------------------------
# launched SIGNAL RUN PATTERN: rank 1 gets SIGNAL after the first step; the
# launcher exits non-zero within 15 s (--timeout 5, the 3 s grace before
# its SIGKILL) with PATTERN in its output
launched() {
  "$T" "${common[@]}" --nproc 2 --out $2 > $2.out 2>&1 &
  local L=$! rc=0
  wait_for_step $2
  local r0 r1
  r0=$(rank_pid $L 0)
  r1=$(rank_pid $L 1)
  [ -n "$r0" ] && [ -n "$r1" ] || fail "ranks of launcher $L not found"
  local start
  start=$(now)
  kill -$1 "$r1"
  wait $L || rc=$?
  local took
  took=$(within "$start" 15 "launcher, SIG$1 to rank 1")
  [ "$rc" -ne 0 ] || { cat $2.out; fail "SIG$1: the launcher exited 0"; }
  grep -Eq "$3" $2.out || { cat $2.out; fail "SIG$1: no /$3/ in the launcher's output"; }
  gone "$r0" "$r1"
  ok "launcher, SIG$1 to rank 1: the job ended in $took s (exit $rc), naming it, no process left"
}
launched STOP stopped 'rank 1 \(pid [0-9]+, stopped\) did not reach a collective within 5 s'
launched KILL killed 'rank 1 was killed by signal 9'

# ---- two ranks started by hand (srun's variables, rank 0 serves the store) ------
port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
by_hand() { # RANK RUN: a task as srun starts it, output in RUN.RANK.out
  exec env -u RANK -u WORLD_SIZE SLURM_PROCID=$1 SLURM_NTASKS=2 SLURM_STEP_NUM_TASKS=2 \
    SLURM_STEP_NUM_NODES=1 SLURM_LOCALID=$1 SLURM_JOB_ID=7 SLURM_STEP_ID=$port \
    MASTER_PORT=$port "$T" "${common[@]}" --out $2 > $2.$1.out 2>&1
}
# hand SIGNAL VICTIM RUN PATTERN: the other rank exits 1 within 12 s of
# SIGNAL to rank VICTIM, with PATTERN in its output
hand() {
  local sig=$1 v=$2 run=$3 pat=$4
  local o=$((1 - v)) rc=0
  by_hand 0 $run & local P0=$!
  by_hand 1 $run & local P1=$!
  local pids=($P0 $P1)
  wait_for_step $run
  local start
  start=$(now)
  kill -$sig ${pids[$v]}
  wait ${pids[$o]} || rc=$?
  local took
  took=$(within "$start" 12 "by hand, SIG$sig to rank $v")
  [ "$rc" -eq 1 ] || { cat $run.$o.out; fail "by hand, SIG$sig to rank $v: rank $o exited $rc, not 1"; }
  grep -Eq "$pat" $run.$o.out || { cat $run.$o.out; fail "by hand, SIG$sig: no /$pat/"; }
  if [ $sig = STOP ]; then # resumed, the stopped rank finds the group gone and exits too
    kill -CONT ${pids[$v]}
    rc=0
    wait ${pids[$v]} || rc=$?
    [ "$rc" -eq 1 ] || { cat $run.$v.out; fail "rank $v, resumed: exit $rc, not 1"; }
  else
    wait ${pids[$v]} || true
  fi
  gone $P0 $P1
  ok "by hand, SIG$sig to rank $v: rank $o stopped in $took s naming it"
}
hand STOP 1 hs1 'rank 1 \(pid [0-9]+, stopped\) did not reach a collective within 5 s'
hand STOP 0 hs0 'rank 0 \(pid [0-9]+, stopped\) did not reach a collective within 5 s'
hand KILL 1 hk1 'rank 1 \(pid [0-9]+\) exited during a collective'
hand KILL 0 hk0 'rank 0 \(pid [0-9]+\) exited during a collective|rendezvous store'

# ---- --gpus where there is no GPU ------------------------------------------------
rc=0
smoke=$("$STK_BIN/test_cuda_smoke" 2>&1) || rc=$?
if [ "$rc" -eq 77 ]; then
  start=$(now)
  expect_fail 2 "gpus 2: no GPU here" "$T" --db db --gpus 2 --out nogpu
  expect_fail 2 "gpus 0,1: no GPU here" "$T" --db db --gpus 0,1 --out nogpu
  within "$start" 5 "--gpus refusal" > /dev/null
  [ ! -e nogpu ] || fail "--gpus without a GPU made a run directory"
  ok "--gpus refused at once without a GPU"
fi
