#!/usr/bin/env bash
# Latency at half of issue 5's 10,000 img/s against the request size, on the shipped direct
# GPU config, every load spread over a connection to each of its eight replicas
# (`raystream bench --spread`, as Client(address, connections=8) sends):
#   bash bench/gpu_mps.sh bash bench/gpu_request_sizes.sh
# Open loop (Poisson), 5,000 img/s in requests of each of $SIZES images (default 32 16 8 4
# 1); one load-generator process up to 8 images a request, more below (one Python process
# sends a few thousand requests/s at most). DECODE="4 1" starts the server once per value
# of user_config's decode_concurrency (nvJPEG calls at once per replica; default 4) and
# runs every size against each. Logs and bench.json files go to $LOGS (default
# $OUT/sizes); the table is printed last.
source bench/gpu_env.sh
export LOGS=${LOGS:-$OUT/sizes} DURATION=${DURATION:-10}
export SIZES=${SIZES:-32 16 8 4 1} DECODE=${DECODE:-4}
mkdir -p "$LOGS"
timeout 150 raystream export --repository models --if-missing 2>&1 | tail -1

load() {  # load NAME IMAGES_PER_REQUEST [SECONDS]
  local b=$2 p=1
  [ "$b" -lt 8 ] && p=$(( 8 / b ))
  timeout 90 raystream bench --batch-size "$b" --rate "$(python3 -c "print(5000 / $b)")" \
    --streams "$p" --processes "$p" --connections 8 --spread --duration "${3:-$DURATION}" \
    --out "$LOGS/$1" 2>&1 | grep -v INFO > "$LOGS/$1.txt"
}

for d in $DECODE; do
  python3 - "$d" <<'PY'
import sys, yaml
config = yaml.safe_load(open("deploy/serve_config.gpu-direct.yaml"))
ingress = next(d for d in config["applications"][0]["deployments"] if d["name"] == "Ingress")
ingress["user_config"]["decode_concurrency"] = int(sys.argv[1])
yaml.safe_dump(config, open(f"/tmp/direct-d{sys.argv[1]}.yaml", "w"))
PY
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} raystream serve \
    --config "/tmp/direct-d$d.yaml" > "$LOGS/d$d.serve.log" 2>&1 &
  pid=$! started=$SECONDS
  for i in $(seq 300); do
    grep -q "raystream ready" "$LOGS/d$d.serve.log" && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  grep "raystream ready" "$LOGS/d$d.serve.log" || { tail -30 "$LOGS/d$d.serve.log"; exit 1; }
  echo "decode_concurrency $d: ready after $((SECONDS - started)) s"
  load "d$d-b32" 32 5  # warm-up, overwritten below when 32 is among the sizes
  for b in $SIZES; do load "d$d-b$b" "$b"; done
  kill -INT $pid; sleep 8
  python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
done

python3 - <<'PY'
import json, os
logs = os.environ["LOGS"]
print("decode calls  images/request  served img/s  p50 ms  p99 ms  server ms: total / decode / engine  batch")
for d in os.environ["DECODE"].split():
    for b in map(int, os.environ["SIZES"].split()):
        path = f"{logs}/d{d}-b{b}/bench.json"
        if not os.path.exists(path):
            print(f"{d:>12}  {b:>14}  no report")
            continue
        r = json.load(open(path))["reports"][0]
        lat, s = r["latency_ms"], r["server_ms"]
        print(f"{d:>12}  {b:>14}  {r['images_per_s']:12.0f}  {lat['p50']:6.1f}  {lat['p99']:6.1f}"
              f"  {s.get('total_ms', 0):6.1f} / {s.get('preprocess_ms', 0):5.1f} / {s.get('inference_ms', 0):4.1f}"
              f"  {r['mean_batch_size']:5.1f}  errors {r['errors'] or 0}")
PY
