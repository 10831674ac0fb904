# raystream: `make serve` sets up and starts the server; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODELS ?= models
CONFIG ?= deploy/serve_config.yaml
SERVE_ARGS ?=
STAMP := $(VENV)/.installed-stamp
MODEL_STAMP := $(MODELS)/efficientnet-lite0

.PHONY: setup model serve test lint format protos clean

# A venv with the pinned project; redone when pyproject.toml changes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

setup: $(STAMP)

# The default model (EfficientNet-Lite0, pretrained) in the model repository, if missing.
model: setup
	$(BIN)/raystream export --model efficientnet-lite0 --repository $(MODELS) --if-missing

serve: model
	$(BIN)/raystream serve --config $(CONFIG) --model-repository $(MODELS) $(SERVE_ARGS)

test: model
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Regenerate the Python stubs after editing protos/ (tests/test_protos.py checks they match).
protos: setup
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
		--grpc_python_out=protos protos/raystream/v1/classifier.proto \
		protos/raystream/oip/grpc_predict_v2.proto

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
