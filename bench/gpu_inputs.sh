#!/usr/bin/env bash
# The GPU direct config (deploy/serve_config.gpu-direct.yaml, or $CONFIG) on every input
# path: bench/input_paths.py (the same winners from JPEG bytes, client-made float32
# `pixels`, and the Open Inference Protocol; bad input refused alone), then the saturating
# load in requests of 8 as JPEG bytes and as `pixels`, spread over every replica:
#   bash bench/gpu_inputs.sh      (logs under $OUT/inputs)
# SERVE_ARGS go to `raystream serve` (e.g. "--decode cpu": PIL crops, as the client's own
# pixels are made; against nvJPEG's crops they moved one winner of seven, docs 2n);
# LOADS=0 skips the loads.
source bench/gpu_env.sh
LOGS=$OUT/inputs DURATION=${DURATION:-10}
mkdir -p "$LOGS"
timeout 150 raystream export --repository models --if-missing 2>&1 | tail -1
raystream serve --config "${CONFIG:-deploy/serve_config.gpu-direct.yaml}" ${SERVE_ARGS:-} > "$LOGS/serve.log" 2>&1 &
for i in $(seq 300); do grep -q "raystream ready" "$LOGS/serve.log" && break; sleep 1; done
grep -q "raystream ready" "$LOGS/serve.log" || { tail -30 "$LOGS/serve.log"; exit 1; }
sleep 20  # a pause after the ready line (every replica is up by then), as in 2n's runs
timeout 120 python3 bench/input_paths.py --server 127.0.0.1:9000 | tee "$LOGS/input_paths.txt"
LOAD="--streams 16 --in-flight 4 --batch-size 8 --spread --connections 16 --processes 8"
for kind in $([ "${LOADS:-1}" = 0 ] || echo images pixels images pixels); do
  extra=""; [ $kind = pixels ] && extra=--pixels
  timeout 120 raystream bench --server 127.0.0.1:9000 $LOAD --duration "$DURATION" $extra \
    --out "$LOGS/$kind" 2>&1 | grep -v INFO | grep "img/s" | sed "s/^ */$kind: /"
done
kill -INT %1; wait
