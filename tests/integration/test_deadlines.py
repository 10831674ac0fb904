"""Deadlines, cancellation, duplicate request ids and the message-size limit, against a real
server whose engine is slow on purpose (the echo engine with `delay_ms`: these tests are about
transport, and a slow engine makes "still queued when the deadline passed" and "still in
flight when the duplicate came" certain rather than likely)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from clients.client import Client
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc

from conftest import start_app

pytestmark = pytest.mark.slow

ENGINE_DELAY_MS = 400
MAX_MESSAGE_BYTES = 256 * 1024


@pytest.fixture(scope="module", params=["fused", "chained"])
def slow_server(request, ray_cluster, model_repository, photos):
    from ray import serve

    port, _ = start_app(
        "slow",
        model_repository,
        topology=request.param,
        engine={"kind": "echo", "options": {"delay_ms": ENGINE_DELAY_MS}},
        limits={"max_message_bytes": MAX_MESSAGE_BYTES},
    )
    address = f"127.0.0.1:{port}"
    # One request through the new replicas first: a cold first call (Ray handles, the first
    # decode) can take longer than the tests' 50 ms between requests, and then "busy" and
    # "late" reach the engine together instead of "late" waiting behind "busy".
    with grpc.insecure_channel(address) as channel:
        warm = pb.ClassifyRequest(request_id="warm-up", images=[photos["coffee"]])
        assert pb_grpc.ImageClassifierStub(channel).ClassifyOnce(warm).error.code == 0
    yield address
    serve.delete("slow")


async def _images_inferred() -> int:
    from ray import serve

    return await serve.get_deployment_handle("Inference", "slow").images_inferred.remote()


async def _paced(requests: list[pb.ClassifyRequest], gap_s: float):
    """Each request `gap_s` after the one before: after the warm-up, 50 ms is enough for a
    request to reach the engine before the next arrives. Nothing outside the replica shows
    that it did, so the tests check it: the first request ran alone (batch_size 1)."""
    for request in requests:
        yield request
        await asyncio.sleep(gap_s)  # pacing


async def test_a_request_past_its_timeout_is_answered_on_time_and_never_runs(
    slow_server, photos
) -> None:
    image = photos["chelsea"]
    before = await _images_inferred()
    requests = [
        pb.ClassifyRequest(request_id="busy", images=[image]),  # holds the engine 400 ms
        pb.ClassifyRequest(request_id="late", images=[image] * 3, timeout_ms=100),
        pb.ClassifyRequest(request_id="patient", images=[image], timeout_ms=30_000),
    ]
    async with Client(slow_server) as client:
        responses = [r async for r in client.stream(_paced(requests, 0.05))]
    by_id = {r.request_id: r for r in responses}
    assert len(responses) == 3 and set(by_id) == {"busy", "late", "patient"}
    late = by_id["late"]
    assert late.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "100 ms deadline" in late.error.message
    assert late.timing.total_ms < ENGINE_DELAY_MS  # answered at its deadline, not after
    assert responses[0].request_id == "late"  # before the request that held the engine
    assert by_id["busy"].error.code == 0 and by_id["patient"].error.code == 0
    assert by_id["busy"].timing.batch_size == 1  # "late" did not share its engine batch
    # The engine ran "busy" and "patient" (one image each), never the 3 images of "late".
    assert await _images_inferred() - before == 2


async def test_a_unary_grpc_deadline_drops_the_work_before_the_engine(slow_server, photos) -> None:
    image = photos["coffee"]
    before = await _images_inferred()
    async with Client(slow_server) as client:
        busy = asyncio.create_task(client.classify_once([image]))
        await asyncio.sleep(0.05)  # "busy" reaches the engine first (see _paced)
        # Two photos (209 KB): under the server's message limit, so that only the deadline
        # can end the call (four, 419 KB, were refused for their size when that answer beat
        # the deadline). The server takes the call's deadline as the request's: whichever
        # fires first, gRPC's or the server's own timer, the answer is DEADLINE_EXCEEDED.
        try:
            late = await client.stub.ClassifyOnce(
                pb.ClassifyRequest(request_id="x", images=[image] * 2), timeout=0.1
            )
            code = late.error.code
        except grpc.aio.AioRpcError as exc:
            code = exc.code().value[0]
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        busy = await busy
        assert busy.error.code == 0 and busy.timing.batch_size == 1
        # Had "x" been kept, it would run before anything sent now: once this answer is
        # back, the count includes it.
        assert (await client.classify_once([image])).error.code == 0
    assert await _images_inferred() - before == 2  # "busy" and the last one, never "x"


async def test_a_duplicate_request_id_in_flight_is_refused_and_free_again_once_answered(
    slow_server, photos
) -> None:
    """The duplicate goes right behind the first, which the engine holds 400 ms: it arrives
    while the first is in flight. A third with the same id goes once the first is answered."""
    image = photos["coffee"]  # one a request: the limit here is 256 KiB a message
    first_answered = asyncio.Event()

    async def requests():
        yield pb.ClassifyRequest(request_id="same", images=[image])
        yield pb.ClassifyRequest(request_id="same", images=[image])
        await first_answered.wait()
        yield pb.ClassifyRequest(request_id="same", images=[image])

    responses = []
    async with Client(slow_server) as client:
        async for response in client.stream(requests()):
            responses.append(response)
            if response.error.code == 0:  # the first: the third is not sent before this
                first_answered.set()
    assert [r.error.code for r in responses] == [
        grpc.StatusCode.ALREADY_EXISTS.value[0],  # refused at once, ahead of the first
        0,
        0,
    ]
    assert "'same' is already in flight" in responses[0].error.message
    assert not responses[0].results and len(responses[2].results) == 1


async def test_a_message_over_the_size_limit_ends_its_stream_with_resource_exhausted(
    slow_server, photos
) -> None:
    """gRPC enforces `max_message_bytes` itself and ends the whole stream with
    RESOURCE_EXHAUSTED; the client library answers every request left on it with that code."""
    huge = b"\xff\xd8" + bytes(MAX_MESSAGE_BYTES)  # over the limit before any decoding
    requests = [
        pb.ClassifyRequest(request_id="ok", images=[photos["chelsea"]]),
        pb.ClassifyRequest(request_id="huge", images=[huge]),
        pb.ClassifyRequest(request_id="after", images=[photos["chelsea"]]),
    ]
    responses = []
    async with Client(slow_server) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for response in client.stream(_paced(requests, 0.1)):
                responses.append(response)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in raised.value.details()
        by_id = {r.request_id: r for r in responses}
        assert sorted(by_id) == ["after", "huge", "ok"] and len(responses) == 3
        assert by_id["huge"].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        # The server goes on: a new stream on the same channel is served.
        again = [r async for r in client.stream([requests[0]])]
    assert again[0].error.code == 0 and again[0].results[0].labels
