#!/usr/bin/env bash
# Replica layouts on one and two GPUs (issues 3 and 5), for the two-GPU H200 machine:
#   bash bench/gpu_multi.sh C2 C4 D4 D8
# Each variant starts raystream from deploy/serve_config.gpu.yaml (fused, nvJPEG decode in the
# inference replicas, torch-CUDA FP16) with its own replica layout and GPU visibility, runs the
# same saturating load from $PROCS load-generator processes, with one connection to each
# ingress replica in turn (the load generator looks for them: `ingress` in the table says how
# many it reached), stops, and appends one row to $LOGS/table.txt:
#   A  1 GPU : 1 ingress, 1 inference replica x 1 GPU
#   B  2 GPUs: 1 ingress, 2 inference replicas x 1 GPU (one per GPU)
#   C2 1 GPU : 2 ingress replicas (one port, SO_REUSEPORT), 2 inference replicas x 0.5 GPU
#   C4 1 GPU : 4 ingress replicas, 4 inference replicas x 0.25 GPU
#   D4 2 GPUs: 4 ingress replicas, 4 inference replicas x 0.5 GPU  (C2 on each GPU)
#   D8 2 GPUs: 8 ingress replicas, 8 inference replicas x 0.25 GPU (C4 on each GPU)
#   C4i 1 GPU : 4 ingress replicas, 2 inference replicas x 0.5 GPU (C2 with twice the front)
#   D8i 2 GPUs: 8 ingress replicas, 4 inference replicas x 0.5 GPU (C4i on each GPU)
#   C6 1 GPU : 4 ingress replicas, 6 inference replicas x 0.16 GPU (more decoding processes)
#   C4c 1 GPU: C4 with the engine's graphs torch.compile'd from batch 32 up (C2c: C2 with it)
#   E2 1 GPU : topology direct, 2 ingress replicas x 0.5 GPU, each with its own engine
#   E4c 1 GPU: topology direct, 4 replicas x 0.25 GPU, engine compiled as in C4c
#   E8c 1 GPU: topology direct, 8 replicas x 0.125 GPU, engine compiled
#   E8s 1 GPU: E8c with raystream on a second event loop in a second thread, Serve's
#              default (E8c runs it on Serve's own loop: serve_app/app.py DIRECT_REPLICA_ENV)
# PROFILE="C4" samples one ingress and one inference replica of those variants with py-spy
# (carry .whl with the py-spy wheel) and LATENCY="C4" adds, for those variants, open-loop
# Poisson load at half the best saturated request rate and one-image requests one at a time;
# HALF_BATCHES="8 1" adds open-loop loads of 5,000 img/s (half of issue 5's 10,000) in
# requests of that many images.
# ONE_STREAM="E8c C4c" adds, for those variants, one stream from one process (16 requests
# of 32 in flight), as a client with one long-lived stream sends; for topology direct, also
# that stream spread over a connection to each ingress replica (`raystream bench --spread`).
# IN_FLIGHT="4 8": the closed-loop loads (requests in flight per stream) each variant runs.
# The table's gpu% is each busy GPU's mean utilization (nvidia-smi, every 0.5 s) during the
# load. Logs go to $LOGS (default $OUT/logs); the table is printed last.
# MAX_BATCH=64: the engine's and the batcher's largest batch (default: the config's 256).
# Under CUDA MPS: bash bench/gpu_mps.sh bash bench/gpu_multi.sh C4
# NO_GPU_ENV=1 BASE_CONFIG=deploy/serve_config.yaml: a smoke run on a CPU box (own venv).
[ -n "${NO_GPU_ENV:-}" ] || source bench/gpu_env.sh
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
export LOGS=${LOGS:-$OUT/logs} PROCS=${PROCS:-4} DURATION=${DURATION:-20}
PROFILE=${PROFILE:-} LATENCY=${LATENCY:-} IN_FLIGHT=${IN_FLIGHT:-4 8}
mkdir -p "$LOGS"
nvidia-smi -L | tee "$LOGS/gpus.txt"
nproc >> "$LOGS/gpus.txt"
timeout 150 raystream export --repository models --if-missing 2>&1 | tail -1

gpu_busy() {  # sample each GPU's utilization while the load runs (it starts after ~8 s)
  sleep 9
  timeout $((DURATION - 3)) nvidia-smi --query-gpu=index,utilization.gpu \
    --format=csv,noheader,nounits -lms 500 > "$LOGS/$1.util.txt"
}

bench() {  # bench NAME ARGS...: one load, its line into the table
  local name=$1; shift
  gpu_busy "$name" & local sampler=$!
  timeout 120 raystream bench --batch-size 32 --processes "$PROCS" --out "$LOGS/$name" "$@" \
    2>&1 | grep -v INFO | tee "$LOGS/$name.bench.txt"
  wait "$sampler"
  python3 - "$name" "$*" >> "$LOGS/table.txt" <<'PY'
import collections, json, os, sys
name, args = sys.argv[1:]
path = f"{os.environ['LOGS']}/{name}/bench.json"
if not os.path.exists(path):  # cut by its timeout (an overload that never drains, say)
    sys.exit(print(f"{name:<10} no report: the load generator did not finish  [{args}]"))
r = json.load(open(path))["reports"][0]
lat = r["latency_ms"]
busy = collections.defaultdict(list)
for line in open(f"{os.environ['LOGS']}/{name}.util.txt"):
    index, percent = line.split(",")
    busy[index.strip()].append(float(percent))
used = "/".join(f"{sum(v) / len(v):.0f}" for v in busy.values() if max(v) > 0) or "-"
print(f"{name:<10} {r['images_per_s']:8.1f} img/s p50 {lat['p50']:7.1f} p99 {lat['p99']:7.1f} "
      f"ms batch {r['mean_batch_size']:5.1f} errors {r['errors'] or 0} "
      f"ingress {r['offered'].get('ingress_replicas')} gpu% {used}  [{args}]")
PY
}

profile() {  # py-spy a replica of each kind mid-load (raw stacks; bench/profile_summary.py)
  local name=$1 pid
  sleep 14  # the load generator's processes start sending after about 8 s
  top -b -c -d 2 -n 2 -w 250 | awk '/^top -/ {n++} n == 2'  | head -45 > "$LOGS/$name.top.txt"
  for role in Ingress Inference; do
    pid=$(pgrep -f "ServeReplica:raystream:$role" | head -1)
    [ -n "$pid" ] && py-spy record --pid "$pid" --duration 8 --rate 100 --nonblocking \
      --format raw --output "$LOGS/$name.$role.pyspy.txt" > /dev/null 2>&1 &
  done
  wait
}

variant() {
  local name=$1 visible=$2 ingress=$3 replicas=$4 gpus=$5
  ENGINE_OPTIONS=${ENGINE_OPTIONS:-} python3 - "$name" "$ingress" "$replicas" "$gpus" <<'PY'
import json, os, sys, yaml
name, ingress, replicas, gpus = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
config = yaml.safe_load(open(os.environ.get("BASE_CONFIG", "deploy/serve_config.gpu.yaml")))
app = config["applications"][0]
# Calls small enough to spread over the replicas, enough of them to keep each one busy.
app["args"].update(requests_per_call=8, max_calls_in_flight=4 * replicas)
app["args"]["engine"].setdefault("options", {}).update(json.loads(os.environ["ENGINE_OPTIONS"] or "{}"))
max_batch = int(os.environ.get("MAX_BATCH", 0))  # fewer graphs (and compiles) to start
if max_batch:
    app["args"]["engine"]["max_batch_size"] = max_batch
for d in app["deployments"]:
    if d["name"] == "Ingress":
        d["num_replicas"] = ingress
        # logical CPUs: 8 ingress + 8 inference replicas fit the 32 cores
        d["ray_actor_options"]["num_cpus"] = float(os.environ.get("REPLICA_CPUS", 2))
    if d["name"] == "Inference":
        d["num_replicas"] = replicas
        d["ray_actor_options"].update(
            num_gpus=gpus, num_cpus=float(os.environ.get("REPLICA_CPUS", 2))
        )
        if max_batch:
            d["user_config"]["max_batch_size"] = max_batch
if os.environ.get("SEPARATE_THREAD"):  # raystream serve keeps a value the config sets
    app["runtime_env"] = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}}
yaml.safe_dump(config, open(f"/tmp/{name}.yaml", "w"))
PY
  CUDA_VISIBLE_DEVICES=$visible raystream serve --config /tmp/$name.yaml ${SERVE_ARGS:-} \
    > "$LOGS/$name.serve.log" 2>&1 &
  local pid=$! started=$SECONDS
  for i in $(seq 240); do
    grep -q "raystream ready" "$LOGS/$name.serve.log" && break
    kill -0 $pid 2>/dev/null || break  # it exited: no point waiting
    sleep 1
  done
  if grep -q "raystream ready" "$LOGS/$name.serve.log"; then
    echo "$name ready after $((SECONDS - started)) s" | tee -a "$LOGS/table.txt"
    local profiler=
    [[ " $PROFILE " == *" $name "* ]] && { profile "$name" & profiler=$!; }
    local best=0 flight
    for flight in $IN_FLIGHT; do  # closed loop: 16 streams x this many requests of 32 images
      bench "$name-f$flight" --streams 16 --in-flight "$flight" --duration "$DURATION" \
        --connections "$ingress"
      best=$(python3 -c "import json; r=json.load(open('$LOGS/$name-f$flight/bench.json'))['reports'][0]; print(max($best, r['requests_per_s']))")
    done
    [ -n "$profiler" ] && wait "$profiler"
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv > "$LOGS/$name.smi.txt"
    if [[ " $LATENCY " == *" $name "* ]]; then
      local rate
      rate=$(python3 -c "print($best / 2)")  # half the best saturated request rate
      bench "$name-half" --streams 16 --rate "$rate" --duration "$DURATION" --connections "$ingress"
      local b  # the issue's half load: 5,000 img/s, in requests of $b images
      for b in ${HALF_BATCHES:-}; do
        bench "$name-5k-b$b" --streams 16 --rate "$(python3 -c "print(5000 / $b)")" \
          --batch-size "$b" --duration "$DURATION" --connections "$ingress"
      done
      PROCS=1 bench "$name-low" --streams 1 --in-flight 1 --batch-size 1 --duration 10
    fi
    if [[ " ${ONE_STREAM:-} " == *" $name "* ]]; then
      PROCS=1 bench "$name-one" --streams 1 --in-flight 16 --duration "$DURATION"
      [[ "${SERVE_ARGS:-}" == *direct* ]] && PROCS=1 bench "$name-spread" --streams 1 \
        --in-flight 16 --duration "$DURATION" --connections "$ingress" --spread
    fi
  else
    echo "$name did not start"; tail -40 "$LOGS/$name.serve.log"
  fi
  kill -INT $pid; sleep 5
  python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
  for i in $(seq 60); do (echo > /dev/tcp/127.0.0.1/9000) 2>/dev/null || break; sleep 1; done
  (echo > /dev/tcp/127.0.0.1/9000) 2>/dev/null && { echo "port 9000 still served: stopping"; exit 1; }
}

for v in "$@"; do
  case $v in
    A) variant A 0 1 1 1 ;;
    B) variant B 0,1 1 2 1 ;;
    C2) variant C2 0 2 2 0.5 ;;
    C4) variant C4 0 4 4 0.25 ;;
    D4) variant D4 0,1 4 4 0.5 ;;
    D8) variant D8 0,1 8 8 0.25 ;;
    C4i) variant C4i 0 4 2 0.5 ;;
    D8i) variant D8i 0,1 8 4 0.5 ;;
    C6) variant C6 0 4 6 0.16 ;;
    C4c) ENGINE_OPTIONS='{"compile_min_batch": 32}' variant C4c 0 4 4 0.25 ;;  # torch.compile
    C2c) ENGINE_OPTIONS='{"compile_min_batch": 32}' variant C2c 0 2 2 0.5 ;;
    E2) SERVE_ARGS="--topology direct" variant E2 0 2 2 0.5 ;;  # C2's GPUs, no Ray hop
    E4c) SERVE_ARGS="--topology direct" ENGINE_OPTIONS='{"compile_min_batch": 32}' \
      variant E4c 0 4 4 0.25 ;;
    E8c) SERVE_ARGS="--topology direct" ENGINE_OPTIONS='{"compile_min_batch": 32}' \
      variant E8c 0 8 8 0.125 ;;
    E8s) SEPARATE_THREAD=1 SERVE_ARGS="--topology direct" \
      ENGINE_OPTIONS='{"compile_min_batch": 32}' variant E8s 0 8 8 0.125 ;;
    S) REPLICA_CPUS=${REPLICA_CPUS:-0.25} variant S "" 2 1 0 ;;  # a CPU box: 2 logical CPUs
    *) echo "unknown variant $v" ;;
  esac
done
echo "== table"; cat "$LOGS/table.txt"
