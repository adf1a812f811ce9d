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
expect_fail 2 "--stores 'bogus': expected stream or plain" "$B" --db db --device cpu --stores bogus
expect_fail 2 "--link only with --device cpu" "$B" --db db --link 4
expect_fail 2 "--link 'x': expected GB/s > 0" "$B" --db db --device cpu --link x
expect_fail 2 "--device 'tpu': expected cuda or cpu" "$B" --db db --device tpu
expect_fail 1 "nodb" "$B" --db nodb --device cpu --gemm 0
