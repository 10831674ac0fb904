"""A request's images as spans of the message it came in (serve_app/wire/request_images.py): the
split agrees with protobuf's own parse on every request, refuses what is not wire format,
the spans behave as the tuple of bytes they stand for, through pickling and the
shared-memory handoff, and the raystream.v1 stream takes large requests' images this way."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raystream.v1 import classifier_pb2 as pb
from serve_app import tuning
from serve_app.core.messages import Batch, Job
from serve_app.protocol import v1
from serve_app.protocol.v1 import IMAGES_FIELD
from serve_app.transport import codec, shared_images
from serve_app.transport.shared_images import ImageReader, ImageWriter
from serve_app.wire.request_images import ImageSpans, buffers, pick, split_images

requests = st.builds(
    pb.ClassifyRequest,
    request_id=st.text(max_size=40),
    images=st.lists(st.binary(max_size=3000), max_size=6),
    top_k=st.integers(0, 2**32 - 1),
    model=st.text(max_size=20),
    timeout_ms=st.integers(0, 2**32 - 1),
    outputs=st.lists(st.sampled_from([0, 1, 2, 7]), max_size=3),
    pixels=st.builds(
        pb.Tensor, shape=st.lists(st.integers(-(2**40), 2**40), max_size=4), data=st.binary()
    ),
)


@settings(max_examples=300, deadline=None)
@given(requests)
def test_the_split_agrees_with_protobuf(request: pb.ClassifyRequest) -> None:
    message = request.SerializeToString()
    rest, images = split_images(message, IMAGES_FIELD)
    assert tuple(images) == tuple(request.images)
    parsed = pb.ClassifyRequest.FromString(rest)
    assert not parsed.images
    parsed.images.extend(images)
    assert parsed == request
    assert len(rest) + sum(len(image) for image in images) < len(message) + 1


def test_the_images_keep_their_order_among_other_fields() -> None:
    # Fields in any order, images interleaved, an unknown field: as another client may send.
    first = pb.ClassifyRequest(images=[b"one"]).SerializeToString()
    second = pb.ClassifyRequest(images=[b"", b"three"]).SerializeToString()
    middle = pb.ClassifyRequest(request_id="r", top_k=3).SerializeToString()
    unknown = b"\xa8\x06\x01"  # field 101, varint 1
    message = first + middle + unknown + second
    rest, images = split_images(message, IMAGES_FIELD)
    assert list(images) == [b"one", b"", b"three"]
    parsed = pb.ClassifyRequest.FromString(rest)
    assert (parsed.request_id, parsed.top_k) == ("r", 3)
    assert pb.ClassifyRequest.FromString(message).images == [b"one", b"", b"three"]


@pytest.mark.parametrize(
    "message",
    [
        b"\x12\x05abc",  # an image longer than what is left
        b"\x12",  # a key and no length
        b"\x12\xff\xff",  # a length that never ends
        b"\x18\x80",  # a varint that never ends
        b"\x0b\x0c",  # a group (proto2): protobuf's own parse decides
        b"\x00\x01",  # field number 0
        b"\x1d\x00\x00",  # a fixed32 cut short
        b"\x92\x80\x80\x80\x80\x00\x01x",  # an image's key in 6 bytes (protobuf: at most 5)
        b"\x12\x81\x80\x80\x80\x80\x00x",  # an image's length in 6 bytes
    ],
)
def test_what_is_not_wire_format_is_left_to_protobuf(message: bytes) -> None:
    assert split_images(message, IMAGES_FIELD) is None


def test_a_message_of_countless_fields_is_left_to_protobuf() -> None:
    """Walked in Python, 2M tiny fields held the event loop 1.6 s (protobuf parses them in
    15 ms): past MAX_FIELDS the split gives up."""
    assert split_images(b"\x18\x00" * (2 << 20), IMAGES_FIELD) is None
    images = pb.ClassifyRequest(images=[b"x"] * 300, top_k=3).SerializeToString()
    assert len(split_images(images, IMAGES_FIELD)[1]) == 300


def test_spans_read_as_a_tuple_of_bytes() -> None:
    message = pb.ClassifyRequest(request_id="x", images=[b"aa", b"bbb", b"c"]).SerializeToString()
    _, images = split_images(message, IMAGES_FIELD)
    assert isinstance(images, ImageSpans) and len(images) == 3
    assert images[0] == b"aa" and images[-1] == b"c"
    assert images[1:] == (b"bbb", b"c")
    assert list(images) == [b"aa", b"bbb", b"c"]
    assert images == (b"aa", b"bbb", b"c") and images != (b"aa",)
    assert all(type(image) is bytes for image in images)
    views = buffers(images)
    assert [bytes(view) for view in views] == [b"aa", b"bbb", b"c"]
    assert all(view.obj is message for view in views)  # views of the message: no copies
    plain = (b"aa",)
    assert buffers(plain) is plain
    picked = pick(images, [2, 0])
    assert isinstance(picked, ImageSpans) and picked == (b"c", b"aa")
    assert all(view.obj is message for view in buffers(picked))
    assert pick((b"x", b"y", b"z"), [1]) == (b"y",)


@pytest.mark.parametrize(
    ("dumps", "loads"),
    [(pickle.dumps, pickle.loads), (lambda obj: b"".join(codec.dumps(obj)), codec.loads)],
)
def test_a_job_with_spans_travels_as_a_tuple_of_its_images(dumps, loads) -> None:
    # Pickled by Ray's serializer for a Serve handle call, or packed by the stage ports'
    # codec: the images as a tuple of bytes either way, each written once.
    photos = [bytes(range(256)) * 300, b"\xff\xd8" * 5000]
    message = pb.ClassifyRequest(request_id="r", images=photos).SerializeToString()
    _, images = split_images(message, IMAGES_FIELD)
    job = Job(id="r", images=images)
    assert job.count == 2
    other = Job(id="s", images=(b"plain",), pixels=np.ones((1, 3, 2, 2), np.float32))
    pickled = dumps(Batch(jobs=(job, other)))
    assert b"request_images" not in pickled
    assert len(pickled) < sum(map(len, photos)) + 2000  # each image written once
    jobs = loads(pickled).jobs
    assert jobs[0].images == tuple(photos)
    assert type(jobs[0].images) is tuple
    assert all(type(image) is bytes for image in jobs[0].images)
    assert jobs[1].images == (b"plain",) and np.array_equal(jobs[1].pixels, other.pixels)


def test_spans_go_into_shared_memory_whole(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(shared_images, "SHM_DIR", tmp_path)
    monkeypatch.setattr(shared_images, "MIN_SEGMENT_BYTES", 1 << 20)
    photos = [b"\x01" * 70_000, b"", b"\x02" * 999]
    message = pb.ClassifyRequest(images=photos).SerializeToString()
    _, images = split_images(message, IMAGES_FIELD)
    batch = Batch(jobs=(Job(id="a", images=images), Job(id="b", images=(b"xyz",))))
    writer = ImageWriter(8 << 20)
    stripped, where = writer.put(batch)
    restored = ImageReader().restore(stripped, where)
    assert [tuple(job.images) for job in restored.jobs] == [tuple(photos), (b"xyz",)]
    writer.release(where.name)
    writer.close()


async def test_the_stream_keeps_large_requests_images_in_place(photos) -> None:
    async def messages():
        yield pb.ClassifyRequest(request_id="big", images=list(photos.values())).SerializeToString()
        yield pb.ClassifyRequest(request_id="small", images=[b"tiny"]).SerializeToString()
        yield b"\x12\x05abc"  # cut short

    reads = [read async for read in v1._parsed(messages())]
    big, small, broken = reads
    assert len(big.raw) >= tuning.SPLIT_MIN_BYTES and isinstance(big.images, ImageSpans)
    assert big.images == tuple(photos.values()) and big.request.request_id == "big"
    assert small.images == (b"tiny",) and small.request.request_id == "small"
    assert broken.request is None
