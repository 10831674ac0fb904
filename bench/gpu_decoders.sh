#!/usr/bin/env bash
# GPU run: the GPU decode tests, then the GPU JPEG decoders (torchvision's nvJPEG,
# nvImageCodec) with CUDA's waits spinning or asleep, measured side by side
# (bench/gpu_jpeg_decoders.py; its arguments follow this script's). Needs .gpu/site.tar.xz and
# .gpu/nvimgcodec.tar.xz (bench/make_nvimgcodec_bundle.sh), and pytest-asyncio's wheel in
# .whl for the tests. Logs under $OUT; the decoder table is printed last.
source bench/gpu_env.sh
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
nvidia-smi -L
python3 -c "from nvidia import nvimgcodec; print('nvimgcodec', nvimgcodec.__version__)" 2>&1 \
  | grep -v -e nvjpeg2k -e nvtiff -e nvJPEG2000 -e nvTIFF
timeout 150 raystream export --repository models --if-missing 2>&1 | tail -1
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_gpu_decode.py \
  tests/test_engines.py::test_blocking_sync_puts_every_gpu_wait_of_the_process_to_sleep \
  2>&1 | tee "$OUT/gpu_decode_tests.txt" | tail -6
timeout 300 python3 bench/gpu_jpeg_decoders.py --repository models "$@" 2>&1 \
  | grep -v -e nvjpeg2k -e nvtiff -e nvJPEG2000 -e nvTIFF | tee "$OUT/gpu_jpeg_decoders.txt"
