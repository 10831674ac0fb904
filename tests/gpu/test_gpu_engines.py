"""The GPU engines (torch-CUDA, TensorRT) pass the same parity test as ONNX Runtime
(conftest.py), and the torch-CUDA engine's blocking-sync option."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, check_engine_parity

HAS_CUDA = torch.cuda.is_available()
HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

# (engine, precision, max |softmax diff|, min embedding cosine) against the FP32 torch model
ENGINES = [
    pytest.param("torch-cuda", "fp16", 1e-2, 0.999, id="torch-cuda-fp16"),
    # BF16 keeps 8 bits of mantissa: on the H200 (2026-11-30) EfficientNet-Lite0 reached a max
    # |softmax diff| of 2.3e-2 against FP32, over the 1e-2 bound. Strict: it fails if fixed.
    pytest.param(
        "torch-cuda",
        "bf16",
        1e-2,
        0.999,
        id="torch-cuda-bf16",
        marks=pytest.mark.xfail(strict=True, reason="BF16 exceeds the 1e-2 softmax bound (2.3e-2)"),
    ),
    pytest.param(
        "tensorrt",
        "fp16",
        1e-2,
        0.999,
        id="tensorrt-fp16",
        marks=[
            pytest.mark.tensorrt,
            pytest.mark.skipif(
                not HAS_TENSORRT,
                reason="needs the tensorrt package (not installable on any machine here; "
                "see docs/known-limits.md)",
            ),
        ],
    ),
]


@pytest.mark.parametrize(("kind", "precision", "atol", "min_cosine"), ENGINES)
def test_engine_parity_with_fp32_reference(
    model, engine_reference, kind, precision, atol, min_cosine
) -> None:
    """Both outputs of one pass, through the captured CUDA graphs of every bucket used."""
    check_engine_parity(model, engine_reference, kind, precision, atol, min_cosine)


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


def test_blocking_sync_puts_every_gpu_wait_of_the_process_to_sleep() -> None:
    """The torch-CUDA engine's blocking_sync option: the primary context torch then uses
    carries CU_CTX_SCHED_BLOCKING_SYNC (0x04); without it, CUDA's default (0). In a fresh
    process each, as the flag is the process's."""
    states = [
        subprocess.run(
            [sys.executable, "-c", f"BLOCK = {block}\n{_PRIMARY_CONTEXT_FLAGS}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for block in (False, True)
    ]
    assert states == [["0", "1"], ["4", "1"]]
