#!/usr/bin/env bash
# Kept: the soak is a pytest test (tests/integration/test_soak.py names this script), not a load.
# The soak of tests/integration/test_soak.py for longer: 3x capacity for RAYSTREAM_SOAK_S seconds
# (default 600), printing admitted/refused counts, latencies and memory at the end.
RAYSTREAM_SOAK_S=${RAYSTREAM_SOAK_S:-600} .venv/bin/python -m pytest -s -q tests/integration/test_soak.py \
  --timeout $(( ${RAYSTREAM_SOAK_S:-600} + 300 )) 2>&1 | grep -E "^soak|passed|failed|Error"
