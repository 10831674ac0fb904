"""The engines on the CPU: the parity test every engine must pass (conftest.py; the GPU
engines run it in tests/gpu), the protocol's checks, and selection."""

from __future__ import annotations

import importlib.util
import logging
from typing import get_args

import numpy as np
import pytest
import torch

import engines
from engines import KINDS, EngineError, create_engine, pick_engine

from conftest import check_engine_parity

HAS_CUDA = torch.cuda.is_available()


def test_onnxruntime_parity_with_fp32_reference(model, engine_reference) -> None:
    check_engine_parity(
        model, engine_reference, "onnxruntime", "fp32", atol=1e-4, min_cosine=0.9999
    )


def test_engine_checks_its_input(model) -> None:
    with create_engine("onnxruntime", model, max_batch_size=4) as engine:
        with pytest.raises(ValueError, match=r"shape \(N, 3, 224, 224\)"):
            engine.infer(np.zeros((1, 3, 100, 100), np.float32))
        with pytest.raises(ValueError, match="float32"):
            engine.infer(np.zeros((1, 3, 224, 224), np.float64))
        with pytest.raises(ValueError, match=r"batch size must be in 1..4, got 5"):
            engine.infer(np.zeros((5, 3, 224, 224), np.float32))
        assert engine.info.input_shape == (3, 224, 224) and engine.info.num_classes == 1000


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only selection")
def test_selection_on_a_cpu_machine(model) -> None:
    assert pick_engine("auto") == "onnxruntime"
    with pytest.raises(EngineError, match="needs a CUDA GPU"):
        create_engine("torch-cuda", model)


def test_auto_picks_torch_cuda_on_a_gpu_even_where_tensorrt_imports(monkeypatch) -> None:
    """TensorRT has never run anywhere: `auto` never picks it, only a config that names it."""
    monkeypatch.setattr(engines, "_cuda_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: object() if name == "tensorrt" else real_find_spec(name, *args),
    )
    assert pick_engine("auto") == "torch-cuda"
    assert pick_engine("tensorrt") == "tensorrt"
    monkeypatch.setattr(engines, "_cuda_available", lambda: False)
    assert pick_engine("auto") == "onnxruntime"


@pytest.mark.skipif(HAS_CUDA, reason="stops at the missing GPU before building anything")
def test_asking_for_tensorrt_warns_that_it_is_experimental(model) -> None:
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    engines.logger.addHandler(handler)
    try:
        with pytest.raises(EngineError, match="needs a CUDA GPU"):
            create_engine("tensorrt", model)
        create_engine("onnxruntime", model).close()
    finally:
        engines.logger.removeHandler(handler)
    assert len(warnings) == 1 and "experimental" in warnings[0].getMessage()


def test_engine_kinds_are_one_list() -> None:
    from serve_app.config import EngineConfig

    assert KINDS == ("auto", "onnxruntime", "torch-cuda", "tensorrt", "echo")
    assert get_args(EngineConfig.model_fields["kind"].annotation) == KINDS
    with pytest.raises(EngineError, match="choose one of auto, onnxruntime"):
        create_engine("tensorflow", None)


def test_onnx_runtime_splits_the_cores_between_its_two_batches(model_repository) -> None:
    """Unless the config says, each of ONNX Runtime's two batches at once gets half the
    host's cores; other engines get their options as written."""
    import os

    from serve_app.config import AppConfig
    from serve_app.stages.inference import engine_options
    from serve_app.tuning import MAX_CONCURRENT_BATCHES

    half = max(1, (os.cpu_count() or 1) // MAX_CONCURRENT_BATCHES)
    config = AppConfig(model_repository=model_repository, engine={"kind": "onnxruntime"})
    assert engine_options(config) == {"threads": half}
    config = AppConfig(
        model_repository=model_repository, engine={"kind": "onnxruntime", "options": {"threads": 3}}
    )
    assert engine_options(config) == {"threads": 3}
    config = AppConfig(model_repository=model_repository, engine={"kind": "echo"})
    assert engine_options(config) == {}
