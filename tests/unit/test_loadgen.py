"""The load generator's requests, without a server: what it sends is what it stands for."""

from __future__ import annotations

import asyncio
import collections
import random
import time

import numpy as np
import pytest

from clients.loadgen import Workload, _requests
from raystream.v1 import classifier_pb2 as pb


def _sent(workload: Workload, count: int) -> list[pb.ClassifyRequest]:
    async def take() -> list[pb.ClassifyRequest]:
        sent: dict[str, float] = {}
        slots = asyncio.Semaphore(count)
        requests = _requests(workload, sent, slots, time.perf_counter() + 60, "s0", random.Random())
        encoded = [request async for request in requests]
        assert list(sent) == [request.request_id for request in encoded]
        parsed = [pb.ClassifyRequest.FromString(request.data) for request in encoded]
        assert [p.request_id for p in parsed] == [request.request_id for request in encoded]
        return parsed

    return asyncio.run(take())


def test_encoded_requests_parse_as_the_messages_they_stand_for() -> None:
    images = (b"\xff\xd8a", b"\x89PNGbb", b"ccc")
    workload = Workload(images=images, batch_size=2, top_k=3, max_requests=3)
    a, b, c = images
    assert _sent(workload, 3) == [
        pb.ClassifyRequest(request_id="s0-0", top_k=3, images=[a, b]),
        pb.ClassifyRequest(request_id="s0-1", top_k=3, images=[c, a]),
        pb.ClassifyRequest(request_id="s0-2", top_k=3, images=[b, c]),
    ]


def test_encoded_pixel_requests_hold_batch_size_rows() -> None:
    pixels = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2)
    workload = Workload(images=(), batch_size=3, pixels=pixels, max_requests=2)
    rows = np.concatenate([pixels, pixels[:1]])  # cycled through to batch_size rows
    tensor = pb.Tensor(shape=rows.shape, data=rows.astype("<f4").tobytes())
    assert _sent(workload, 2) == [
        pb.ClassifyRequest(request_id=f"s0-{i}", top_k=5, pixels=tensor) for i in range(2)
    ]


def test_the_benchmark_loader_asks_for_its_outputs_and_counts_missing_ones() -> None:
    """bench/load.py: requests carry `outputs`; an image answered OK without what it asked
    for is counted, so a server that drops embeddings cannot pass for a fast one."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    import load

    for outputs, expected in [
        ("labels", []),
        ("embedding", [pb.EMBEDDING]),
        ("labels,embedding", [pb.LABELS, pb.EMBEDDING]),
    ]:
        spec = load.LoadSpec(target="x", images=2, outputs=outputs)
        request_id, data = load._Requests(spec, [b"a", b"b", b"c"], 0).next()
        request = pb.ClassifyRequest.FromString(data)
        assert request.request_id == request_id and list(request.outputs) == expected
        assert list(request.images) == [b"a", b"b"]
    with pytest.raises(ValueError, match="outputs must name labels and/or embedding"):
        load.LoadSpec(target="x", outputs="labels,vectors").wanted()

    stats = load._Stats((0.0, 1e12), (True, True))
    response = pb.ClassifyResponse(request_id="r")
    response.results.add().labels.add(class_id=1)  # no embedding: missing
    both = response.results.add()
    both.labels.add(class_id=1)
    both.embedding.values.append(1.0)
    response.results.add().error.code = 3  # failed: nothing is missing
    stats.answer(response, 1.0, {"r": 0.5})
    assert stats.outputs_missing == 1 and stats.image_codes == {0: 2, 3: 1}


def test_the_benchmark_loader_averages_the_servers_timing_of_ok_answers() -> None:
    """bench/load.py reports where a request's time goes inside the server: the mean of each
    `timing` field over the OK answers in the window (a failed request's times say nothing)."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    import load

    stats = load._Stats((0.0, 10.0), (True, False))
    for rid, total_ms, queue_ms, code, now in [
        ("a", 30.0, 10.0, 0, 1.0),
        ("b", 50.0, 20.0, 0, 2.0),
        ("c", 900.0, 0.0, 4, 3.0),  # failed: not averaged
        ("d", 700.0, 0.0, 0, 11.0),  # after the window
    ]:
        response = pb.ClassifyResponse(request_id=rid)
        response.error.code = code
        response.timing.total_ms, response.timing.queue_ms = total_ms, queue_ms
        stats.answer(response, now, {rid: now - 0.1})
    spec = load.LoadSpec(target="x", duration=10.0)
    report = load.merge(spec, [stats.result()])
    assert report["server_timing_ms"]["total"] == 40.0
    assert report["server_timing_ms"]["queue"] == 15.0
    assert report["server_timing_ms"]["inference"] == 0.0
    assert "server's mean ms: total 40.0, dispatch 0.0, queue 15.0" in load.summary(report)


def test_the_benchmark_loader_repeats_images_at_its_fraction(photos, model) -> None:
    """bench/load.py --repeat-fraction: repeated images are the same bytes every time, the
    others never repeat, and every variant decodes as its photo does, on the CPU and on the
    GPU path (which takes only JPEGs that end with their end-of-image marker)."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    import load

    from engines.images import decode
    from engines.jpeg import gpu_size

    originals = [photos["chelsea"], photos["coffee"]]
    requests = load._Requests(
        load.LoadSpec(target="x", images=8, repeat_fraction=0.5), originals, 0
    )
    images = []
    for _ in range(50):
        request_id, data = requests.next()
        request = pb.ClassifyRequest.FromString(data)
        assert request.request_id == request_id and request.top_k == 5
        images += request.images
    counts = collections.Counter(images)
    repeats = [n for n in counts.values() if n > 1]
    assert len(repeats) == len(originals) and 0.4 < sum(repeats) / len(images) < 0.6
    spec = model.spec.preprocess
    for image in images[:4]:
        original = next(o for o in originals if o[-1000:] == image[-1000:])
        assert image != original and gpu_size(image) == gpu_size(original) is not None
        np.testing.assert_array_equal(decode(image, spec), decode(original, spec))
    unique = load.LoadSpec(target="x", images=3, repeat_fraction=0.0)
    sent = [load._Requests(unique, originals, c).next()[1] for c in (0, 1)]
    assert (
        len({image for data in sent for image in pb.ClassifyRequest.FromString(data).images}) == 6
    )


def test_the_benchmark_loader_samples_the_traceparent_of_its_first_n_connections() -> None:
    import sys

    from opentelemetry import trace

    from serve_app.observability.tracing import _context

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    import load

    assert load.LoadSpec("x", connections=4).traceparent(0) == ()
    spec = load.LoadSpec("x", connections=4, traced_connections=1)
    sent = [dict(spec.traceparent(c))["traceparent"] for c in range(4)]
    contexts = [trace.get_current_span(_context(parent)).get_span_context() for parent in sent]
    assert all(context.is_valid and context.is_remote for context in contexts)
    assert [context.trace_flags.sampled for context in contexts] == [True, False, False, False]
    assert len({context.trace_id for context in contexts}) == 4
