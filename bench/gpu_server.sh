#!/usr/bin/env bash
# Superseded by bench/gpu_run.sh gpu.yaml; kept while docs/performance.md runs it.
# GPU run 2: the full server (fused topology, torch-CUDA engine) on this machine: classify
# the test photos through gRPC, then load-generate: saturated, and open-loop at half of it.
source bench/gpu_env.sh
timeout 120 raystream export --repository models --if-missing 2>&1 | tail -1
raystream serve --config ${CONFIG:-deploy/serve_config.gpu.yaml} ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
for i in $(seq 150); do grep -q "raystream ready" "$OUT/serve.log" && break; sleep 1; done
grep "raystream ready" "$OUT/serve.log" || { tail -50 "$OUT/serve.log"; exit 1; }
mkdir -p /tmp/photos && python3 - <<'PY'
from clients.loadgen import builtin_photos
for i, data in enumerate(builtin_photos()):
    open(f"/tmp/photos/photo{i}.jpg", "wb").write(data)
PY
raystream classify /tmp/photos --top-k 3 | tee "$OUT/classify.txt"
raystream info | tee -a "$OUT/classify.txt"
B=${BATCH:-32}
timeout 120 raystream bench --streams 8 --in-flight 4 --batch-size $B --duration 20 \
  --out "$OUT/saturated" 2>&1 | grep -v INFO | tee "$OUT/bench.txt"
RATE=$(python3 -c "import json; r=json.load(open('$OUT/saturated/bench.json'))['reports'][0]; print(r['requests_per_s']/2)")
timeout 120 raystream bench --streams 8 --rate $RATE --batch-size $B --duration 20 \
  --out "$OUT/half" 2>&1 | grep -v INFO | tee -a "$OUT/bench.txt"
timeout 60 raystream bench --streams 1 --in-flight 1 --batch-size 1 --duration 10 \
  --out "$OUT/low" 2>&1 | grep -v INFO | tee -a "$OUT/bench.txt"
timeout 120 raystream bench --batch-size $B --duration 10 --baseline --engine torch-cuda \
  --threads 12 --repository models --streams 8 --in-flight 4 2>&1 | grep -v INFO | tee -a "$OUT/bench.txt"
kill -INT %1; sleep 5
