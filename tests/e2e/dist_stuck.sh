#!/usr/bin/env bash
# A rank that stops answering (SIGSTOP) or dies (SIGKILL) ends a CPU job
# (shared-memory collectives, --timeout 5) within seconds, with a message
# naming that rank: under the launcher, and with two ranks started by hand
# with srun's variables (no launcher to kill the peers). No process is left
# behind. And --gpus beyond the visible GPUs (none here) is refused at once.
source "$STK_SRC/tests/e2e/lib.sh"
T="$STK_BIN/train"
$PY "$STK_SRC/tests/e2e/fm_subset.py" "$FASHION" raw 2048 1000
"$STK_BIN/prep" --quiet raw db
common=(--db db --model mlp --workers 1 --seed 3 --batch 32 --epochs 200 --log-every 1
        --timeout 5)

source "$STK_SRC/tests/e2e/dist_lib.sh"

# ---- under the launcher (--timeout 5, then its 3 s grace) ------------------------
launched STOP 15 'rank 1 \(pid [0-9]+, stopped\) did not reach a collective within 5 s' \
  "${common[@]}" --nproc 2 --out stopped
launched KILL 15 'rank 1 was killed by signal 9' "${common[@]}" --nproc 2 --out killed

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

# ---- a rank that fails in evaluation, by hand: the other names it -----------------
# test key 999 (rank 1's share of the evaluation) gets a label beyond the
# classes; rank 1 refuses it, and still joins the evaluation's sum, so rank 0
# ends at once with a message about a peer instead of one about a lost rank
cp -r db badeval && $PY - <<'PY'
import lmdb, struct
env = lmdb.open("badeval", max_dbs=8)
with env.begin(write=True, db=env.open_db(b"test")) as txn:
    key = struct.pack(">Q", 999)
    v = bytearray(txn.get(key)); v[0:4] = struct.pack("<i", 99)
    txn.put(key, bytes(v))
PY
port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
eval_by_hand() { # RANK
  env -u RANK -u WORLD_SIZE SLURM_PROCID=$1 SLURM_NTASKS=2 SLURM_STEP_NUM_TASKS=2 \
    SLURM_STEP_NUM_NODES=1 SLURM_LOCALID=$1 SLURM_JOB_ID=8 SLURM_STEP_ID=$port \
    MASTER_PORT=$port "$T" --db badeval --model mlp --workers 1 --seed 3 --batch 32 \
    --epochs 1 --timeout 60 --quiet --out badrun > badrun.$1.out 2>&1
}
start=$(now)
eval_by_hand 0 & E0=$!
eval_by_hand 1 & E1=$!
rc0=0 rc1=0
wait $E0 || rc0=$?
wait $E1 || rc1=$?
within "$start" 30 "a failed evaluation by hand" > /dev/null
[ $rc0 -eq 1 ] && [ $rc1 -eq 1 ] || { cat badrun.*.out; fail "failed evaluation: exits $rc0, $rc1"; }
grep -q 'key 999: label 99 is not one of' badrun.1.out || { cat badrun.1.out; fail "rank 1 did not name key 999"; }
grep -q '1 other rank(s) failed in evaluation' badrun.0.out || { cat badrun.0.out; fail "rank 0 did not name a peer's failed evaluation"; }
ok "a rank failing in evaluation (key 999) ends both ranks at once, the other naming it"

# ---- --gpus beyond the visible GPUs, refused before any rank starts -------------
rc=0
smoke=$("$STK_BIN/test_cuda_smoke" 2>&1) || rc=$?
start=$(now)
if [ "$rc" -eq 77 ]; then
  expect_fail 2 "gpus 2: no GPU here" "$T" --db db --gpus 2 --out nogpu
  expect_fail 2 "gpus 0,1: no GPU here" "$T" --db db --gpus 0,1 --out nogpu
  # a CUDA rank started by srun stops before the rendezvous too
  expect_fail 2 "rank 1: (no CUDA device|this stoke was built without CUDA)" \
    env -u RANK -u WORLD_SIZE SLURM_PROCID=1 SLURM_STEP_NUM_TASKS=2 SLURM_LOCALID=1 \
    SLURM_STEP_NUM_NODES=1 "$T" --db db --device cuda --timeout 60 --out nogpu
else
  [ "$rc" -eq 0 ] || fail "CUDA smoke test: $smoke"
  n=$(grep -c '^ok: device' <<<"$smoke" || true)
  expect_fail 2 "gpus $((n + 1)): $((n + 1)) ranks, $n GPU\(s\) visible" \
    "$T" --db db --gpus $((n + 1)) --out nogpu
fi
within "$start" 10 "--gpus refusal" > /dev/null
[ ! -e nogpu ] || fail "a refused --gpus made a run directory"
ok "--gpus beyond the visible GPUs refused at once"
