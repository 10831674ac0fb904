"""A traced request's engine span on the torch-CUDA engine carries the batch's GPU time,
timed with CUDA events, within the span's wall time; the spans go to a real OTLP receiver."""

from __future__ import annotations

import os

import pytest
import torch
from support import OtlpReceiver, until

from serve_app.config import STAGES, AppConfig, EngineConfig, TracingConfig
from serve_app.core.messages import Batch, Job
from serve_app.pipeline.topology import StageGroup

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


async def test_a_traced_engine_span_carries_its_gpu_time(model_repository, photos) -> None:
    receiver = await OtlpReceiver().start()
    try:
        group = await StageGroup.create(
            AppConfig(
                model_repository=model_repository,
                engine=EngineConfig(kind="torch-cuda", precision="fp16", batch_capacity=64),
                tracing=TracingConfig(  # spans leave every 5 s: the wait below is 30
                    sample_ratio=0.0,  # only the job below, which carries a sampled parent
                    otlp_endpoint=receiver.endpoint,
                ),
            ),
            STAGES,
        )
        trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
        images = tuple(photos[name] for name in ("chelsea", "coffee", "astronaut", "rocket"))
        job = Job(id="traced", images=images, top_k=1, trace=f"00-{trace_id}-{span_id}-01")
        (answer,) = await group.run(Batch(jobs=(job,)))
        assert answer.code == 0

        def engine_spans() -> list[dict]:
            return [s for s in receiver.trace(trace_id) if s["name"] == "raystream.engine"]

        await until(lambda: bool(engine_spans()), timeout_s=30.0)
        (engine,) = engine_spans()
        gpu_ms = engine["attributes"]["raystream.gpu_ms"].double_value
        wall_ms = (engine["end_ns"] - engine["start_ns"]) / 1e6
        assert 0 < gpu_ms <= wall_ms, (gpu_ms, wall_ms)
    finally:
        await receiver.stop()
