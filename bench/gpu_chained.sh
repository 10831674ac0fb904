#!/usr/bin/env bash
# The chained topology with small requests: variants of deploy/serve_config.gpu-chained.yaml
# (or $CONFIG), each started once, then loaded with one-image requests and with requests of
# 32, every load spread over $CONNECTIONS connections from two load-generator processes (the
# ingress replicas share the port; each connection lands on one of them):
#   VARIANTS="shipped i=1,p=1,log=1" bash bench/gpu_chained.sh   (against the config before 2n)
# A variant is a comma-separated list of changes ("shipped": none):
#   i=N   N Ingress replicas (num_cpus 0.25 each)
#   p=N   N Postprocess replicas
#   log=0|1 Serve's access log (one line per handle call in every deployment) off or on
# `top` is sampled during each variant's one-image load. Logs and bench.json files go to
# $LOGS (default $OUT/chained), named by the variant with "=" and "," as "-" and "_" (names
# the device copies back); the table is printed last.
set -u
if [ -f bench/gpu_env.sh ] && command -v nvidia-smi > /dev/null; then source bench/gpu_env.sh; fi
OUT=${OUT:-/tmp/out}
export LOGS=${LOGS:-$OUT/chained} DURATION=${DURATION:-12} PORT=${PORT:-9000}
CONFIG=${CONFIG:-deploy/serve_config.gpu-chained.yaml} CONNECTIONS=${CONNECTIONS:-8}
mkdir -p "$LOGS"
[ -x .venv/bin/raystream ] && export PATH=$PWD/.venv/bin:$PATH
timeout 150 raystream export --repository models --if-missing 2>&1 | tail -1

variant_config() {  # variant_config VARIANT PATH: the config with VARIANT's changes
  python3 - "$CONFIG" "$1" "$2" "$PORT" <<'PY'
import sys, yaml
source, variant, path, port = sys.argv[1:]
config = yaml.safe_load(open(source))
app = config["applications"][0]
app["args"]["port"] = int(port)
deployments = {d["name"]: d for d in app["deployments"]}
for change in filter(None, variant.replace("shipped", "").split(",")):
    key, _, value = change.partition("=")
    if key == "i":
        ingress = deployments.setdefault("Ingress", {"name": "Ingress"})
        ingress["num_replicas"] = int(value)
        ingress.setdefault("ray_actor_options", {})["num_cpus"] = 0.25
    elif key == "p":
        deployments.setdefault("Postprocess", {"name": "Postprocess"})["num_replicas"] = int(value)
    elif key == "log":
        app["logging_config"] = {"enable_access_log": value != "0"}
    else:
        sys.exit(f"unknown change {change!r}")
app["deployments"] = list(deployments.values())
yaml.safe_dump(config, open(path, "w"), sort_keys=False)
PY
}

tag_of() { echo "$1" | tr '=,' '-_'; }  # a variant as a file name the device copies back

load() {  # load VARIANT LABEL BENCH_ARGS...
  local variant=$1 label=$2 tag; shift 2
  tag=$(tag_of "$variant")
  timeout 120 raystream bench --server "127.0.0.1:$PORT" --connections "$CONNECTIONS" \
    --processes 2 --duration "$DURATION" --out "$LOGS/$tag.$label" "$@" 2>&1 \
    | grep -v INFO > "$LOGS/$tag.$label.txt"
  grep "img/s" "$LOGS/$tag.$label.txt" | sed "s/^ */$variant $label: /"
}

for variant in ${VARIANTS:-shipped}; do
  tag=$(tag_of "$variant")
  variant_config "$variant" "$LOGS/$tag.yaml" || exit 1
  raystream serve --config "$LOGS/$tag.yaml" > "$LOGS/$tag.serve.log" 2>&1 &
  pid=$!
  for i in $(seq 240); do grep -q "raystream ready" "$LOGS/$tag.serve.log" && break; sleep 1; done
  grep -q "raystream ready" "$LOGS/$tag.serve.log" || { tail -30 "$LOGS/$tag.serve.log"; exit 1; }
  sleep 5  # a pause after the ready line (every replica is up by then), as in 2n's runs
  (sleep $((DURATION / 2 + 6)); top -b -c -d 2 -n 2 -w 160 | awk '/^top/{n++} n==2' | head -30 \
    > "$LOGS/$tag.top.txt") &
  load "$variant" one --streams 8 --in-flight 8 --batch-size 1
  wait $!
  load "$variant" b32 --streams 8 --in-flight 4 --batch-size 32
  kill -INT $pid; wait $pid
done

python3 - "$LOGS" ${VARIANTS:-shipped} <<'PY'
import json, pathlib, sys
logs, variants = pathlib.Path(sys.argv[1]), sys.argv[2:]
print("| variant | load | img/s | p50 / p99 ms | server mean ms: total / preprocess / inference | batch |")
print("|---|---|---|---|---|---|")
def tag(variant):
    return variant.replace("=", "-").replace(",", "_")
for v in variants:
    for label, name in (("one", "8 x 8 one-image"), ("b32", "8 x 4 x 32 images")):
        path = logs / f"{tag(v)}.{label}" / "bench.json"
        if not path.exists():
            print(f"| {v} | {name} | (no report) | | | |")
            continue
        r = json.loads(path.read_text())["reports"][0]
        s, lat = r["server_ms"], r["latency_ms"]
        print(f"| {v} | {name} | {r['images_per_s']:,.0f} | {lat['p50']:.1f} / {lat['p99']:.1f} | "
              f"{s.get('total_ms', 0):.1f} / {s.get('preprocess_ms', 0):.1f} / "
              f"{s.get('inference_ms', 0):.1f} | {r['mean_batch_size']:.1f} |")
for v in variants:
    top = logs / f"{tag(v)}.top.txt"
    if top.exists():
        print(f"\n{v}, top during the one-image load:")
        print("\n".join(line for line in top.read_text().splitlines()[6:16]))
PY
