#!/usr/bin/env bash
# train on Fashion-MNIST: it learns, writes metrics and atomic checkpoints
# (PyTorch-named safetensors), a resumed run ends with the same weights as an
# uninterrupted one, and bad input (a model that does not fit, a checkpoint
# of another model, a NaN loss, flags, no GPU) is a clear error.
source "$STK_SRC/tests/e2e/lib.sh"
T="$STK_BIN/train"
"$STK_BIN/prep" --quiet "$FASHION" db
common=(--db db --model mlp --optim sgd --batch 256 --workers 2 --quiet --log-every 20)

"$T" "${common[@]}" --epochs 1 --out run1 > out.txt
cat out.txt
$PY - <<'PY' || fail "first run"
import json, os
lines = [json.loads(l) for l in open("run1/metrics.jsonl")]
steps = [l for l in lines if l["type"] == "step"]
epochs = [l for l in lines if l["type"] == "epoch"]
assert len(epochs) == 1 and epochs[0]["test_samples"] == 10000, epochs
assert epochs[0]["test_acc"] > 0.80, epochs[0]            # it learns
assert steps[0]["loss"] > steps[-1]["loss"], (steps[0], steps[-1])
assert [s["step"] for s in steps] == list(range(20, 235, 20)), [s["step"] for s in steps]
ck = sorted(os.listdir("run1/checkpoints"))
assert ck == ["BEST", "step-00000235"], ck
assert sorted(os.listdir("run1/checkpoints/step-00000235")) == ["model.safetensors", "optim.safetensors", "state.json"]
st = json.load(open("run1/checkpoints/step-00000235/state.json"))
assert st["epoch"] == 1 and st["step"] == 235 and st["loader"] == {"epoch": 1, "batch": 0, "world": 1}, st
print(f"ok: 1 epoch: test accuracy {epochs[0]['test_acc']:.4f}, loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}")
PY
grep -q "test accuracy" out.txt || fail "no summary line"

# resume: 2 epochs straight, or 1 epoch then --resume auto, same weights
const=(--schedule constant --warmup 0 --lr 0.05)
"$T" "${common[@]}" "${const[@]}" --epochs 2 --out straight
"$T" "${common[@]}" "${const[@]}" --epochs 1 --out resumed
"$T" --db db --model mlp --optim sgd --batch 256 --workers 2 --log-every 20 "${const[@]}" \
  --epochs 2 --out resumed --resume auto 2> resume.txt
grep -q "resumed from resumed/checkpoints/step-00000235 (epoch 2, step 235)" resume.txt \
  || fail "resume message: $(cat resume.txt)"
cmp straight/checkpoints/step-00000470/model.safetensors resumed/checkpoints/step-00000470/model.safetensors \
  || fail "resumed run ends with different weights"
cmp straight/checkpoints/step-00000470/optim.safetensors resumed/checkpoints/step-00000470/optim.safetensors \
  || fail "resumed run ends with a different optimizer state"
ok "1 epoch + --resume auto ends with the same weights and momentum as 2 epochs"

# a stop mid-epoch (--max-steps, as Ctrl-C) checkpoints the loader position;
# resuming from it also ends with the same weights
"$T" "${common[@]}" "${const[@]}" --epochs 2 --max-steps 100 --out midway/nested 2> stop.txt
grep -q "stopped at step 100" stop.txt || fail "stop message: $(cat stop.txt)"
$PY - <<'PY' || fail "mid-epoch checkpoint"
import json
st = json.load(open("midway/nested/checkpoints/step-00000100/state.json"))
assert st["step"] == 100 and st["loader"] == {"epoch": 0, "batch": 100, "world": 1} and st["epoch"] == 0, st
print("ok: mid-epoch checkpoint at step 100, loader position epoch 0 batch 100")
PY
# --max-steps counts the run's steps: a resume at or past it trains nothing
# (it trained one step more and its checkpoint pushed older ones out)
at100=$(cd midway/nested && find . -type f ! -name .lock | sort | xargs md5sum)
for max in 100 40; do
  "$T" "${common[@]}" "${const[@]}" --epochs 2 --max-steps $max --out midway/nested \
    --resume auto > again.txt || fail "--max-steps $max at step 100: exit $?"
  grep -q "midway/nested is at step 100, --max-steps $max: nothing left to train" again.txt \
    || fail "--max-steps $max at step 100: $(cat again.txt)"
  [ "$(cd midway/nested && find . -type f ! -name .lock | sort | xargs md5sum)" = "$at100" ] \
    || fail "a resume at --max-steps $max changed the run directory"
done
ok "a resume at or past --max-steps trains nothing and changes nothing"
"$T" "${common[@]}" "${const[@]}" --epochs 2 --out midway/nested --resume auto
cmp straight/checkpoints/step-00000470/model.safetensors midway/nested/checkpoints/step-00000470/model.safetensors \
  || fail "resuming from a mid-epoch stop ends with different weights"
ok "stop at step 100 + --resume auto ends with the same weights as 2 epochs"
# what a run directory holds: its files' contents, listed
snapshot() { (cd "$1" && find . -type f ! -name .lock | sort | xargs md5sum); }
before=$(snapshot straight)
expect_fail 1 "--out straight holds the checkpoints of an earlier run; continue it with --resume auto" \
  "$T" "${common[@]}" --epochs 1 --out straight
[ "$(snapshot straight)" = "$before" ] || fail "a refused fresh run changed straight"
"$T" "${common[@]}" "${const[@]}" --epochs 2 --out straight --resume auto | grep -q "already finished 2 epoch(s) (470 steps" \
  || fail "resuming a finished run should say there is nothing left"
[ "$(snapshot straight)" = "$before" ] || fail "resuming a finished run changed straight"
ok "resuming a finished run reports it and changes nothing"
# --resume PATH into a RUN_DIR holding checkpoints of another line is
# refused: a rewind (newer ones there, which --resume auto, BEST and --keep
# would take for the new run's) or another run's
expect_fail 1 "--resume straight/checkpoints/step-00000235 rewinds to step 235, and --out straight holds the newer checkpoints of the run it leaves \(up to step-00000470\)" \
  "$T" "${common[@]}" "${const[@]}" --epochs 2 --out straight --resume straight/checkpoints/step-00000235
expect_fail 1 "--out midway/nested holds the checkpoints of another run \(the newest step-00000470\)" \
  "$T" "${common[@]}" "${const[@]}" --epochs 2 --out midway/nested --resume ./straight/checkpoints/step-00000235/
[ "$(snapshot straight)" = "$before" ] || fail "a refused rewind changed straight"
[ ! -e midway/nested/metrics.jsonl.1 ] || fail "a refused resume set metrics.jsonl aside"
# what it is for: a branch in a RUN_DIR of its own, the same weights; then
# its own newest checkpoint by PATH
"$T" "${common[@]}" "${const[@]}" --epochs 2 --out branch --resume straight/checkpoints/step-00000235
cmp straight/checkpoints/step-00000470/model.safetensors branch/checkpoints/step-00000470/model.safetensors \
  || fail "--resume PATH into a new --out ends with different weights"
"$T" "${common[@]}" "${const[@]}" --epochs 2 --out branch --resume branch/checkpoints/step-00000470 \
  | grep -q "already finished" || fail "--resume PATH of the RUN_DIR's newest checkpoint"
ok "--resume PATH refused where --out holds a newer or another run's checkpoints; a new --out continues it"
# a RUN_DIR whose earlier run left metrics but no checkpoint (killed before
# its first): a new run keeps those lines apart and starts its own; a
# resume of its own checkpoint appends
mkdir -p stale && printf '{"type":"step","step":10,"loss":9}\n' > stale/metrics.jsonl
"$T" "${common[@]}" --log-every 1 --epochs 1 --max-steps 3 --out stale 2> stale.txt
grep -q "stale/metrics.jsonl held the lines of an earlier run that left no checkpoint; they are in stale/metrics.jsonl.1" stale.txt \
  || fail "metrics set aside: $(cat stale.txt)"
[ "$(cat stale/metrics.jsonl.1)" = '{"type":"step","step":10,"loss":9}' ] || fail "the earlier lines were not kept"
grep -q '"step":10,"loss":9' stale/metrics.jsonl && fail "a new run appended to an earlier run's metrics"
"$T" "${common[@]}" --log-every 1 --epochs 1 --max-steps 5 --out stale --resume auto
[ ! -e stale/metrics.jsonl.2 ] && [ "$(grep -c '"type":"step"' stale/metrics.jsonl)" -eq 5 ] \
  || fail "a resume did not append to its own run's metrics"
ok "a new run in a RUN_DIR with an earlier run's metrics and no checkpoint keeps them apart"
# a resume may change --lr and --accum, and says it will not end as the
# uninterrupted run would
"$T" "${common[@]}" --epochs 1 --max-steps 7 --lr 0.07 --accum 2 --out stale --resume auto \
  --weight-decay 0.25 --momentum 0.5 2> note.txt
grep -q "note: stale/checkpoints/step-00000005/state.json was written with --lr 0.02, this run uses 0.07" note.txt \
  && grep -q "state.json was written with --accum 1, this run uses 2" note.txt \
  && grep -q "state.json was written with --weight-decay 0, this run uses 0.25: it will not end as the uninterrupted run" note.txt \
  && grep -q "state.json was written with --momentum 0.9, this run uses 0.5" note.txt \
  && [ "$(grep -c note: note.txt)" -eq 4 ] || fail "resume notes: $(cat note.txt)"
# a longer run under a schedule that does not span it (constant, step) is
# the uninterrupted longer run: no note; under cosine, --epochs is noted
"$T" "${common[@]}" "${const[@]}" --epochs 1 --max-steps 2 --out longer > /dev/null
"$T" "${common[@]}" "${const[@]}" --epochs 2 --max-steps 3 --out longer --resume auto 2> note.txt
grep -q note: note.txt && fail "a longer constant-rate run: $(cat note.txt)"
"$T" "${common[@]}" "${const[@]}" --schedule cosine --epochs 2 --max-steps 4 --out longer --resume auto 2> note.txt
grep -q "was written with --schedule constant, this run uses cosine" note.txt && \
  [ "$(grep -c note: note.txt)" -eq 1 ] || fail "constant to cosine: $(cat note.txt)"
"$T" "${common[@]}" "${const[@]}" --schedule cosine --epochs 3 --max-steps 5 --out longer --resume auto 2> note.txt
grep -q "was written with --epochs 2, this run uses 3" note.txt || fail "cosine over more epochs: $(cat note.txt)"
# a flag that spells what the run did anyway is no change: --crop-size 28
# on 28x28 records is the records as stored
"$T" "${common[@]}" "${const[@]}" --schedule cosine --epochs 3 --max-steps 6 --crop-size 28 --out longer \
  --resume auto 2> note.txt
grep -q note: note.txt && fail "--crop-size 28 on 28x28 records: $(cat note.txt)"
# another model: refused naming both --model values, before any note
expect_fail 1 "longer/checkpoints/step-00000006/state.json: written with --model mlp \(235146 parameters in 6 tensors \(layout [0-9a-f]*\)\), this run's --model cnn has [0-9]* parameters" \
  "$T" "${common[@]}" "${const[@]}" --model cnn --schedule cosine --epochs 3 --out longer --resume auto
ok "a resume that changes what its end depends on (--lr, --accum, --weight-decay, --momentum, --schedule, --epochs under cosine) says so"

# Ctrl-C during an epoch's evaluation ends the run with that epoch's
# checkpoint (it trained a step of the next epoch and wrote a second): a
# 1-step epoch of the cnn and a 10000-sample evaluation; SIGINT once the
# step's line is out (a signal after the evaluation still finds the stop
# before the next epoch's first step)
$PY "$STK_SRC/tests/e2e/fm_subset.py" "$FASHION" small 64
"$STK_BIN/prep" --quiet small sdb
"$T" --db sdb --model cnn --batch 64 --epochs 3 --workers 1 --log-every 1 --quiet \
  --out evstop > /dev/null 2> evstop.txt &
pid=$!
for _ in $(seq 600); do grep -qs '"type":"step"' evstop/metrics.jsonl && break; sleep 0.05; done
kill -INT $pid
rc=0; wait $pid || rc=$?
[ $rc -eq 130 ] || fail "Ctrl-C during evaluation: exit $rc: $(cat evstop.txt)"
[ "$(ls evstop/checkpoints | tr '\n' ' ')" = "BEST step-00000001 " ] \
  || fail "Ctrl-C during evaluation left $(ls evstop/checkpoints | tr '\n' ' ')"
ok "Ctrl-C during an epoch's evaluation stops with that epoch's checkpoint alone"
# --evaluate writes nothing: Ctrl-C ends it at once, exit 130, no result
# (it ran the whole evaluation and exited 0); one thread keeps the cnn's
# 10000 test images busy for seconds
"$T" --db sdb --model cnn --evaluate --init-from evstop/best.safetensors --threads 1 > evint.txt 2>&1 &
pid=$!
sleep 0.3
kill -INT $pid
rc=0; wait $pid || rc=$?
[ $rc -eq 130 ] && ! grep -q "test accuracy" evint.txt || fail "Ctrl-C during --evaluate: exit $rc: $(cat evint.txt)"
"$T" --db sdb --model cnn --evaluate --init-from evstop/best.safetensors --quiet > ev.txt \
  && grep -q "^train: evstop/best.safetensors on sdb's test split: test accuracy [0-9.]*%, test loss [0-9.]*$" ev.txt \
  || fail "--evaluate: $(cat ev.txt)"
ok "--evaluate prints one line; Ctrl-C ends it at once"
# a batchnorm over 1x1 inputs and an epoch whose last batch is 1 sample:
# refused before the first step (it failed after the epoch's work, its
# message blaming --batch), naming the remainder
printf 'flatten\nfc1: linear 32\nbn: batchnorm\nrelu\nfc2: linear classes\n' > bn1d.model
mkdir -p bn63 && printf '{"type":"step","step":1,"loss":2}\n' > bn63/metrics.jsonl
expect_fail 1 "model: bn: a batchnorm over 1x1 inputs sees one value per channel in the epoch's last batch, of 1 sample \(64 train samples a rank = 1 x --batch 63 \+ 1\)" \
  "$T" --db sdb --model bn1d.model --batch 63 --quiet --out bn63
[ ! -e bn63/metrics.jsonl.1 ] && [ "$(cat bn63/metrics.jsonl)" = '{"type":"step","step":1,"loss":2}' ] \
  || fail "a refused run set an earlier run's metrics.jsonl aside"
"$T" --db sdb --model bn1d.model --batch 32 --epochs 1 --quiet --out bn32 > /dev/null \
  || fail "bn1d.model at --batch 32"
"$T" --db sdb --model bn1d.model --batch 63 --max-steps 1 --quiet --out bn63short > /dev/null \
  || fail "bn1d.model at --batch 63, a step that never meets the last batch"
ok "an epoch's last batch of one sample through a 1x1 batchnorm is refused at the start"
# a warm-up that takes the whole run, and --sync-bn on one rank, are said
"$T" --db sdb --model mlp --batch 32 --epochs 1 --max-steps 1 --sync-bn --out warm > /dev/null 2> warm.txt
grep -q "train: note: --warmup 100 takes the run's whole 2 steps: the rate rises to 4e-05 (--lr 0.002) and never decays" warm.txt \
  && grep -q "train: --sync-bn: one rank, whose batch is the whole batch: nothing to synchronise" warm.txt \
  || fail "warm-up and --sync-bn lines: $(cat warm.txt)"
"$T" --db sdb --model mlp --batch 32 --epochs 1 --max-steps 1 --warmup 1 --quiet --out warm2 2> warm.txt
grep -q note: warm.txt && fail "a warm-up shorter than the run was noted: $(cat warm.txt)"
ok "a warm-up that takes the whole run and --sync-bn on one rank are said"

# adamw (the default): one file holds both moments; the cnn with
# augmentation runs
"$T" --db db --model mlp --epochs 1 --quiet --out adamw > /dev/null
$PY - <<'PY' || fail "adamw optimizer state"
import json, struct
d = "adamw/checkpoints/step-00000938/"
raw = open(d + "optim.safetensors", "rb").read()
hdr = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
names = sorted(k for k in hdr if k != "__metadata__")
assert names == sorted(f"{p}.{s}" for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias") for s in ("exp_avg", "exp_avg_sq")), names
print("ok: adamw checkpoint holds exp_avg and exp_avg_sq of every parameter")
PY
"$T" --db db --model cnn --augment --max-steps 5 --batch 32 --quiet --out cnn > /dev/null
$PY - <<'PY' || fail "cnn --augment checkpoint"
import json
st = json.load(open("cnn/checkpoints/step-00000005/state.json"))
assert st["step"] == 5 and st["loader"] == {"epoch": 0, "batch": 5, "world": 1}, st
PY
ok "adamw and cnn --augment run"

# bad input
printf 'conv 8 30\nflatten\nlinear classes\n' > big.txt
expect_fail 1 "conv1: a 30x30 kernel does not fit its 1x28x28 input" "$T" --db db --model big.txt --out x
printf 'conv1: conv 4 3\nconv 4 3\nflatten\nlinear classes\n' > twins.txt
"$T" --db db --model twins.txt --max-steps 1 --quiet --out twins >/dev/null || fail "conv1 + unnamed conv"
$PY - <<'PY' || fail "twins' tensor names"
import json, struct
raw = open("twins/checkpoints/step-00000001/model.safetensors", "rb").read()
names = sorted(k for k in json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]]) if k != "__metadata__")
assert names == ["conv1.bias", "conv1.weight", "conv2.bias", "conv2.weight", "fc1.bias", "fc1.weight"], names
PY
printf 'a: conv 4 3\na: conv 4 3\nflatten\nlinear classes\n' > same.txt
expect_fail 1 "same.txt:2: a second layer named 'a' \\(the first is on line 1\\)" "$T" --db db --model same.txt --out x
printf 'conv 8 3\nwobble\n' > typo.txt
expect_fail 1 "typo.txt:2: unknown layer 'wobble'" "$T" --db db --model typo.txt --out x
printf 'conv 8 3\npool 2 pad=1\nflatten\nlinear classes\n' > padpool.txt
expect_fail 1 "padpool.txt:2: 'pad=1' does not apply to this layer" "$T" --db db --model padpool.txt --out x
expect_fail 1 "model.safetensors: \"conv1.weight\" is missing|no tensor \"conv1.weight\"" \
  "$T" --db db --model cnn --init-from run1/checkpoints/step-00000235/model.safetensors --out x
# --init-from given a checkpoint's directory or its optimizer state: said
expect_fail 1 "--init-from run1/checkpoints/step-00000235: a directory; a checkpoint's weights are its model.safetensors" \
  "$T" "${common[@]}" --init-from run1/checkpoints/step-00000235 --out x
expect_fail 1 "--init-from: run1/checkpoints/step-00000235/optim.safetensors: no tensor \"fc1.weight\" \(the file's first is \"fc[0-9].(weight|bias).momentum_buffer\"" \
  "$T" "${common[@]}" --init-from run1/checkpoints/step-00000235/optim.safetensors --out x
# --init-from with --resume: PATH refused (the checkpoint's weights would
# win silently); auto reads it only where there is no checkpoint yet
expect_fail 2 "--init-from and --resume PATH exclude each other" \
  "$T" --db db --init-from run1/best.safetensors --resume run1/checkpoints/step-00000235 --out x
"$T" "${common[@]}" --epochs 1 --out run1 --resume auto --init-from no/such.safetensors 2> init.txt \
  && grep -q "note: --init-from no/such.safetensors is not read: the run continues its checkpoint" init.txt \
  || fail "--resume auto --init-from with a checkpoint: $(cat init.txt)"
expect_fail 1 "no/such.safetensors" "$T" "${common[@]}" --epochs 1 --max-steps 1 --out fresh_init \
  --resume auto --init-from no/such.safetensors
ok "--init-from with --resume: PATH refused, auto reads it only without a checkpoint"
expect_fail 1 "loss is (NaN|infinite) at step [0-9]+ \(epoch 2\); stopped, the last good checkpoint is kept" \
  "$T" "${common[@]}" --epochs 3 --out run1 --resume auto --lr 90 --schedule constant --warmup 0
[ -f run1/checkpoints/step-00000235/model.safetensors ] || fail "the good checkpoint is gone"
[ "$(ls run1/checkpoints)" = $'BEST\nstep-00000235' ] || fail "a NaN run left checkpoints: $(ls run1/checkpoints)"
expect_fail 2 "--optim: expected sgd or adamw, got 'lion'" "$T" --db db --optim lion
expect_fail 2 "--lr: expected a number" "$T" --db db --lr fast
expect_fail 2 "unknown option '--turbo'" "$T" --db db --turbo
expect_fail 2 "--db DB_DIR is required" "$T" --epochs 1
# --device cuda: refused where no GPU works (test_cuda_smoke skips), a
# short run with finite losses where one does
rc=0
"$STK_BIN/test_cuda_smoke" > cuda_smoke.out 2>&1 || rc=$?
if [ "$rc" -eq 77 ]; then
  expect_fail 1 "--device cuda: (no CUDA device|this stoke was built without CUDA)" "$T" --db db --device cuda --out x
else
  [ "$rc" -eq 0 ] || { cat cuda_smoke.out; fail "test_cuda_smoke exited $rc"; }
  "$T" "${common[@]}" --device cuda --epochs 1 --max-steps 20 --log-every 1 --out cuda1 \
    > cuda1.out 2>&1 || { cat cuda1.out; fail "--device cuda: a 20-step run"; }
  $PY - <<'PY' || fail "--device cuda: step lines"
import json, math
loss = [d["loss"] for d in map(json.loads, open("cuda1/metrics.jsonl")) if d["type"] == "step"]
assert len(loss) == 20 and all(math.isfinite(x) for x in loss), loss
print(f"ok: --device cuda: 20 steps, loss {loss[0]:.3f} -> {loss[-1]:.3f}")
PY
fi
"$STK_BIN/prep" --quiet --format folder "$STK_SRC/tests/e2e" notadb 2>/dev/null || true
mkdir onesplit && $PY "$STK_SRC/tests/e2e/make_folder.py" onesplit/raw 50 28 && "$STK_BIN/prep" --quiet onesplit/raw onesplit/db
expect_fail 1 "onesplit/db: has no \"test\" split to evaluate on; hold part of each class out with .prep --holdout 0.1" "$T" --db onesplit/db --out x
expect_fail 1 "nodb: not a stoke database" "$T" --db nodb
! ls x/checkpoints 2>/dev/null | grep -q step- || fail "a refused run wrote a checkpoint into x"
ok "bad input refused"
