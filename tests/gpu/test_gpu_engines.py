"""The GPU engines (torch-CUDA, TensorRT) pass the same parity test as ONNX Runtime
(conftest.py), and the torch-CUDA engine's blocking-sync option."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path

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


def _batches(reference, count: int, size: int) -> list:
    """`count` different batches of `size`: the real photos, each batch shifted in brightness."""
    import numpy as np

    rows = np.resize(np.arange(len(reference.batch)), size)
    return [reference.batch[rows] + 0.1 * i for i in range(count)]


@contextlib.contextmanager
def _capturing_on_another_thread(device: torch.device, lock=None):
    """A CUDA graph capture held open on another thread (holding `lock` where given) for
    the block, as an engine's background capture is; yields the graph, the tensor its one
    kernel adds 1 to, and the event that ends the capture early."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    static = torch.zeros(4, device=device)
    inside, release = threading.Event(), threading.Event()

    def capture() -> None:
        held = lock or contextlib.nullcontext()
        with held, torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            static.add_(1)
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        assert inside.wait(30)
        yield graph, static, release
    finally:
        release.set()
        thread.join()


def test_warm_up_input_is_drawn_while_another_thread_captures_a_graph() -> None:
    """A replica's engines capture graphs in background threads; another engine's warm-up
    input (a second model version loading meanwhile) must not come from the default CUDA
    generator, which torch marks as capturing for every thread while one captures."""
    from engines.cuda_graphs import sample_input

    device = torch.device("cuda:0")
    with _capturing_on_another_thread(device):
        # torch.randn(4, device=device) fails here (torch 2.11): "Offset increment outside
        # graph capture encountered unexpectedly"
        assert sample_input((2, 3, 8, 8), device).shape == (2, 3, 8, 8)


def test_an_engine_starting_while_another_captures_waits_its_turn(model) -> None:
    """torch.cuda.graph synchronizes the device as it starts a capture, which fails while
    another thread of the process captures and breaks that capture too (a model version
    loading while another still captures its smaller buckets in the background; make
    test-gpu on an H200 failed so). Engines take turns (cuda_graphs.CAPTURING): one started
    meanwhile waits, then captures every bucket, and the other capture stays whole."""
    from engines import create_engine
    from engines.cuda_graphs import CAPTURING

    device = torch.device("cuda:0")
    # as an engine captures: holding CAPTURING
    with _capturing_on_another_thread(device, CAPTURING) as (graph, static, release):
        threading.Timer(2.0, release.set).start()
        with create_engine(
            "torch-cuda", model, max_batch_size=8, background_capture=False
        ) as engine:
            assert engine.planner.buckets == engine.buckets
    graph.replay()
    torch.cuda.synchronize()
    assert static.tolist() == [1.0] * 4  # the capture the engine waited for is whole


def test_two_slots_running_at_once_keep_their_own_buffers(model, engine_reference) -> None:
    """Two batches on the two slots at once, over and over: each answer equals the one the
    same batch gets alone. The slots' graphs must not share intermediate buffers (one graph
    memory pool per slot), or concurrent replays would overwrite each other's activations."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from engines import create_engine

    batches = _batches(engine_reference, count=2, size=64)
    with create_engine("torch-cuda", model, max_batch_size=64, background_capture=False) as engine:
        alone = [engine.infer(batch).logits for batch in batches]
        with ThreadPoolExecutor(2) as pool:
            for _ in range(50):
                both = list(pool.map(engine.infer, batches))
                for got, expected in zip(both, alone, strict=True):
                    np.testing.assert_allclose(got.logits, expected, rtol=0, atol=1e-3)


def test_background_capture_serves_at_once_and_adds_every_bucket(
    model, engine_reference, monkeypatch
) -> None:
    """Ready with the largest bucket only; batches sent while the others are captured get the
    same answers (to FP16's tolerance) as once every bucket is in."""
    import numpy as np

    from engines import create_engine
    from engines.scores import softmax
    from engines.torch_cuda import TorchCudaEngine

    # Hold the background captures until batches have run on the largest bucket alone (this
    # process may already have every shape's kernels, which would make them too quick).
    gate, warm_up = threading.Event(), TorchCudaEngine._warm_up
    monkeypatch.setattr(
        TorchCudaEngine, "_warm_up", lambda self, bucket: gate.wait(60) and warm_up(self, bucket)
    )
    batch = _batches(engine_reference, count=1, size=3)[0]
    with create_engine("torch-cuda", model, max_batch_size=64) as engine:
        assert engine.planner.buckets == (64,)
        during = [engine.infer(batch) for _ in range(3)]
        gate.set()

        def serve() -> None:
            while not engine.captured.is_set():
                during.append(engine.infer(batch))

        threads = [threading.Thread(target=serve) for _ in range(2)]
        for thread in threads:
            thread.start()
        assert engine.captured.wait(300)
        for thread in threads:
            thread.join()
        assert engine.planner.buckets == engine.buckets
        after = engine.infer(batch)
    for out in during:
        np.testing.assert_array_equal(out.logits.argmax(1), after.logits.argmax(1))
        assert np.abs(softmax(out.logits) - softmax(after.logits)).max() <= 1e-2


def test_compile_after_ready_serves_uncompiled_graphs_then_swaps_in_compiled_ones(
    model, engine_reference, monkeypatch
) -> None:
    """Ready before anything is compiled; each compiled bucket's graph then replaces its
    uncompiled one in every slot, compiled once (its mark left); batches sent meanwhile get
    the same answers (to FP16's tolerance) as once all are in."""
    import numpy as np
    from torch._inductor import config as inductor
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch._inductor.utils import fresh_cache

    from engines import create_engine
    from engines.scores import softmax
    from engines.torch_cuda import COMPILE_THREADS_WHILE_SERVING, TorchCudaEngine

    # Hold the first compile until batches have run on the uncompiled graphs.
    gate, before = threading.Event(), TorchCudaEngine._before_recapture
    monkeypatch.setattr(
        TorchCudaEngine,
        "_before_recapture",
        lambda self, bucket: gate.wait(60) and before(self, bucket),
    )
    batch = _batches(engine_reference, count=1, size=12)[0]
    options = {"compile_min_batch": 8, "compile_after_ready": True}
    stop = threading.Event()
    with fresh_cache(), create_engine("torch-cuda", model, max_batch_size=16, **options) as engine:
        assert engine._compiled_buckets == set()  # ready, nothing compiled
        assert inductor.compile_threads <= COMPILE_THREADS_WHILE_SERVING  # a few cores only
        during = [engine.infer(batch) for _ in range(3)]
        gate.set()

        def serve() -> None:
            while not engine.captured.is_set() and not stop.is_set():
                during.append(engine.infer(batch))

        threads = [threading.Thread(target=serve) for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            assert engine.captured.wait(600)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert engine._compiled_buckets == {8, 16}
        marks = list((Path(cache_dir()) / "raystream-compiled").glob("*.done"))
        assert len(marks) == 2  # each bucket compiled once, on this empty cache
        # every slot holds a graph per bucket, those of 8 and 16 captured from the compiled
        # module (the only captures after their first compiled pass)
        assert len(engine._slots.queue) == 2
        for slot in engine._slots.queue:
            assert sorted(slot.graphs) == list(engine.buckets)
        assert engine.planner.buckets == engine.buckets
        after = engine.infer(batch)
    for out in during:
        np.testing.assert_array_equal(out.logits.argmax(1), after.logits.argmax(1))
        assert np.abs(softmax(out.logits) - softmax(after.logits)).max() <= 1e-2
