#!/usr/bin/env bash
# Superseded by gpu.yaml's open-5k load; kept while docs/performance.md runs it.
# Latency at half of issue 5's 10,000 img/s against the request size, on the shipped direct
# GPU config and variants of it, every load spread over a connection to each replica
# (`raystream bench --spread`, as Client(address, connections=N) sends):
#   bash bench/gpu_mps.sh bash bench/gpu_request_sizes.sh
# Open loop (Poisson), 5,000 img/s in requests of each of $SIZES images (default 32 16 8 4
# 1); one load-generator process up to 8 images a request, more below (one Python process
# sends a few thousand requests/s at most). VARIANTS starts the server once per variant, a
# comma-separated list of changes to deploy/serve_config.gpu-direct.yaml ("shipped": none):
#   d=N  user_config's decode_concurrency (nvJPEG calls at once per replica; shipped 4)
#   r=N  N replicas, each 1/N of the GPU and 16/N CPUs for Ray's accounting (shipped 16)
#   c=N  the engine's graphs torch.compile'd from batch N up (shipped 8)
#   b=0|1 the engine's blocking_sync option: every GPU wait in a replica sleeps (1,
#        shipped) or CUDA's default, spinning a core in the waits outside raystream's own
#        code (0)
#   base the server from another checkout of the code, $BASE (default build/base: e.g.
#        `git archive <commit> | tar -x -C build/base`, carried to the GPU machine), with
#        the same load generator: an A/B of a code change in one lease
# e.g. VARIANTS="d=1 d=1,r=16 d=1,c=8"; DECODE="4 1" is short for VARIANTS="d=4 d=1".
# A size listed twice runs twice; "8@6000" sends 6,000 img/s instead of 5,000, "8p2" (or
# "8@6000p2") sends from two load-generator processes, and a trailing "o" ("8o", "8@6000p2o")
# sends from $BASE's load generator (an A/B of the client in one lease). "u:KEY=VALUE,..."
# in SIZES changes the running server's batching user_config (`raystream reconfigure`, no
# restart: each change starts from the variant's config) for the loads after it, whose
# variant column then ends in "+KEY=VALUE,...". "nice:N" sets every replica thread's niceness
# to N (Ray starts workers at 15, below the load generator's 0) for the loads after it, their
# variant column ending in "+nice=N". "waits" prints the batch wait each replica uses now
# (Ingress.batching's wait_s, which the adaptive mode moves), from 48 handle calls.
# PROFILE=LABEL (e.g. "8@7622") samples one replica with py-spy (where on PATH: carry .whl
# with its wheel) during the loads of that label, and takes a `top` of the machine:
# $LOGS/RUN.pyspy.txt and RUN.top.txt.
# SATURATE=1 adds, per variant, the saturating closed loop (16 streams x 16 requests of 32 in
# flight from 8 processes, spread over every replica), twice, the first as warm-up. Logs and
# bench.json files go to $LOGS (default $OUT/sizes); the table is printed last.
source bench/gpu_env.sh
export LOGS=${LOGS:-$OUT/sizes} DURATION=${DURATION:-10}
export SIZES=${SIZES:-32 16 8 4 1}
[ -n "${DECODE:-}" ] && VARIANTS=$(for d in $DECODE; do printf 'd=%s ' "$d"; done)
export VARIANTS=${VARIANTS:-shipped}
mkdir -p "$LOGS"
timeout 150 raystream export --repository models --if-missing 2>&1 | tail -1

run=0
load() {  # load VARIANT LABEL BENCH_ARGS...: one load, listed in $LOGS/runs.txt for the table
  local variant=$1 label=$2; shift 2
  run=$((run + 1))
  [ "$label" = "${PROFILE:-}" ] && profile "$LOGS/$run" &
  (cd "${CLIENT:-.}" && PYTHONPATH="/tmp/site:$PWD:$PWD/protos" timeout 90 raystream bench \
    --spread --duration "$DURATION" --out "$LOGS/$run" "$@") 2>&1 \
    | grep -v INFO | tee "$LOGS/$run.txt" | grep "img/s" | sed "s/^ */$run $variant $label: /"
  echo "$run $variant $label" >> "$LOGS/runs.txt"
}

renice_replicas() {  # renice_replicas N: every thread of every replica to niceness N
  python3 - "$1" $(pgrep -f ServeReplica:raystream) <<'PY'
import os, sys
niceness, pids = int(sys.argv[1]), sys.argv[2:]
threads = [int(t) for pid in pids for t in os.listdir(f"/proc/{pid}/task")]
for tid in threads:
    os.setpriority(os.PRIO_PROCESS, tid, niceness)
print(f"{len(pids)} replicas, {len(threads)} threads: niceness {niceness}")
PY
}

batch_waits() {  # the batch wait in force, as replicas report it (48 calls, spread by Serve)
  RAY_AUTH_MODE=token python3 - <<'PY' 2>&1 | tail -1
import ray
from ray import serve
ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
ingress = serve.get_deployment_handle("Ingress", app_name="raystream")
waits = sorted(ingress.batching.remote().result()["wait_s"] * 1000 for _ in range(48))
print(f"batch waits now, ms over 48 calls: min {waits[0]:.2f} median {waits[24]:.2f} max {waits[-1]:.2f}")
PY
}

profile() {  # profile PATH_PREFIX: mid-load (sending starts after a few seconds)
  sleep 6
  command -v py-spy > /dev/null && py-spy record --pid "$(pgrep -f ServeReplica:raystream:Ingress | head -1)" --duration 5 \
    --rate 200 --nonblocking --format raw --output "$1.pyspy.txt" > /dev/null 2>&1 &
  top -b -c -d 2 -n 2 -w 250 | awk '/^top -/ {n++} n == 2' | head -45 > "$1.top.txt"
  wait
}

half() {  # half VARIANT LABEL IMAGES_PER_REQUEST[@IMG_PER_S][pPROCESSES][o] CONNECTIONS
  local token=${3%o} b rate=5000 p=1 client=.
  [[ $3 == *o ]] && client=$(realpath "${BASE:-build/base}")
  b=${token%p*}
  b=${b%@*}
  [[ ${token%p*} == *@* ]] && rate=${token#*@} && rate=${rate%p*}
  [ "$b" -lt 8 ] && p=$(( 8 / b ))
  [[ $token == *p* ]] && p=${token#*p}
  CLIENT=$client load "$1" "$2" --batch-size "$b" --rate "$(python3 -c "print($rate / $b)")" \
    --streams "$p" --processes "$p" --connections "$4"
}

for v in $VARIANTS; do
  name=${v//[=,]/}
  replicas=$(python3 - "$v" "/tmp/direct-$name.yaml" <<'PY'
import sys, yaml
changes = dict(c.split("=") for c in sys.argv[1].split(",") if "=" in c)
config = yaml.safe_load(open("deploy/serve_config.gpu-direct.yaml"))
app = config["applications"][0]
ingress = next(d for d in app["deployments"] if d["name"] == "Ingress")
if "d" in changes:
    ingress["user_config"]["decode_concurrency"] = int(changes["d"])
if "r" in changes:
    n = int(changes["r"])
    ingress["num_replicas"] = n
    ingress["ray_actor_options"].update(num_gpus=1 / n, num_cpus=max(1, 16 // n))
if "c" in changes:
    app["args"]["engine"]["options"]["compile_min_batch"] = int(changes["c"])
if "b" in changes:
    app["args"]["engine"]["options"]["blocking_sync"] = changes["b"] == "1"
yaml.safe_dump(config, open(sys.argv[2], "w"))
print(ingress["num_replicas"])
PY
)
  code=$PWD
  if [[ ,$v, == *,base,* ]]; then
    code=$(realpath "${BASE:-build/base}")
    [ -e "$code/models" ] || ln -sfn "$PWD/models" "$code/models"
  fi
  (cd "$code" && exec env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" \
    PYTHONPATH="/tmp/site:$code:$code/protos" raystream serve \
    --config "/tmp/direct-$name.yaml" > "$LOGS/$name.serve.log" 2>&1) &
  pid=$! started=$SECONDS
  for i in $(seq 400); do
    grep -q "raystream ready" "$LOGS/$name.serve.log" && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  grep "raystream ready" "$LOGS/$name.serve.log" || { tail -30 "$LOGS/$name.serve.log"; exit 1; }
  echo "$v ($replicas replicas): ready after $((SECONDS - started)) s"
  half "$v" warm-up 32 "$replicas"
  changed= niced=
  for b in $SIZES; do
    if [[ $b == u:* ]]; then
      changed=${b#u:}
      raystream reconfigure --config "/tmp/direct-$name.yaml" ${changed//,/ } 2>&1 | tail -1
    elif [[ $b == waits ]]; then
      batch_waits
    elif [[ $b == nice:* ]]; then
      niced=${b#nice:}
      renice_replicas "$niced"
    else
      half "$v${changed:++$changed}${niced:++nice=$niced}" "$b" "$b" "$replicas"
    fi
  done
  for label in ${SATURATE:+warm-up saturated}; do
    load "$v" "$label" --batch-size 32 --streams 16 --in-flight 16 --processes 8 \
      --connections "$replicas"
  done
  kill -INT $pid; sleep 8
  python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
done

python3 - <<'PY'
import json, os
logs = os.environ["LOGS"]
print("variant        images/request  served img/s  p50 ms  p99 ms  server p99  server ms: total / decode / queue / engine  batch")
for line in open(f"{logs}/runs.txt"):
    run, variant, label = line.split()
    if label == "warm-up":
        continue
    path = f"{logs}/{run}/bench.json"
    if not os.path.exists(path):
        print(f"{variant:<14}  {label:>14}  no report")
        continue
    r = json.load(open(path))["reports"][0]
    lat, s = r["latency_ms"], r["server_ms"]
    server_p99 = r.get("server_total_ms", {}).get("p99", 0)
    print(f"{variant:<14}  {label:>14}  {r['images_per_s']:12.0f}  {lat['p50']:6.1f}  {lat['p99']:6.1f}  {server_p99:10.1f}"
          f"  {s.get('total_ms', 0):6.1f} / {s.get('preprocess_ms', 0):5.1f} / {s.get('queue_ms', 0):5.2f} / {s.get('inference_ms', 0):4.1f}"
          f"  {r['mean_batch_size']:5.1f}  errors {r['errors'] or 0}")
PY
