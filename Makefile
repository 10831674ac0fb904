# raystream: `make serve` sets up and starts the server; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODELS ?= models
CONFIG ?= deploy/serve_config.yaml
SERVE_ARGS ?=
STAMP := $(VENV)/.installed-stamp
MODEL_STAMP := $(MODELS)/efficientnet-lite0

TRITON_VENV := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed-stamp

.PHONY: setup model serve test test-cluster test-gpu lint format protos clean triton-client \
	perf-analyzer

# A venv with the pinned project; redone when pyproject.toml changes.
$(STAMP): pyproject.toml
	@echo "Installing raystream and its pinned dependencies into $(VENV): a couple of minutes on a fresh machine"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]'
	touch $@

setup: $(STAMP)

# The default model (EfficientNet-Lite0, pretrained) in the model repository, if missing.
model: setup
	$(BIN)/raystream export --model efficientnet-lite0 --repository $(MODELS) --if-missing

serve: model
	$(BIN)/raystream serve --config $(CONFIG) --model-repository $(MODELS) $(SERVE_ARGS)

# Triton's own gRPC client in a venv of its own (it needs protobuf < 7): tests/integration/test_tritonclient.py
$(TRITON_STAMP):
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q 'tritonclient[grpc]==2.73.0' 'protobuf==6.33.6' \
		'grpcio==1.85.1' 'numpy==2.4.6'
	touch $@

triton-client: $(TRITON_STAMP)

# Triton's perf_analyzer (bench/perf_analyzer.sh runs it). tritonclient's wheels shipped it up
# to 2.60.0; 2.51.0 is the last whose binary runs on glibc 2.36 (Debian 12), and it links two
# libraries Debian lacks or PyPI has: libb64 (Debian's libb64-0d, unpacked here without root)
# and CUDA's runtime (loaded, unused without a GPU). The `perf-analyzer` PyPI package is a
# placeholder.
PERF_VENV := .venv-perf-analyzer
PERF_STAMP := $(PERF_VENV)/.installed-stamp
$(PERF_STAMP):
	$(PYTHON) -m venv $(PERF_VENV)
	$(PERF_VENV)/bin/python -m pip install -q --no-deps 'tritonclient==2.51.0' \
		'nvidia-cuda-runtime-cu12==12.9.79'
	mkdir -p $(PERF_VENV)/libs
	cd $(PERF_VENV)/libs && { apt-get download libb64-0d=1.2-5+b1 2>/dev/null || \
		{ apt-get update -qq && apt-get download libb64-0d=1.2-5+b1; }; } && \
		dpkg-deb -x libb64-0d_1.2-5+b1_amd64.deb deb && \
		ln -sf deb/usr/lib/x86_64-linux-gnu/libb64.so.0d . && \
		ln -sf ../lib/python*/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12 .
	bench/perf_analyzer.sh --version
	touch $@

perf-analyzer: $(PERF_STAMP)

test: model triton-client perf-analyzer
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not cluster" $(PYTEST_ARGS)

# The multi-node tests (tests/cluster, about 6 minutes on 2 cores): a head and worker nodes
# started with `ray start`, every one on 127.0.0.1 in a network namespace of its own with only
# loopback (unshare: root, or unprivileged user namespaces).
test-cluster: model
	@unshare --net --map-root-user true 2>/dev/null || { echo "make test-cluster: cannot make \
	a network namespace (unshare --net --map-root-user): run as root or allow unprivileged \
	user namespaces (sysctl kernel.unprivileged_userns_clone=1)"; exit 1; }
	unshare --net --map-root-user -- sh -c 'ip link set lo up && exec "$$@"' sh \
		$(BIN)/python -m pytest -m cluster tests/cluster $(PYTEST_ARGS)

# The tests that need a CUDA GPU (they skip elsewhere), on a GPU host. With .gpu/site.tar.xz
# (bench/gpu_bundle.sh, for a host with no package registry) they run on the host's torch;
# without it, in the project's venv.
GPU_TESTS := tests/gpu tests/unit/test_engines.py tests/unit/test_gpu_decode.py
test-gpu:
	@if [ -f .gpu/site.tar.xz ]; then \
		bash -c 'source bench/gpu_env.sh && python3 -m clients.cli export --repository $(MODELS) \
			--if-missing && python3 -m pytest $(GPU_TESTS) $(PYTEST_ARGS)'; \
	else \
		$(MAKE) model && $(BIN)/python -m pytest $(GPU_TESTS) $(PYTEST_ARGS); \
	fi

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Regenerate the Python stubs after editing protos/ (tests/unit/test_protos.py checks they match).
protos: setup
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos protos/raystream/v1/classifier.proto \
		protos/raystream/oip/grpc_predict_v2.proto

clean:
	rm -rf $(VENV) $(TRITON_VENV) $(PERF_VENV) .pytest_cache .ruff_cache
