#!/usr/bin/env bash
# Latency at half of issue 5's 10,000 img/s against the request size, on the shipped direct
# GPU config, every load spread over a connection to each of its eight replicas
# (`raystream bench --spread`, as Client(address, connections=8) sends):
#   bash bench/gpu_mps.sh bash bench/gpu_request_sizes.sh
# Open loop (Poisson), 5,000 img/s in requests of 32, 16, 8, 4 and 1 image(s); one
# load-generator process up to 8 images a request, more below (one Python process sends a
# few thousand requests/s at most). Logs and bench.json files go to $LOGS (default
# $OUT/sizes); the table is printed last.
source bench/gpu_env.sh
export LOGS=${LOGS:-$OUT/sizes} DURATION=${DURATION:-10}
mkdir -p "$LOGS"
timeout 150 raystream export --repository models --if-missing 2>&1 | tail -1
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} raystream serve \
  --config deploy/serve_config.gpu-direct.yaml > "$LOGS/serve.log" 2>&1 &
pid=$! started=$SECONDS
for i in $(seq 300); do
  grep -q "raystream ready" "$LOGS/serve.log" && break
  kill -0 $pid 2>/dev/null || break
  sleep 1
done
grep "raystream ready" "$LOGS/serve.log" || { tail -30 "$LOGS/serve.log"; exit 1; }
echo "ready after $((SECONDS - started)) s"

load() {  # load IMAGES_PER_REQUEST PROCESSES [SECONDS]
  local b=$1 p=$2
  timeout 90 raystream bench --batch-size "$b" --rate "$(python3 -c "print(5000 / $b)")" \
    --streams "$p" --processes "$p" --connections 8 --spread --duration "${3:-$DURATION}" \
    --out "$LOGS/b$b" 2>&1 | grep -v INFO > "$LOGS/b$b.txt"
}
load 32 1 5  # warm-up, overwritten below
load 32 1; load 16 1; load 8 1; load 4 2; load 1 8

kill -INT $pid; sleep 8
python3 - <<'PY'
import json, os
logs = os.environ["LOGS"]
print("images/request  offered req/s  served img/s  p50 ms  p99 ms  server ms: total / preprocess / engine  batch")
for b in (32, 16, 8, 4, 1):
    path = f"{logs}/b{b}/bench.json"
    if not os.path.exists(path):
        print(f"{b:>14}  no report")
        continue
    r = json.load(open(path))["reports"][0]
    lat, s = r["latency_ms"], r["server_ms"]
    print(f"{b:>14}  {5000 / b:13.0f}  {r['images_per_s']:12.0f}  {lat['p50']:6.1f}  {lat['p99']:6.1f}"
          f"  {s.get('total_ms', 0):6.1f} / {s.get('preprocess_ms', 0):5.1f} / {s.get('inference_ms', 0):4.1f}"
          f"  {r['mean_batch_size']:5.1f}  errors {r['errors'] or 0}")
PY
