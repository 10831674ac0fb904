#!/usr/bin/env bash
# Multi-GPU scaling on one host (issue 3), for the two-GPU H200 machine:
#   bash bench/gpu_multi.sh A B     then     bash bench/gpu_multi.sh C D
# Each variant starts raystream from deploy/serve_config.gpu.yaml (fused, nvJPEG decode in the
# inference replicas, torch-CUDA FP16) with its own replica layout and GPU visibility, runs the
# same saturating load, stops, and appends one row to $OUT/table.txt:
#   A  1 GPU : 1 ingress, 1 inference replica x 1 GPU
#   B  2 GPUs: 1 ingress, 2 inference replicas x 1 GPU (one per GPU)
#   C  1 GPU : 2 ingress replicas (one port, SO_REUSEPORT), 2 inference replicas x 0.5 GPU
#   D  2 GPUs: 2 ingress replicas, 4 inference replicas x 0.5 GPU
source bench/gpu_env.sh
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
nvidia-smi -L | tee "$OUT/gpus.txt"
timeout 150 raystream export --repository models --if-missing 2>&1 | tail -1

variant() {
  local name=$1 visible=$2 ingress=$3 replicas=$4 gpus=$5
  python3 - "$name" "$ingress" "$replicas" "$gpus" <<'PY'
import sys, yaml
name, ingress, replicas, gpus = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
config = yaml.safe_load(open("deploy/serve_config.gpu.yaml"))
app = config["applications"][0]
# Calls small enough to spread over the replicas, enough of them to keep each one busy.
app["args"].update(requests_per_call=8, max_calls_in_flight=4 * replicas)
for d in app["deployments"]:
    if d["name"] == "Ingress":
        d["num_replicas"] = ingress
    if d["name"] == "Inference":
        d["num_replicas"] = replicas
        d["ray_actor_options"]["num_gpus"] = gpus
yaml.safe_dump(config, open(f"/tmp/{name}.yaml", "w"))
PY
  CUDA_VISIBLE_DEVICES=$visible raystream serve --config /tmp/$name.yaml > "$OUT/$name.serve.log" 2>&1 &
  local pid=$!
  for i in $(seq 240); do
    grep -q "raystream ready" "$OUT/$name.serve.log" && break
    kill -0 $pid 2>/dev/null || break  # it exited: no point waiting
    sleep 1
  done
  if grep -q "raystream ready" "$OUT/$name.serve.log"; then
    echo "$name ready after ${i}s"
    timeout 100 raystream bench --streams 16 --in-flight 4 --batch-size 32 --duration 25 \
      --connections "$ingress" --out "$OUT/$name" 2>&1 | grep -v INFO | tee "$OUT/$name.bench.txt"
    python3 - "$name" "$visible" "$ingress" "$replicas" "$gpus" >> "$OUT/table.txt" <<'PY'
import json, sys
name, visible, ingress, replicas, gpus = sys.argv[1:]
r = json.load(open(f"{__import__('os').environ['OUT']}/{name}/bench.json"))["reports"][0]
print(f"{name} gpus={visible:<4} ingress={ingress} inference={replicas}x{gpus}gpu "
      f"{r['images_per_s']:8.1f} img/s p50 {r['latency_ms']['p50']:6.1f} p99 "
      f"{r['latency_ms']['p99']:6.1f} ms batch {r['mean_batch_size']:5.1f} errors {r['errors']}")
PY
  else
    echo "$name did not start"; tail -40 "$OUT/$name.serve.log"
  fi
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv > "$OUT/$name.smi.txt"
  kill -INT $pid; sleep 5
  python3 /tmp/site/bin/ray stop --force > /dev/null 2>&1
  for i in $(seq 60); do (echo > /dev/tcp/127.0.0.1/9000) 2>/dev/null || break; sleep 1; done
  (echo > /dev/tcp/127.0.0.1/9000) 2>/dev/null && { echo "port 9000 still served: stopping"; exit 1; }
}

for v in "$@"; do
  case $v in
    A) variant A 0 1 1 1 ;;
    B) variant B 0,1 1 2 1 ;;
    C) variant C 0 2 2 0.5 ;;
    D) variant D 0,1 2 4 0.5 ;;
  esac
done
echo "== table"; cat "$OUT/table.txt"
