#!/usr/bin/env bash
# gpu_bench's upload loop on the CPU backend (--device cpu, each copy as
# long as on a link of --link GB/s): the JSON scripts/gpu_check.sh reads,
# with every worker count, no upload faster than the link, plain stores into
# the ring by default on the CPU and streamed ones with --stores stream, and
# bad flags refused. The loop and its JSON otherwise run only on a lent GPU.
source "$STK_SRC/tests/e2e/lib.sh"
B="$STK_BIN/gpu_bench"
$PY "$STK_SRC/tests/e2e/make_folder.py" raw 600 48
"$STK_BIN/prep" --quiet --size 32 raw db
"$B" --db db --device cpu --link 4 --gemm 0 --workers 0,1,2 --batch 64 \
  --epochs 3 > out.json || fail "gpu_bench --device cpu"
cat out.json
$PY - <<'PY' || fail "gpu_bench's JSON"
import json
j = json.load(open("out.json"))
assert j["device"] == "cpu" and j["batch_bytes"] == 64 * 3 * 32 * 32, j
assert sorted(j["loader"]) == ["0", "1", "2"] == sorted(j["consumer"]), j
for w, gbs in j["loader"].items():
    assert 0 < gbs <= 4 * 1.001, (w, gbs)  # each copy lasts its time on the link
    c = j["consumer"][w]
    assert len(c) == 7 and all(0 <= x <= 1.001 for x in c[:6]) and c[6] >= 0, c
    assert c[1] <= c[0] + 1e-3, c  # waiting for data is part of next
assert all(0 < j[k] <= 4 * 1.001 for k in ("copy_gbs", "copy_ring_gbs", "copy_big_gbs")), j
assert j["ring"] == max(4, 2 * j["workers"]), j  # the best count's ring
best = max(j["loader"], key=lambda w: j["loader"][w])
assert j["loader_gbs"] == j["loader"][best] and str(j["workers"]) == best, j
assert abs(j["loader_share"] - j["loader_gbs"] / j["copy_gbs"]) < 2e-3, j
assert j["stores"] == "plain", j  # the CPU's default
print("ok: every worker count, uploads at most the link's 4 GB/s, the best one reported, plain stores")
PY
"$B" --db db --device cpu --gemm 0 --workers 0,2 --batch 64 --epochs 1 \
  --stores stream > stream.json || fail "gpu_bench --stores stream"
cat stream.json
$PY - <<'PY' || fail "gpu_bench --stores stream's JSON"
import json
j = json.load(open("stream.json"))
assert j["stores"] == "stream", j
assert sorted(j["loader"]) == ["0", "2"] and all(g > 0 for g in j["loader"].values()), j
print("ok: --stores stream is reported")
PY
# gpu_check.sh's report from the two runs and two training rows (one and
# two GPUs); without SGEMM (--gemm 0) the peak's share is n/a
row='{"samples_per_s": 1000.0, "stall": 0.005, "test_acc": 0.9}'
printf 'cnn 64 1 %s\ncnn 64 2 %s\n' "$row" "${row/1000.0/1900.0}" |
  $PY "$STK_SRC/scripts/gpu_report.py" stream.json out.json > report.md ||
  fail "gpu_report.py on the CPU runs"
# rounds (gpu_check.sh's): the target judged on the median streamed round;
# a failed round's empty file is skipped
for v in 85 70 95; do
  sed "s/\"loader_share\": [0-9.]*/\"loader_share\": 0.$v/" stream.json > s$v.json
done
: > failed.json
$PY "$STK_SRC/scripts/gpu_report.py" s85.json out.json failed.json s70.json s95.json \
  < /dev/null > rounds.md || fail "gpu_report.py with rounds"
cat rounds.md
cat report.md
$PY - <<'PY' || fail "gpu_report.py's report"
import json, re
r, s, p = open("report.md").read(), json.load(open("stream.json")), json.load(open("out.json"))
assert "stream stores" in r and "**%.2f GB/s**" % s["loader_gbs"] in r, r
assert "No SGEMM" in r and "with plain stores" in r, r
assert "%.2f GB/s at %d workers" % (p["loader_gbs"], p["workers"]) in r, r
rows = [l for l in r.splitlines() if l.startswith("| cnn ")]
assert len(rows) == 2 and "n/a" in rows[0] and rows[1].rstrip().endswith("| 1.90x |"), rows
print("ok: gpu_report.py reports both runs and the rows, n/a without SGEMM")
r, s, p = open("rounds.md").read(), json.load(open("stream.json")), json.load(open("out.json"))
assert "stream stores 85%, 70%, 95% (median 85%)" in r, r
assert "plain stores %.0f%% (median" % (100 * p["loader_share"]) in r, r
assert "met by the median round, 85%" in r and "**not met**" not in r, r
print("ok: gpu_report.py's rounds: each share by stores, the median judged")
PY
expect_fail 2 "--stores 'bogus': expected stream or plain" "$B" --db db --device cpu --stores bogus
expect_fail 2 "--link only with --device cpu" "$B" --db db --link 4
expect_fail 2 "--link 'x': expected GB/s > 0" "$B" --db db --device cpu --link x
expect_fail 2 "--device 'tpu': expected cuda or cpu" "$B" --db db --device tpu
expect_fail 2 "^gpu_bench: --workers: expected whole numbers 0..64 separated by single commas, such as 0,1,2,4, got '1,2,'\$" "$B" --db db --device cpu --workers 1,2,
expect_fail 2 "^gpu_bench: --workers: expected distinct counts, got '1,2,1'\$" "$B" --db db --device cpu --workers 1,2,1
expect_fail 1 "nodb" "$B" --db nodb --device cpu --gemm 0
