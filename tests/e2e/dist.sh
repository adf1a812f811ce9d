#!/usr/bin/env bash
# data-parallel training on the CPU backend (shared-memory collectives):
# ranks hold bitwise identical weights after every epoch (2 and 3 ranks),
# 2 ranks x batch 64 follow 1 rank x batch 128 and --accum 2 follows batch
# 128 (dropout off, 100 steps), evaluation counts the 10000 test samples
# once at every world size, a killed rank ends the job quickly with no
# process left, Ctrl-C leaves a checkpoint that resumes to the same weights,
# two launchers (--nnodes 2) train together, a hostile client of the
# rendezvous store is disconnected while the job goes on (and the
# launcher's memory stays bounded), and a taken port or an unreachable
# master are clear errors.
source "$STK_SRC/tests/e2e/lib.sh"
source "$STK_SRC/tests/e2e/dist_lib.sh"
T="$STK_BIN/train"
$PY "$STK_SRC/tests/e2e/fm_subset.py" "$FASHION" raw 6144
"$STK_BIN/prep" --quiet raw db
# the model of the runs below: the cnn, or the much lighter mlp where time
# is short (scripts/sanitize.sh sets STK_DIST_MODEL=mlp)
M=${STK_DIST_MODEL:-cnn}
common=(--db db --model $M --workers 1 --quiet --seed 3)

# epoch lines of a run: world, test samples, parameters differing
epochs() {
  $PY - "$1" <<'PY'
import json, sys
for l in open(sys.argv[1] + "/metrics.jsonl"):
    d = json.loads(l)
    if d["type"] == "epoch":
        print(d["world"], d["test_samples"], d.get("params_differing_across_ranks", 0))
PY
}

# ---- identical weights, evaluation counts --------------------------------
"$T" "${common[@]}" --batch 64 --epochs 2 --out w1 --log-every 10
[ "$(epochs w1)" = $'1 10000 0\n1 10000 0' ] || fail "world 1: $(epochs w1)"
for n in 2 3; do
  "$T" "${common[@]}" --nproc $n --batch 64 --epochs 2 --out w$n --log-every 10 \
    > w$n.out 2>&1 || { cat w$n.out; fail "--nproc $n"; }
  [ "$(epochs w$n)" = "$n 10000 0"$'\n'"$n 10000 0" ] || fail "world $n: $(epochs w$n)"
  ok "world $n: 2 epochs, weights identical on every rank after each, 10000 test samples each"
done
ok "world 1: 10000 test samples per evaluation"
# ranks started by the stoke launcher say so (they said "torchrun variables")
"$T" --db db --model $M --workers 1 --nproc 2 --batch 64 --epochs 1 --max-steps 1 --out src > src.out 2>&1 ||
  { cat src.out; fail "--nproc 2, one step"; }
grep -q "rank 0 of 2 on cpu, [0-9]* thread(s) (stoke launcher)" src.out || fail "the ranks' source: $(cat src.out)"

# ---- 2 x 64 and --accum 2 x 64 follow 1 x 128 ------------------------------
# The same 128 samples make each step's gradient in all three; only the
# order of the sums differs. SGD: AdamW's division by sqrt(v) amplifies
# last-bit differences (with the small-GEMM path's rounding, --accum 2 parted
# from batch 128 by 1e-2 after 65 AdamW steps; with SGD both stay within
# 1.6e-6 over 100). The mlp follows for 100 steps. The cnn's loss is chaotic
# under such differences (max-pool winners flip): batch 128 and --accum 2,
# in one process, part by 1e-3 after about 50 steps just as 2 ranks do, so
# for the cnn the first 30 steps are compared.
follow() { # MODEL STEPS
  local same=(--db db --model $1 --workers 1 --quiet --seed 3 --no-dropout --epochs 3
              --max-steps $2 --log-every 1 --optim sgd)
  "$T" "${same[@]}" --batch 128 --out $1-128
  "$T" "${same[@]}" --batch 64 --nproc 2 --out $1-2x64 > $1-2x64.out 2>&1 ||
    { cat $1-2x64.out; fail "$1: 2 x 64"; }
  "$T" "${same[@]}" --batch 64 --accum 2 --out $1-acc2
  $PY - $1 $2 <<'PY' || fail "$1: losses differ"
import json, sys
model, steps = sys.argv[1], int(sys.argv[2])
def losses(run):
    return [d["loss"] for d in map(json.loads, open(run + "/metrics.jsonl")) if d["type"] == "step"]
ref = losses(model + "-128")
assert len(ref) == steps, len(ref)
for run in ("2x64", "acc2"):
    got = losses(model + "-" + run)
    assert len(got) == steps, (run, len(got))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst < 1e-4, (run, worst)
    print(f"ok: {model} {run} follows batch 128 over {steps} steps (largest relative loss difference {worst:.2e})")
PY
}
follow mlp 100
[ "$M" != cnn ] || follow cnn 30

# ---- the GPUs' cadence: ranks read and agree every 16 steps ------------------
# On a GPU the ranks sum their metrics only every 16 steps and at logged
# steps (a read waits for the GPU); STK_AGREE_STEPS runs that cadence here.
# The logged losses and accuracies are the same sums, the weights the same
# bytes; a stop asked of one rank alone ends both at the same step.
cad=(--db db --model mlp --workers 1 --quiet --seed 3 --no-dropout --optim sgd --nproc 2
     --batch 64 --epochs 1 --log-every 5)
"$T" "${cad[@]}" --out agree1 > agree1.out 2>&1 || { cat agree1.out; fail "agree every step"; }
STK_AGREE_STEPS=16 "$T" "${cad[@]}" --out agree16 > agree16.out 2>&1 ||
  { cat agree16.out; fail "agree every 16 steps"; }
$PY - <<'PY' || fail "the 16-step cadence changed the logged metrics"
import json
def lines(run):
    return [d for d in map(json.loads, open(run + "/metrics.jsonl")) if d["type"] in ("step", "epoch")]
a, b = lines("agree1"), lines("agree16")
assert [d["type"] for d in a] == [d["type"] for d in b] and len(a) == 10, (len(a), len(b))
worst = 0.0
for x, y in zip(a, b):
    for k in ("loss", "acc", "train_loss", "train_acc", "test_loss", "test_acc"):
        if k in x:
            worst = max(worst, abs(x[k] - y[k]) / max(abs(x[k]), 1e-12))
assert worst < 1e-5, worst
print(f"ok: 9 step lines and the epoch line alike at both cadences (largest relative difference {worst:.1e})")
PY
last=$(ls agree1/checkpoints | grep step- | tail -1)
cmp agree1/checkpoints/$last/model.safetensors agree16/checkpoints/$last/model.safetensors ||
  fail "the cadence changed the weights"
# SIGINT to rank 1 alone (not the launcher): rank 0 learns of it at a read
STK_AGREE_STEPS=16 "$T" "${cad[@]}" --epochs 50 --log-every 1000 --out onestop \
  > onestop.out 2>&1 &
L=$!
for _ in $(seq 300); do [ -n "$(rank_pid $L 1)" ] && break; sleep 0.1; done
sleep 2
kill -INT "$(rank_pid $L 1)"
rc=0
wait $L || rc=$?
[ "$rc" -eq 130 ] || { cat onestop.out; fail "a stop asked of rank 1: exit $rc, not 130"; }
at=$(ls onestop/checkpoints | grep step- | tail -1)
[ $(( 10#${at#step-} % 16 )) -eq 0 ] || fail "stopped at $at, not at a 16-step read"
ok "every 16 steps: the same logged metrics and weights; rank 1's SIGINT stopped both ranks at $at"

# ---- a rank that dies ---------------------------------------------------------
"$T" "${common[@]}" --nproc 2 --batch 64 --epochs 20 --log-every 2 --out killed \
  > killed.out 2>&1 &
L=$!
wait_for_step killed
R1=$(rank_pid $L 1)
R0=$(rank_pid $L 0)
[ -n "$R1" ] && [ -n "$R0" ] || fail "ranks of launcher $L not found"
# ranks on their own CPUs (--bind cpus, the default): disjoint halves of
# this shell's CPUs where there are at least 2 (CPUS_OF: a pid's CPUs)
cpus_of() { $PY -c "import os, sys; print(*sorted(os.sched_getaffinity(int(sys.argv[1]))))" "$1"; }
$PY - "$(cpus_of $$)" "$(cpus_of "$R0")" "$(cpus_of "$R1")" <<'PY' || fail "--bind cpus"
import sys
usable, r0, r1 = (set(s.split()) for s in sys.argv[1:])
if len(usable) >= 2:
    assert not r0 & r1 and r0 | r1 <= usable and len(r0) == len(r1) == len(usable) // 2, sys.argv
else:
    assert r0 == r1 == usable, sys.argv
PY
ok "ranks bound to disjoint CPUs: rank 0 on $(cpus_of "$R0"), rank 1 on $(cpus_of "$R1")"
start=$(date +%s.%N)
kill -9 "$R1"
rc=0
wait $L || rc=$?
took=$($PY -c "import time; print(round(time.time() - $start, 2))")
# the launcher exits with the killed rank's status, 128 + 9 (docs/cli.md)
[ "$rc" -eq 137 ] || { cat killed.out; fail "the launcher exited $rc after rank 1 was killed, not 137"; }
grep -q "rank 1 was killed by signal 9" killed.out || { cat killed.out; fail "no message naming rank 1"; }
$PY -c "import sys; sys.exit(0 if $took < 10 else 1)" || fail "took $took s"
for p in $R0 $R1; do
  ! kill -0 "$p" 2>/dev/null || fail "process $p is still there"
done
ok "killed rank 1: the job ended in $took s (exit $rc), naming it, no process left"
"$T" "${common[@]}" --nproc 2 --batch 64 --epochs 20 --log-every 2 --out unbound \
  --bind none > unbound.out 2>&1 &
L=$!
wait_for_step unbound
for k in 0 1; do
  [ "$(cpus_of "$(rank_pid $L $k)")" = "$(cpus_of $$)" ] || fail "--bind none: rank $k"
done
kill -TERM $L
rc=0
wait $L || rc=$?
[ "$rc" -eq 130 ] || { cat unbound.out; fail "--bind none: SIGTERM gave exit $rc, not 130"; }
ok "--bind none: both ranks on all of this shell's CPUs"

# ---- Ctrl-C, then --resume auto: the same weights as without a stop -----------
run=(--nproc 2 --batch 64 --epochs 2 --log-every 1)
"$T" "${common[@]}" "${run[@]}" --out whole > whole.out 2>&1 || { cat whole.out; fail "whole"; }
# stop_by SIGNAL RUN_DIR: a run signalled after its first step exits 130
# with a checkpoint
stop_by() {
  "$T" "${common[@]}" "${run[@]}" --out $2 > $2.out 2>&1 &
  local L=$! rc=0
  wait_for_step $2
  kill -$1 $L
  wait $L || rc=$?
  [ "$rc" -eq 130 ] || { cat $2.out; fail "SIG$1: exit $rc, not 130"; }
  ls $2/checkpoints | grep -q step- || fail "no checkpoint after SIG$1"
}
stop_by INT stopped
stopped_at=$(ls stopped/checkpoints | grep step- | tail -1)
"$T" "${common[@]}" "${run[@]}" --out stopped --resume auto > resumed.out 2>&1 ||
  { cat resumed.out; fail "resume"; }
last=$(ls whole/checkpoints | grep step- | tail -1)
cmp whole/checkpoints/$last/model.safetensors stopped/checkpoints/$last/model.safetensors ||
  fail "resumed weights differ from the uninterrupted run's"
ok "Ctrl-C at $stopped_at (exit 130), --resume auto ends at $last with identical weights"
# SIGTERM (a batch system's stop) is passed on the same way
stop_by TERM termed
ok "SIGTERM: the ranks stopped at a step boundary, rank 0 checkpointed (exit 130)"

# ---- two launchers, one per node ------------------------------------------------
port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
nodes=(--nnodes 2 --nproc 1 --master-addr 127.0.0.1 --master-port $port --timeout 60)
"$T" "${common[@]}" "${nodes[@]}" --node-rank 1 --batch 64 --epochs 1 --out n1 > n1.out 2>&1 &
N1=$!
"$T" "${common[@]}" "${nodes[@]}" --node-rank 0 --batch 64 --epochs 1 --out n0 > n0.out 2>&1 ||
  { cat n0.out n1.out; fail "node 0"; }
wait $N1 || { cat n1.out; fail "node 1"; }
[ "$(epochs n0)" = "2 10000 0" ] || fail "two nodes: $(epochs n0)"
[ ! -e n1 ] || fail "node 1 (rank 1) wrote a run directory"
ok "two launchers (--nnodes 2) trained one model as world 2"
# nodes started with other flags or another model: refused before the first
# collective, node 0 naming the field whichever rank differs (another
# model's larger buffer had killed a rank with SIGBUS; another --batch
# misaligned the collectives); node 1's launcher may stop its rank first
differ() { # what node 1 adds, the message
  port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  nodes=(--nnodes 2 --nproc 1 --master-addr 127.0.0.1 --master-port $port --timeout 60)
  "$T" "${common[@]}" "${nodes[@]}" --node-rank 1 --epochs 1 $1 --out d1 > d1.out 2>&1 &
  local n1=$! rc0=0 rc1=0
  "$T" "${common[@]}" "${nodes[@]}" --node-rank 0 --epochs 1 --out d0 > d0.out 2>&1 || rc0=$?
  wait $n1 || rc1=$?
  [ $rc0 -eq 1 ] && [ $rc1 -eq 1 ] || { cat d0.out d1.out; fail "$1 on node 1: exits $rc0, $rc1"; }
  grep -q "$2" d0.out || { cat d0.out d1.out; fail "$1 on node 1: node 0's message"; }
  [ ! -e d0/checkpoints/BEST ] || fail "$1 on node 1: node 0 trained"
  rm -rf d0 d1
}
differ "--batch 32" "rank 1's --batch is 32, rank 0's 64: the ranks of one run need the same flags"
other=cnn; [ "$M" = cnn ] && other=mlp
differ "--model $other" "rank 1's model is [0-9]* parameters in [0-9]* tensors (layout [0-9a-f]*), rank 0's"
differ "--evaluate --init-from none.safetensors" "rank 1's --evaluate is 1, rank 0's 0"
ok "nodes with another --batch, model or --evaluate refused at the start, node 0 naming what differs"

# ---- resume with another number of ranks -------------------------------------
"$T" "${common[@]}" --nproc 2 --batch 64 --epochs 1 --out regrow --log-every 10
"$T" "${common[@]}" --nproc 3 --batch 64 --epochs 2 --out regrow --log-every 10 --resume auto \
  > regrow.out 2>&1 || { cat regrow.out; fail "resume with 3 ranks"; }
[ "$(epochs regrow)" = $'2 10000 0\n3 10000 0' ] || fail "regrow: $(epochs regrow)"
# mid-epoch, from 3 ranks to 1: the epoch goes on where as many samples were trained
"$T" "${common[@]}" --nproc 3 --batch 64 --epochs 1 --max-steps 12 --out shrink --log-every 4
"$T" --db db --model $M --workers 1 --seed 3 --batch 64 --epochs 1 --out shrink --log-every 4 \
  --resume auto > shrink.out 2>&1 ||
  { cat shrink.out; fail "resume with 1 rank"; }
grep -q "written by 3 rank(s), this run has 1: resuming the epoch at batch 36" shrink.out ||
  { cat shrink.out; fail "no note of the new position"; }
[ "$(epochs shrink)" = "1 10000 0" ] || fail "shrink: $(epochs shrink)"
ok "resumed a 2-rank run with 3 ranks, and a 3-rank run mid-epoch with 1"

# ---- SLURM: srun starts the ranks, rank 0 serves the store ---------------------
# a job id whose default port (15000 + (31 job + step) mod 10000) is free:
# 3871 is 31's inverse mod 10000
job=$($PY -c '
import socket
for p in range(15000 + __import__("os").getpid() % 9000, 25000):
    try:
        s = socket.socket(); s.bind(("127.0.0.1", p)); s.close()
        print((p - 15000) * 3871 % 10000 + 10000); break
    except OSError: pass')
slurm_rank() { # rank job timeout [env...]: a task as srun starts it, output in slurmRANK.out
  local r=$1 j=$2 t=$3
  shift 3
  env -u RANK -u WORLD_SIZE -u MASTER_PORT SLURM_PROCID=$r SLURM_NTASKS=2 SLURM_STEP_NUM_TASKS=2 \
    SLURM_STEP_NUM_NODES=1 SLURM_LOCALID=$r SLURM_JOB_ID=$j SLURM_STEP_ID=0 "$@" \
    "$T" --db db --model $M --workers 1 --seed 3 --batch 64 --epochs 1 --max-steps 8 \
    --log-every 4 --timeout "$t" --out slurm$j > slurm$r.out 2>&1
}
slurm_rank 1 "$job" 60 SLURM_CPUS_PER_TASK=5 & S1=$!
slurm_rank 0 "$job" 60 SLURM_CPUS_PER_TASK=5 & S0=$!
wait $S0 || { cat slurm0.out slurm1.out; fail "SLURM rank 0"; }
wait $S1 || { cat slurm1.out; fail "SLURM rank 1"; }
grep -q '"world":2' slurm$job/metrics.jsonl || fail "SLURM: not a world of 2"
cpus=$(nproc)
want=$((cpus < 5 ? cpus : 5))
grep -q "rank 1 of 2 on cpu, $want thread(s) (SLURM)" slurm1.out ||
  { cat slurm1.out; fail "SLURM: srun -c 5 should give $want threads"; }
ok "SLURM variables: two ranks without a launcher trained as world 2 on the job's port, $want threads each (-c 5)"

# a rank of another job that reaches this job's store stops at once
port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
slurm_rank 0 4242 5 MASTER_PORT=$port & S0=$!
slurm_rank 1 4243 60 MASTER_PORT=$port & S1=$!
rc=0
wait $S1 || rc=$?
[ "$rc" -eq 1 ] || { cat slurm1.out; fail "a rank of job 4243 at job 4242's store: exit $rc, not 1"; }
grep -q "belongs to SLURM job 4242 step 0, not to this rank's SLURM job 4243 step 0" slurm1.out ||
  { cat slurm1.out; fail "no message naming both jobs"; }
rc=0
wait $S0 || rc=$?
[ "$rc" -eq 1 ] || { cat slurm0.out; fail "job 4242's rank 0 without its peer: exit $rc, not 1"; }
grep -q "timed out after 5 s at 'train/joined': 1 of 2 ranks arrived" slurm0.out ||
  { cat slurm0.out; fail "job 4242's rank 0 does not say it waited for its peer"; }
! grep -qs '"type":"step"' slurm4242/metrics.jsonl || fail "job 4242's rank 0 trained alone"
ok "a rank of another SLURM job is refused, naming both jobs"

# ---- a hostile client of the rendezvous store ------------------------------------
# While a job is up, a local process connects to its launcher's store: a
# key over 4096 bytes, a value over 8 MiB (only its length sent), and an
# 8 MiB value asked for 256 times (2 GiB of replies) without reading. Each
# is disconnected with one line naming it and the limit; the launcher's
# peak memory grows by far less than what was asked; the job trains on.
# The job is two nodes: node 0's launcher holds the store and its rank
# waits there for node 1, started once the clients are done, so that they
# meet a live job however fast it would have trained.
port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
nodes=(--nnodes 2 --nproc 1 --master-addr 127.0.0.1 --master-port "$port"
       --batch 64 --epochs 2 --log-every 10)
"$T" "${common[@]}" "${nodes[@]}" --node-rank 0 --out hostile > hostile.out 2>&1 &
L=$!
$PY - "$port" "$L" <<'PY' || { kill $L; wait $L || true; cat hostile.out; fail "hostile store client"; }
import socket, struct, sys, time
port, pid = int(sys.argv[1]), int(sys.argv[2])
def connect(rcvbuf=0):
    end = time.time() + 60
    while True:
        s = socket.socket()
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        try:
            s.connect(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
            assert time.time() < end, "the launcher's store never came up"
            time.sleep(0.05)
def peak():  # the launcher's peak resident memory, bytes
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")
def request(op, key, val=b""):
    return struct.pack("<BI", op, len(key)) + key + struct.pack("<I", len(val)) + val
def dropped(s):  # the store closes the connection within 10 s
    s.settimeout(10)
    try:
        while s.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    s.close()
s = connect()
before = peak()
s.sendall(request(1, b"k" * 4097, b"x"))
dropped(s)
s = connect()
s.sendall(struct.pack("<BI", 1, 3) + b"big" + struct.pack("<I", (8 << 20) + 1))
dropped(s)
s = connect(rcvbuf=4096)
s.sendall(request(1, b"hostile/big", bytes(8 << 20)))
s.settimeout(30)
assert s.recv(1) == b"\0", "the 8 MiB SET was refused"
try:
    for _ in range(256):
        s.sendall(request(2, b"hostile/big"))
except OSError:
    pass  # dropped already
dropped(s)
grown = peak() - before
assert grown < 1 << 30, f"the launcher grew by {grown >> 20} MiB"
print(f"ok: hostile clients dropped; the launcher's peak memory grew by {grown >> 20} MiB for 2 GiB asked")
PY
"$T" "${common[@]}" "${nodes[@]}" --node-rank 1 --out hostile1 > hostile1.out 2>&1 ||
  { kill $L; wait $L || true; cat hostile.out hostile1.out; fail "node 1, after the hostile clients"; }
[ ! -e hostile1 ] || fail "node 1 (rank 1) wrote a run directory"
wait $L || { cat hostile.out; fail "the job did not survive a hostile store client"; }
[ "$(epochs hostile)" = $'2 10000 0\n2 10000 0' ] || fail "hostile: $(epochs hostile)"
for why in "a key of 4097 bytes, over the limit of 4096 bytes a key" \
  "a value of 8388609 bytes for key 'big', over the limit of 8388608 bytes a value" \
  "a reply would make [0-9]+ bytes held for this connection, over the limit of 33554432 a connection"; do
  grep -Eq "^rendezvous store: disconnected client 127\.0\.0\.1:[0-9]+: $why" hostile.out ||
    { cat hostile.out; fail "no log line: $why"; }
done
[ "$(grep -c '^rendezvous store: disconnected' hostile.out)" -eq 3 ] ||
  { cat hostile.out; fail "not one log line a hostile client"; }
ok "hostile store clients disconnected (one line each), the job trained on"

# ---- a taken port, an unreachable master -------------------------------------------
$PY -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True); time.sleep(30)' > port.txt &
HOLD=$!
for _ in $(seq 50); do [ -s port.txt ] && break; sleep 0.1; done
taken=$(cat port.txt)
expect_fail 1 "master-port $taken: the port is already in use" \
  "$T" "${common[@]}" --nproc 2 --master-port "$taken" --out taken
kill $HOLD
closed=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
expect_fail 1 "cannot reach the rendezvous store at 127.0.0.1:$closed" \
  "$T" "${common[@]}" --nnodes 2 --node-rank 1 --nproc 1 --master-addr 127.0.0.1 \
  --master-port "$closed" --timeout 2 --out unreachable
# a server of another protocol at MASTER_PORT (torchrun's TCPStore closes
# the connection on a stoke request): named as perhaps not a stoke store,
# not as a store that was lost
$PY -c '
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(4)
print(s.getsockname()[1], flush=True)
for _ in range(4):
    c, _ = s.accept(); c.recv(64); c.close()
' > foreign.txt &
F=$!
for _ in $(seq 50); do [ -s foreign.txt ] && break; sleep 0.1; done
expect_fail 1 "the server at 127.0.0.1:$(cat foreign.txt) \(connection closed\) never answered as a stoke store does: is it one\? \(torchrun's TCPStore speaks another protocol" \
  env RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$(cat foreign.txt)" \
  "$T" "${common[@]}" --timeout 5 --out foreign
kill $F 2>/dev/null || true
# flags that cannot work
expect_fail 2 "nnodes 2 needs --master-addr" "$T" --db db --nnodes 2 --nproc 1 --out bad
expect_fail 2 "node-rank 2 must be below --nnodes 2" "$T" --db db --nnodes 2 --node-rank 2 \
  --master-addr 127.0.0.1 --master-port 1 --out bad
expect_fail 2 "gpus 0,0 names GPU 0 twice" "$T" --db db --gpus 0,0 --out bad
expect_fail 2 "^train: --gpus: expected whole numbers 0..1023 separated by single commas, such as 0,1,2,4, got '0,,1'\$" "$T" --db db --gpus 0,,1 --out bad
expect_fail 2 "nproc 3 disagrees with --gpus" "$T" --db db --gpus 2 --nproc 3 --out bad
expect_fail 2 "nproc: expected a whole number 1..64, got '0'" "$T" --db db --nproc 0 --out bad
# torchrun's RANK (or one left in the shell) with launcher flags: refused,
# not a silent single process
expect_fail 2 "train: RANK=0 is set \(by torchrun, or left in this shell\), so this process is one rank of that job and --nproc/--nnodes would be ignored" \
  env RANK=0 WORLD_SIZE=1 "$T" --db db --nproc 2 --out bad
# node 0 alone: its rank waits for a second node that never comes
expect_fail 1 "timed out after 2 s at 'train/joined': 1 of 2 ranks arrived" \
  "$T" "${common[@]}" --nnodes 2 --node-rank 0 --nproc 1 --master-addr 127.0.0.1 \
  --master-port "$closed" --timeout 2 --out alone
