# dist_lib.sh - sourced by the data-parallel e2e scripts after lib.sh (T
# is the train tool): finding a launcher's ranks, timing how a job ends.

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
# within START LIMIT WHAT: prints the seconds since START; fails unless
# fewer than LIMIT
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

# launched SIGNAL LIMIT PATTERN TRAIN_ARGS... (with --out RUN last): a
# launcher runs TRAIN_ARGS; rank 1 gets SIGNAL after the first step; the
# launcher must exit non-zero within LIMIT seconds (--timeout, then its
# 3 s grace before SIGKILL) with PATTERN in its output, no rank left.
launched() {
  local sig=$1 limit=$2 pat=$3
  shift 3
  local run=${!#}
  "$T" "$@" > $run.out 2>&1 &
  local L=$! rc=0
  wait_for_step $run
  local r0 r1
  r0=$(rank_pid $L 0)
  r1=$(rank_pid $L 1)
  [ -n "$r0" ] && [ -n "$r1" ] || fail "ranks of launcher $L not found"
  local start
  start=$(now)
  kill -$sig "$r1"
  wait $L || rc=$?
  local took
  took=$(within "$start" $limit "launcher, SIG$sig to rank 1")
  [ "$rc" -ne 0 ] || { cat $run.out; fail "SIG$sig: the launcher exited 0"; }
  grep -Eq "$pat" $run.out || { cat $run.out; fail "SIG$sig: no /$pat/ in the launcher's output"; }
  gone "$r0" "$r1"
  ok "launcher, SIG$sig to rank 1: the job ended in $took s (exit $rc), naming it, no process left"
}
