#!/usr/bin/env bash
# data-parallel training on 2 GPUs (NCCL): every rank on its own GPU, the
# weights identical on both after every epoch, 2 x 64 following 1 x 128 on
# the mlp, a stopped (SIGSTOP) or killed rank ending the job within
# seconds naming it (--timeout 5), and --gpus beyond the visible GPUs
# refused. Skips (77) without 2 GPUs.
source "$STK_SRC/tests/e2e/lib.sh"
rc=0
out=$("$STK_BIN/test_cuda_smoke" 2>&1) || rc=$?
[ "$rc" -ne 77 ] || { echo "$out"; exit 77; }
[ "$rc" -eq 0 ] || fail "CUDA smoke test: $out"
n=$(grep -c '^ok: device' <<<"$out" || true)
[ "$n" -ge 2 ] || { echo "SKIP: $n GPU(s) here; this test needs 2"; exit 77; }
T="$STK_BIN/train"
$PY "$STK_SRC/tests/e2e/fm_subset.py" "$FASHION" raw 6144
"$STK_BIN/prep" --quiet raw db
common=(--db db --workers 1 --seed 3)

# not --quiet: every rank names its device
"$T" "${common[@]}" --model cnn --gpus 2 --batch 64 --epochs 2 --out g2 --log-all-ranks \
  > g2.out 2>&1 || { cat g2.out; fail "--gpus 2"; }
$PY - <<'PY' || fail "GPU ranks"
import json
ep = [json.loads(l) for l in open("g2/metrics.jsonl")]
ep = [d for d in ep if d["type"] == "epoch"]
assert [(d["world"], d["test_samples"], d["params_differing_across_ranks"]) for d in ep] == \
    [(2, 10000, 0)] * 2, ep
print("ok: 2 GPUs, 2 epochs, identical weights after each, 10000 test samples")
PY
grep -q "\[rank 1\] train: rank 1 of 2 on cuda:1" g2.out ||
  { cat g2.out; fail "rank 1 did not run on cuda:1"; }
common+=(--quiet)

same=(--model mlp --no-dropout --epochs 3 --max-steps 100 --log-every 1)
"$T" "${common[@]}" "${same[@]}" --device cuda --batch 128 --out m128
"$T" "${common[@]}" "${same[@]}" --gpus 0,1 --batch 64 --out m2x64 > m2x64.out 2>&1 ||
  { cat m2x64.out; fail "mlp 2 x 64"; }
$PY - <<'PY' || fail "losses differ"
import json
def losses(run):
    return [d["loss"] for d in map(json.loads, open(run + "/metrics.jsonl")) if d["type"] == "step"]
a, b = losses("m128"), losses("m2x64")
assert len(a) == len(b) == 100
worst = max(abs(x - y) / abs(y) for x, y in zip(b, a))
assert worst < 1e-4, worst
print(f"ok: mlp on 2 GPUs x 64 follows 1 GPU x 128 (largest relative difference {worst:.2e})")
PY

# a rank that stops answering (SIGSTOP) or dies (SIGKILL), --timeout 5:
# the job ends naming it (NCCL aborted on every rank), no process left
source "$STK_SRC/tests/e2e/dist_lib.sh"
long=(--model cnn --gpus 2 --batch 64 --epochs 50 --log-every 2 --timeout 5)
launched STOP 20 'rank 1 \(pid [0-9]+, stopped\) does not answer' "${common[@]}" "${long[@]}" \
  --out stopped
launched KILL 15 'rank 1 was killed by signal 9' "${common[@]}" "${long[@]}" --out killed

# more ranks than visible GPUs: refused before any rank starts
expect_fail 2 "gpus $((n + 1)): $((n + 1)) ranks, $n GPU\(s\) visible" \
  "$T" --db db --gpus $((n + 1)) --out toomany
expect_fail 2 "gpus 0,$n: GPU $n is not visible" "$T" --db db --gpus 0,$n --out toomany
