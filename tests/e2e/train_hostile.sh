#!/usr/bin/env bash
# train and sweep against hostile input (issue 13): a FIFO wherever they
# read a file, two runs into one --out, model-file numbers that overflowed,
# NaN and infinite weights on resume, a doctored state.json, bad seeds and
# Nesterov without momentum, and more ranks than test samples. Every
# refusal has its documented exit code and message, and leaves the run
# directory as it was; anything that could block is bounded by a timeout.
source "$STK_SRC/tests/e2e/lib.sh"
T="$STK_BIN/train"
S="$STK_BIN/sweep"
# Against hangs only, so generous: under ASan/TSan on 2 shared cores a run
# of 3 ranks, or a Fashion-MNIST resume evaluating 10,000 test samples,
# takes minutes. SIGTERM alone would only ask train to stop at a step
# boundary: -k kills it 10 s later.
t() { timeout -k 10 300 "$@"; }

# a tiny database: the first 512 training and 2 test samples of Fashion-MNIST
$PY - <<'PY'
import gzip, os
os.makedirs("tinyraw")
for split, n in (("train", 512), ("t10k", 2)):
    for kind, per in (("images-idx3", 28 * 28), ("labels-idx1", 1)):
        data = gzip.open(os.environ.get("STK_FASHION", "/usr/share/datasets/fashion-mnist") + f"/{split}-{kind}-ubyte.gz").read()
        head = bytearray(data[:4 + 4 * data[3]])
        head[4:8] = n.to_bytes(4, "big")
        open(f"tinyraw/{split}-{kind}-ubyte", "wb").write(bytes(head) + data[len(head):len(head) + n * per])
PY
"$STK_BIN/prep" --quiet tinyraw db >/dev/null
c=(--db db --model mlp --optim sgd --batch 64 --workers 1 --quiet)
"$T" "${c[@]}" --epochs 1 --out base >/dev/null
ck=checkpoints/step-00000008
[ -f base/$ck/model.safetensors ] || fail "no base checkpoint"
# fresh copy of the base run: the checkpoint of 1 epoch (8 steps)
run() { rm -rf "$1" && cp -r base "$1"; }
# the run directory holds no checkpoint after step 8 and the same best weights
untouched() {
  [ ! -e "$1/checkpoints/step-00000016" ] || fail "$1: a refused run wrote a checkpoint"
  cmp -s base/best.safetensors "$1/best.safetensors" || fail "$1: best.safetensors changed"
}

# ---- FIFOs where train reads (or appends to) a file: refused, never opened --
mkfifo fifo
expect_fail 1 "train: error: fifo: not a regular file \(a FIFO\)" t "$T" "${c[@]}" --model fifo --out x
expect_fail 1 "train: error: --init-from: fifo: not a regular file \(a FIFO\)" t "$T" "${c[@]}" --init-from fifo --out x
for f in $ck/model.safetensors $ck/optim.safetensors $ck/state.json checkpoints/BEST metrics.jsonl .lock; do
  run r && rm r/$f && mkfifo r/$f
  expect_fail 1 "train: error: r/$f: not a regular file \(a FIFO\)" \
    t "$T" "${c[@]}" --epochs 2 --out r --resume auto
  untouched r
done
# a FIFO named like a checkpoint is no checkpoint: --resume auto takes the newest directory
run r && mkfifo r/checkpoints/step-00000099
t "$T" --db db --model mlp --optim sgd --batch 64 --workers 1 --epochs 2 --out r --resume auto 2> r.err ||
  { cat r.err; fail "a FIFO among the checkpoints"; }
grep -q "resumed from r/$ck (epoch 2, step 8)" r.err || fail "resume: $(cat r.err)"
[ -f r/checkpoints/step-00000016/model.safetensors ] || fail "no checkpoint after the resume"
# pruning (--keep 1) never empties a directory through a link named like a checkpoint
run r && mkdir keepme && touch keepme/precious && ln -s ../../keepme r/checkpoints/step-00000001
t "$T" "${c[@]}" --epochs 3 --keep 1 --out r --resume auto >/dev/null || fail "a link among the checkpoints"
[ -f keepme/precious ] && [ -L r/checkpoints/step-00000001 ] || fail "pruning followed a link"
[ ! -e r/checkpoints/step-00000008 ] || fail "pruning kept step 8 (neither newest nor best) with --keep 1"
# files train writes anew are created afresh, never opened through a FIFO left there
run r && mkfifo r/best.safetensors.tmp r/checkpoints/BEST.tmp
t "$T" "${c[@]}" --epochs 2 --out r --resume auto >/dev/null || fail "FIFOs at the temporary names"
[ -f r/best.safetensors ] && [ "$(cat r/checkpoints/BEST)" = step-00000016 ] || fail "best not written"
ok "FIFOs refused by name or written around; none blocks"

# ---- two runs into one --out --------------------------------------------------
# a long run holds RUN_DIR; a second (one process or a group) is refused at
# once naming the holder, writes nothing there, and the lock dies with it
"$STK_BIN/prep" --quiet "$FASHION" fm >/dev/null
"$T" --db fm --model mlp --workers 1 --quiet --epochs 100 --log-every 100000 --out busy &
A=$!
# its start (the database opened and checked, the model built) takes as
# long as the machine needs: wait while it lives
until [ "$(cat busy/.lock 2>/dev/null)" = "$A" ]; do
  kill -0 $A 2>/dev/null || fail "the first run ended without locking busy"
  sleep 0.1
done
expect_fail 1 "train: error: --out busy is in use by another train \(pid $A\)" \
  t "$T" --db fm --model mlp --workers 1 --quiet --epochs 1 --out busy
expect_fail 1 "--out busy is in use by another train \(pid $A\)" \
  t "$T" --db fm --model mlp --workers 1 --quiet --epochs 1 --out busy --resume auto --nproc 2
kill -0 $A || fail "the first run died"
! grep -q '"world":2' busy/metrics.jsonl || fail "the refused group wrote metrics"
kill -9 $A; wait $A || true
t "$T" --db fm --model mlp --workers 1 --quiet --epochs 100 --max-steps 3 --out busy --resume auto \
  2> busy.err || { cat busy.err; fail "a killed run's lock blocked the next run"; }
grep -Eq "stopped at step [0-9]+" busy.err || fail "after kill -9: $(cat busy.err)"
ok "two runs never share a RUN_DIR; kill -9 frees it"

# ---- model files: every number range-checked, sizes in 64 bits ------------------
bad_model() { # FILE-TEXT PATTERN
  printf "$1" > m.txt
  expect_fail 1 "$2" t "$T" "${c[@]}" --model m.txt --out xm
}
bad_model 'flatten\nlinear 4294967297\nlinear classes\n' \
  "m.txt:2: '4294967297' is out of range: linear features takes a whole number 1..1048576"
bad_model 'conv 8 3 pad=2147483647\nflatten\nlinear classes\n' \
  "m.txt:1: 'pad=2147483647' is out of range: pad takes a whole number 0..1024"
bad_model 'conv 8 3 stride=-2\nflatten\nlinear classes\n' \
  "m.txt:1: 'stride=-2' is out of range: stride takes a whole number 1..1024"
bad_model 'pool 99999999999\n' "m.txt:1: '99999999999' is out of range: pool size takes a whole number 1..1024"
bad_model 'conv 8 three\n' "m.txt:1: 'three' is not a number: conv kernel takes a whole number 1..1024"
bad_model 'flatten\ndropout 1.5\nlinear classes\n' \
  "m.txt:2: '1.5' is out of range: dropout probability takes a number in \[0, 1\)"
bad_model 'conv 1048576 3\nflatten\nlinear classes\n' \
  "model: conv1: its 1048576x26x26 output over a batch of 64 is more than 2147483647 values"
bad_model 'conv 8 3 pad=1024\nflatten\nlinear classes\n' \
  "model: conv1: its 8x2074x2074 output over a batch of 64 is more than 2147483647 values"
bad_model 'flatten\nwide: linear 1048576\nlinear 1048576\nlinear classes\n' \
  "model: fc2: its weight has more than 2147483647 values"
[ ! -e xm ] || fail "a refused model created its --out"
ok "model-file numbers and layer sizes bounded"

# ---- NaN and infinite weights or optimizer state: refused on load ------------
poison() { # RUN FILE TENSOR VALUE: element 5 of TENSOR in RUN's checkpoint
  $PY - "$@" <<'PY'
import json, struct, sys
run, f, name, value = sys.argv[1:]
p = f"{run}/checkpoints/step-00000008/{f}"
b = bytearray(open(p, "rb").read())
n = struct.unpack("<Q", b[:8])[0]
start = 8 + n + json.loads(b[8:8 + n])[name]["data_offsets"][0] + 5 * 4
b[start:start + 4] = struct.pack("<f", float(value))
open(p, "wb").write(bytes(b))
PY
}
run nan && poison nan model.safetensors fc1.weight nan
expect_fail 1 "nan/$ck/model.safetensors: \"fc1.weight\" holds NaN at element 5" \
  t "$T" "${c[@]}" --epochs 2 --out nan --resume auto
untouched nan
expect_fail 1 "nan/$ck/model.safetensors: \"fc1.weight\" holds NaN at element 5" \
  t "$T" "${c[@]}" --epochs 1 --out fromnan --init-from nan/$ck/model.safetensors
[ ! -e fromnan/best.safetensors ] || fail "--init-from NaN wrote weights"
run inf && poison inf optim.safetensors fc2.bias.momentum_buffer -inf
expect_fail 1 "inf/$ck/optim.safetensors: \"fc2.bias.momentum_buffer\" holds an infinity at element 5" \
  t "$T" "${c[@]}" --epochs 2 --out inf --resume auto
untouched inf
ok "non-finite tensors refused by file and name"

# ---- state.json: every field checked against the run -----------------------
edit_state() { # PYTHON-EDIT: a fresh copy st of base, its state.json edited
  run st && $PY - "$1" <<'PY'
import json, sys
p = "st/checkpoints/step-00000008/state.json"
s = json.load(open(p)); exec(sys.argv[1]); json.dump(s, open(p, "w"))
PY
}
bad_state() { # PYTHON-EDIT PATTERN [FLAGS...]
  local edit=$1 pat=$2; shift 2
  edit_state "$edit"
  expect_fail 1 "st/$ck/state.json: $pat" t "$T" "${c[@]}" --epochs 2 --out st --resume auto "$@"
  untouched st
}
bad_state 's["epoch"] = -1' "epoch is -1, expected a whole number 0..2 \(this run's --epochs 2\)"
bad_state 's["epoch"] = s["loader"]["epoch"] = 7' "epoch is 7, expected a whole number 0..2"
bad_state 's["loader"]["epoch"] = 0' "loader.epoch is 0, expected a whole number 1..1 \(the same as epoch\)"
bad_state 's["loader"]["batch"] = 8' "loader.batch is 8, expected a whole number 0..7"
bad_state 's["loader"]["batch"] = 2.5' "loader.batch is 2.5, expected a whole number"
bad_state 's["epoch"] = s["loader"]["epoch"] = 2; s["loader"]["batch"] = 3' \
  "loader.batch is 3, expected a whole number 0..0 \(all epochs are done\)"
bad_state 's["loader"]["world"] = 0' "loader.world is 0, expected a whole number 1..1048576"
bad_state 's["step"] = 1e15' "step is 1000000000000000, expected a whole number 1..8"
bad_state 's["step"] = 5' "step is 5, but epoch_steps and loader.batch add up to 8"
bad_state 's["epoch_steps"] = [0]' "epoch_steps\[0\] is not a whole number 1..8"
bad_state 's["epoch_steps"] = [4, 4]' "epoch_steps is not a list of 1 entries"
bad_state 'del s["step"]' "step is missing or not a number"
bad_state 's["best_acc"] = 7' "best_acc is not an accuracy in \[0, 1\]"
bad_state 'pass' "seed is not this run's --seed 2 \(it holds '1'" --seed 2
bad_state 's["seed"] = 2' "seed is not this run's --seed 1 \(it holds 2;"
bad_state 'del s["seed"]' "seed is not this run's --seed 1 \(it holds no seed;"
# an older checkpoint's seed is a JSON number: taken where it is exact (to
# 2^53), refused above, where it cannot tell neighbouring seeds apart
bad_state 's["seed"] = 18446744073709551615' \
  "seed is not this run's --seed 18446744073709551615 \(it holds 1.8446744073709552e\+19, a number exact only to 2\^53" \
  --seed 18446744073709551615
edit_state 's["seed"] = 1'
t "$T" "${c[@]}" --epochs 2 --out st --resume auto >/dev/null || fail "an older checkpoint's seed 1 (a number)"
[ -f st/checkpoints/step-00000016/model.safetensors ] || fail "no checkpoint after resuming an older checkpoint"
bad_state 'pass' "batch is 64, expected a whole number 32..32 \(this run's --batch" --batch 32
bad_state 'pass' "written with --optim sgd, this run uses adamw" --optim adamw
ok "state.json checked field by field"

# ---- flags: seeds are unsigned 64-bit numbers; Nesterov needs momentum ------
for s in abc -1 " 3" 18446744073709551616 1e3 ""; do
  expect_fail 2 "train: --seed: expected a whole number 0..18446744073709551615, got '$s'" \
    "$T" --db db --seed "$s"
  expect_fail 2 "sweep: --seed: expected a whole number 0..18446744073709551615, got '$s'" \
    "$S" --db db --seed "$s"
done
expect_fail 2 "train: --nesterov needs --momentum above 0 \(Nesterov momentum requires a momentum" \
  "$T" --db db --optim sgd --momentum 0 --nesterov
# flags the run would silently ignore are refused (exit 2)
expect_fail 2 "train: --momentum and --nesterov apply to --optim sgd; this run's optimizer is adamw" \
  "$T" --db db --momentum 0.9
expect_fail 2 "train: --momentum and --nesterov apply to --optim sgd" "$T" --db db --nesterov --optim adamw
expect_fail 2 "train: --step-size and --gamma apply to --schedule step" \
  "$T" --db db --optim sgd --gamma 0.5
expect_fail 2 "train: --step-size and --gamma apply to --schedule step" "$T" --db db --step-size 3
expect_fail 2 "train: --gpu N picks the GPU of --device cuda; this run is on the CPU" "$T" --db db --gpu 1
expect_fail 2 "train: --evaluate evaluates the weights of --init-from FILE .*, which is missing" "$T" --db db --evaluate
expect_fail 2 "train: --evaluate evaluates the weights of --init-from FILE .*, not --resume" \
  "$T" --db db --evaluate --init-from x.safetensors --resume auto
expect_fail 2 "train: --gpu does not apply to data-parallel ranks" "$T" --db db --gpus 1 --gpu 0
expect_fail 2 "train: --gpu does not apply to data-parallel ranks" "$T" --db db --device cuda --nproc 2 --gpu 1
expect_fail 1 "train: error: --rrc-scale applies to --augment rrc \(RandomResizedCrop\); db holds records of one size, which train as stored by default: add --augment rrc" \
  "$T" --db db --rrc-scale 0.5,1
[ ! -e runs ] || fail "a refused flag created the default --out"
t "$T" "${c[@]}" --epochs 1 --seed 18446744073709551615 --out bigseed >/dev/null || fail "seed 2^64-1"
# a seed above 2^53 is recorded exactly: its neighbour (the same double) is
# refused, the seed itself resumes
grep -q '"seed":[[:space:]]*"18446744073709551615"' bigseed/$ck/state.json ||
  fail "seed 2^64-1 not recorded exactly: $(cat bigseed/$ck/state.json)"
expect_fail 1 "bigseed/$ck/state.json: seed is not this run's --seed 18446744073709551614 \(it holds '18446744073709551615'" \
  t "$T" "${c[@]}" --epochs 2 --seed 18446744073709551614 --out bigseed --resume auto
[ ! -e bigseed/checkpoints/step-00000016 ] || fail "a refused seed wrote a checkpoint"
t "$T" "${c[@]}" --epochs 2 --seed 18446744073709551615 --out bigseed --resume auto >/dev/null ||
  fail "resuming seed 2^64-1"
[ -f bigseed/checkpoints/step-00000016/model.safetensors ] || fail "no checkpoint after resuming seed 2^64-1"
t "$T" "${c[@]}" --epochs 1 --nesterov --momentum 0.5 --max-steps 2 --out nest >/dev/null || fail "Nesterov"
ok "--seed and --nesterov refused as usage errors (exit 2); their good values run; a seed above 2^53 resumes only with itself"

# ---- more ranks than test samples: an empty share, every sample once ---------
# 2 test samples on 3 ranks; then one process evaluates the same weights
# (--lr 0 leaves them as they are): the same count, accuracy and loss
t "$T" "${c[@]}" --epochs 1 --nproc 3 --out three >/dev/null || fail "--nproc 3 with 2 test samples"
w=$(ls three/checkpoints | grep step- | tail -1)
t "$T" "${c[@]}" --epochs 1 --lr 0 --momentum 0 --init-from three/checkpoints/$w/model.safetensors \
  --out one >/dev/null || fail "evaluating on one process"
$PY - <<'PY' || fail "3-rank evaluation"
import json
ep = lambda d: [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"epoch"' in l][-1]
a, b = ep("three"), ep("one")
assert a["world"] == 3 and b["world"] == 1, (a, b)
assert a["test_samples"] == b["test_samples"] == 2, (a, b)
assert a["test_acc"] == b["test_acc"] and abs(a["test_loss"] - b["test_loss"]) < 1e-5, (a, b)
print(f"ok: 3 ranks and 1 evaluate the 2 test samples alike (acc {a['test_acc']}, loss {a['test_loss']:.6f})")
PY
