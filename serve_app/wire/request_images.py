"""A request's images left where gRPC put them: spans of the received message, not copies.

The ingress replica that holds a client's connection reads every request on it, so what it
does per request bounds what the connection gets. gRPC hands it each message as one bytes
object; parsing it with protobuf copies the whole message (0.69 MB for a request of 8
photos), and taking its images out copies them again, before the shared-memory handoff
copies them a third time. Instead, `split_images` walks the message's top-level fields
(protobuf's wire format: a key, then a value whose length the key's wire type gives), keeps
the images as (start, end) spans of the message, and leaves protobuf the rest to parse:
a few hundred bytes.

`ImageSpans` reads as the tuple of bytes it replaces: indexing or iterating gives each image
as bytes (a copy, where a decoder needs one). `buffers` gives views instead (the copy into
shared memory, the result cache's hash), and `pick` some of the images still as spans (the
cache's misses). A stage call over a port packs each image straight from the message
(serve_app/transport/codec.py); one through a Serve handle pickles it as that tuple.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

LENGTH_DELIMITED = 2
_FIXED = {1: 8, 5: 4}  # wire type: bytes (64-bit, 32-bit)
# A key or a length takes at most 5 bytes (protobuf refuses longer ones), a value 10.
KEY_BYTES, VALUE_BYTES = 5, 10
# Past this many fields the walk gives up and protobuf parses the message whole: a request
# has a handful of fields and at most a few hundred images, and a message of millions of
# tiny fields would hold the event loop for seconds in Python where protobuf's C parser
# takes milliseconds.
MAX_FIELDS = 4096


class ImageSpans(Sequence[bytes]):
    __slots__ = ("_message", "_spans")

    def __init__(self, message: bytes, spans: tuple[tuple[int, int], ...]) -> None:
        self._message = message
        self._spans = spans

    def __len__(self) -> int:
        return len(self._spans)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        start, end = self._spans[index]
        return self._message[start:end]

    def __iter__(self) -> Iterator[bytes]:
        return (self._message[start:end] for start, end in self._spans)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ImageSpans({len(self)} images, {len(self._message)} bytes of message)"

    def __reduce__(self):  # through a Serve handle: a plain tuple on the other side
        return tuple, (tuple(self),)

    def views(self) -> list[memoryview]:
        message = memoryview(self._message)
        return [message[start:end] for start, end in self._spans]


def pick(images: Sequence[bytes], positions: Sequence[int]) -> Sequence[bytes]:
    """The images at `positions`, in that order, without copying them."""
    if isinstance(images, ImageSpans):
        return ImageSpans(images._message, tuple(images._spans[p] for p in positions))
    return tuple(images[p] for p in positions)


def buffers(images: Sequence[bytes]) -> Sequence[bytes | memoryview]:
    """`images` without copying them: views of a message's spans, or the bytes themselves."""
    return images.views() if isinstance(images, ImageSpans) else images


def split_images(message: bytes, field: int) -> tuple[bytes, ImageSpans] | None:
    """(`message` without its `field` entries, those entries' values as spans), for a
    length-delimited repeated field; None where `message` is not well-formed wire format
    (parse it whole then: protobuf says what is wrong)."""
    rest: list[bytes] = []
    spans: list[tuple[int, int]] = []
    position, end = 0, len(message)
    while position < end:
        if len(rest) + len(spans) == MAX_FIELDS:
            return None
        start = position
        key, position = _varint(message, position, KEY_BYTES)
        if position < 0 or key >> 3 == 0 or key > 0xFFFFFFFF:
            return None
        kind = key & 7
        if kind == 0:
            _, position = _varint(message, position, VALUE_BYTES)
        elif kind in _FIXED:
            position += _FIXED[kind]
        elif kind == LENGTH_DELIMITED:
            length, position = _varint(message, position, KEY_BYTES)
            if position < 0 or position + length > end:
                return None
            if key >> 3 == field:
                spans.append((position, position + length))
                position += length
                continue
            position += length
        else:  # groups (proto2) or not wire format at all
            return None
        if position < 0 or position > end:
            return None
        rest.append(message[start:position])
    return b"".join(rest), ImageSpans(message, tuple(spans))


def _varint(data: bytes, position: int, most: int) -> tuple[int, int]:
    """(value, position after it); position -1 where `data` ends inside it or it runs past
    `most` bytes."""
    if position < len(data) and data[position] < 0x80:  # most keys and small values
        return data[position], position + 1
    value = shift = 0
    for index in range(position, min(position + most, len(data))):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, index + 1
        shift += 7
    return 0, -1
