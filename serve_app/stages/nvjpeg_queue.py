"""decode: gpu in a stage replica: one nvJPEG decode thread, fed by a queue that joins the
pieces of JPEGs of every call (and ingress replica) into batched decodes. The stage that
decodes hosts it: the Inference replicas where the topology fuses Preprocess into them, the
Preprocess replicas where Preprocess is a deployment of its own (their crops then reach
Inference on the same GPU by CUDA IPC: serve_app/transport/device_crops.py).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from engines.repository import PreprocessSpec
from serve_app.config import AppConfig
from serve_app.stages.batching import DynamicBatcher
from serve_app.stages.decode_pool import decode_limits
from serve_app.stages.stall_watch import StallWatch
from serve_app.tuning import DECODE_BATCH


class NvjpegQueue:
    """`await decode(jpegs)`: at most DECODE_BATCH JPEGs' crops (engines.gpu_decode.Crops),
    decoded with other calls' pieces in one nvJPEG call on the decode thread."""

    def __init__(self, config: AppConfig, spec: PreprocessSpec, chunk: int | None = None) -> None:
        """`chunk`: the most JPEGs in one nvJPEG call (None: a piece's all; benchmarks only)."""
        from engines.gpu_decode import GpuJpegDecoder  # GPU machines only

        hybrid = None
        if config.experimental.gpu_hybrid_decode:
            from engines.nvjpeg import HybridJpegDecoder

            hybrid = HybridJpegDecoder()
        self._decoder = GpuJpegDecoder(
            spec,
            decode_limits(config),
            chunk=chunk,
            hybrid_decode=hybrid,
            hybrid_min_jpegs=DECODE_BATCH,
            hybrid_share=config.experimental.gpu_hybrid_decode,
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="nvjpeg")
        self._watch = StallWatch()
        self._queue = DynamicBatcher(
            self._decode_many, len, max_batch_size=DECODE_BATCH, max_queued=1 << 30
        )

    async def decode(self, jpegs: list[bytes]):
        decoded, _ = await self._queue.submit(jpegs)
        return decoded

    async def warm(self):
        """Decode once on the decode thread (nvJPEG's first call and the resize kernels'
        loading cost seconds) before the replica reports ready; the crops, for the engine's
        own first pass."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._decoder.warmup)

    def stalled_s(self) -> float:
        """How long the decode running now has run; 0 if none runs."""
        return self._watch.stalled_s()

    async def close(self) -> None:
        """Once the decode running now is done (it stays watched until then)."""
        await self._queue.close()
        await asyncio.shield(asyncio.to_thread(self._executor.shutdown))

    def abandon(self) -> None:
        """close() without waiting for the decode thread, which may be stuck (a warm-up
        given up): it ends when its call does."""
        self._queue.abandon()
        self._executor.shutdown(wait=False)

    async def _decode_many(self, pieces: list[list[bytes]]) -> list:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._watch.run, self._decoder.crops_many, pieces
        )
