"""One parity test that every engine must pass, plus the protocol's checks and selection."""

from __future__ import annotations

import importlib.util
import logging
from typing import get_args

import numpy as np
import pytest
import torch

import engines
from engines import KINDS, EngineError, create_engine, pick_engine
from engines.export import EXPORTABLE, check_photos
from engines.scores import softmax

HAS_CUDA = torch.cuda.is_available()
HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None

ENGINES = [
    pytest.param("onnxruntime", "fp32", 1e-4, id="onnxruntime-fp32"),
    pytest.param(
        "torch-cuda",
        "fp16",
        1e-2,
        id="torch-cuda-fp16",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")],
    ),
    # BF16 keeps 8 bits of mantissa: on the H200 (2026-11-30) EfficientNet-Lite0 reached a max
    # |softmax diff| of 2.3e-2 against FP32, over the 1e-2 bound. Strict: it fails if fixed.
    pytest.param(
        "torch-cuda",
        "bf16",
        1e-2,
        id="torch-cuda-bf16",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"),
            pytest.mark.xfail(strict=True, reason="BF16 exceeds the 1e-2 softmax bound (2.3e-2)"),
        ],
    ),
    pytest.param(
        "tensorrt",
        "fp16",
        1e-2,
        id="tensorrt-fp16",
        marks=[
            pytest.mark.tensorrt,
            pytest.mark.skipif(
                not (HAS_CUDA and HAS_TENSORRT),
                reason="needs a CUDA GPU and the tensorrt package (not installable "
                "on any machine here; see README)",
            ),
        ],
    ),
]


@pytest.fixture(scope="module")
def reference(model) -> tuple[np.ndarray, np.ndarray]:
    """Real photos and the FP32 torch model's softmax on them (the ground truth)."""
    batch = check_photos(model.spec.preprocess)
    net = EXPORTABLE["efficientnet-lite0"].build().eval()
    with torch.inference_mode():
        return batch, softmax(net(torch.from_numpy(batch)).numpy())


@pytest.mark.parametrize(("kind", "precision", "atol"), ENGINES)
def test_engine_parity_with_fp32_reference(model, reference, kind, precision, atol) -> None:
    batch, expected = reference
    with create_engine(kind, model, max_batch_size=8, precision=precision) as engine:
        engine.warmup()
        got = softmax(engine.infer(batch))
        np.testing.assert_array_equal(got.argmax(1), expected.argmax(1))
        assert np.abs(got - expected).max() <= atol
        # Batch composition changes nothing beyond the precision's tolerance...
        singles = np.concatenate([softmax(engine.infer(batch[i : i + 1])) for i in range(3)])
        three = softmax(engine.infer(batch[:3]))
        np.testing.assert_array_equal(three.argmax(1), singles.argmax(1))
        assert np.abs(three - singles).max() <= atol
        # ...and what sits in the padding of a bucket (3 runs padded to 4) changes nothing.
        engine.infer(batch[[3, 3, 3, 3]])  # leaves image 3 in the padding row
        np.testing.assert_array_equal(softmax(engine.infer(batch[:3])), three)


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


_PRIMARY_CONTEXT_FLAGS = """
import ctypes, torch
from engines.cuda_graphs import sleep_in_every_gpu_wait
if BLOCK:
    sleep_in_every_gpu_wait(torch.device("cuda", 0))
torch.ones(8, device="cuda").sum().item()  # the context is in use
driver, flags, active = ctypes.CDLL("libcuda.so.1"), ctypes.c_uint(), ctypes.c_int()
assert driver.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0
print(flags.value, active.value)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_blocking_sync_puts_every_gpu_wait_of_the_process_to_sleep() -> None:
    """The torch-CUDA engine's blocking_sync option: the primary context torch then uses
    carries CU_CTX_SCHED_BLOCKING_SYNC (0x04); without it, CUDA's default (0). In a fresh
    process each, as the flag is the process's."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    states = [
        subprocess.run(
            [sys.executable, "-c", f"BLOCK = {block}\n{_PRIMARY_CONTEXT_FLAGS}"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for block in (False, True)
    ]
    assert states == [["0", "1"], ["4", "1"]]
