#!/usr/bin/env bash
# Superseded by bench/scenarios/cpu.yaml; kept while docs/performance.md runs it.
# Issue 5's CPU-box targets, one command: for each topology (default: direct fused), start
# `raystream serve`, then measure in one run
#   low load   one stream, one image at a time (p50 against the engine's own time);
#   saturated  4 streams x 2 in flight x 8 images, encoded JPEGs (the server decodes);
#   pixels     the same load sending the model input (`--pixels`: no decode on the server),
# each saturated load with the in-process baseline of the same model at the same batch
# (decode + engine, engine alone on uint8 crops, engine alone on float32 input).
#   bash bench/cpu_serving.sh [TOPOLOGY...]      (logs and bench.json under $LOGS)
set -u
LOGS=${LOGS:-/tmp/cpu_serving} DURATION=${DURATION:-25} PORT=${PORT:-9100}
mkdir -p "$LOGS"
[ -x .venv/bin/raystream ] && export PATH=$PWD/.venv/bin:$PATH
SAT="--streams 4 --in-flight 2 --batch-size 8 --duration $DURATION --baseline --engine onnxruntime"
for t in ${*:-direct fused}; do
  raystream serve --port "$PORT" --topology "$t" ${SERVE_ARGS:-} > "$LOGS/$t.serve.log" 2>&1 &
  pid=$!
  for i in $(seq 120); do grep -q "raystream ready" "$LOGS/$t.serve.log" && break; sleep 1; done
  server="--server 127.0.0.1:$PORT"
  raystream bench $server --streams 1 --in-flight 1 --batch-size 1 --duration 15 \
    --out "$LOGS/$t-low" | grep -v INFO
  raystream bench $server $SAT --out "$LOGS/$t-images" | grep -v INFO
  raystream bench $server $SAT --pixels --out "$LOGS/$t-pixels" | grep -v INFO
  kill -TERM $pid; wait $pid  # SIGTERM: what docker stop and systemd send
done
python3 - "$LOGS" <<'PY'
import json, pathlib, sys
logs = pathlib.Path(sys.argv[1])
print("| topology | low p50 / p99 ms (server engine ms) | input | img/s | batch | / decode+engine | / engine uint8 | / engine fp32 |")
print("|---|---|---|---|---|---|---|---|")
for low in sorted(logs.glob("*-low/bench.json")):
    t = low.parent.name[: -len("-low")]
    r = json.loads(low.read_text())["reports"][0]
    lat = f"{r['latency_ms']['p50']:.1f} / {r['latency_ms']['p99']:.1f} ({r['server_ms']['inference_ms']:.1f})"
    for kind in ("images", "pixels"):
        path = logs / f"{t}-{kind}" / "bench.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        s, b = data["reports"][0], data["baseline"]
        ips = s["images_per_s"]
        print(f"| {t} | {lat} | {kind} | {ips:.1f} | {s['mean_batch_size']:.1f} | "
              f"{ips / b['decode_and_engine_images_per_s']:.2f} | "
              f"{ips / b['engine_images_per_s']:.2f} | {ips / b['engine_fp32_images_per_s']:.2f} |")
PY
