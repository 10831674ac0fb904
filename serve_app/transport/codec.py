"""The bytes of a stage call over a port (serve_app/transport/stage_port.py), and of its
answer: a msgpack header whose few tagged maps stand for what msgpack has no type for, then
the arrays' raw bytes; never pickle.

Only what a stage call carries can be read back, and only as data:

- the message dataclasses of serve_app/core/messages.py and SharedImages, by a name from
  `_MESSAGES` and their fields in order (no other class is ever built);
- numpy arrays of the dtypes in `_DTYPES`, as dtype, shape and where their raw bytes lie
  after the header (the message is the header's length, the header, then the arrays);
- a stage's exception as its gRPC code, its one-line message and whether a replica was lost,
  rebuilt as the same class where it is one of raystream's own (`_EXCEPTIONS`), else as
  `errors.StageError`;
- crops on the GPU as the fields of a CUDA IPC handle (serve_app/transport/device_crops.py);
- msgpack's own types; every array becomes a tuple.

Anything else fails to encode (a bug: the stage's answer becomes an INTERNAL error) or to
decode (CodecError: the call fails INTERNAL). So a peer that passed the link's handshake can
send wrong data, at worst, and never make a replica run code.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import msgpack
import numpy as np

from engines.images import InvalidImage
from serve_app import errors
from serve_app.core.messages import Answer, Batch, Failure, Job, OipOutput, StageTiming
from serve_app.transport import device_crops
from serve_app.transport.shared_images import SharedImages, SharedImagesMissing
from serve_app.wire.request_images import ImageSpans

# Each value that msgpack has no type for travels as a map tagged by one of these keys
# (no field of a message is a map with string keys, so none can pass for one).
_ARRAY, _MESSAGE, _ERROR, _CUDA = "\0array", "\0message", "\0error", "\0cuda"
_MESSAGES: dict[str, type] = {
    cls.__name__: cls for cls in (Answer, Batch, Failure, Job, OipOutput, StageTiming, SharedImages)
}
_FIELDS = {name: tuple(f.name for f in dataclasses.fields(cls)) for name, cls in _MESSAGES.items()}
_DTYPES = frozenset(
    {"bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"}
    | {"float16", "float32", "float64"}
)
# The exceptions that arrive as themselves (raystream's own, each made from its message);
# any other arrives as errors.StageError, with its code.
_EXCEPTIONS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        *(errors.InvalidArgument, errors.ModelNotFound, errors.DuplicateRequest),
        *(errors.Overloaded, errors.StageBusy, errors.DeadlineExceeded, errors.Unavailable),
        InvalidImage,
        *(SharedImagesMissing, device_crops.CropsNotHere),
    )
}


_HEADER = struct.Struct("<I")  # the msgpack header's length; the arrays' bytes follow it


class CodecError(ValueError):
    """Bytes that are not a stage call or answer of this codec."""


def dumps(obj: Any) -> list[bytes | memoryview]:
    """`obj` as the parts of one message, to be sent one after another: the length of the
    msgpack header, the header, then each array's raw bytes (never copied here: a batch's
    crops go from the array to the socket)."""
    arrays: list[memoryview] = []

    def encode(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            if value.dtype.name not in _DTYPES:
                raise TypeError(f"arrays of {value.dtype} do not travel over a stage port")
            raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8).data
            offset = sum(len(a) for a in arrays)
            arrays.append(raw)
            return {_ARRAY: value.dtype.name, "shape": value.shape, "at": (offset, len(raw))}
        return _encode(value)

    header = msgpack.packb(obj, default=encode, use_bin_type=True)
    return [_HEADER.pack(len(header)), header, *arrays]


def loads(message: bytes | memoryview) -> Any:
    """The object of one message of `dumps`'s parts; arrays are views of `message`."""
    view = memoryview(message)
    try:
        (size,) = _HEADER.unpack_from(view)
        header, raw = view[_HEADER.size : _HEADER.size + size], view[_HEADER.size + size :]
        return msgpack.unpackb(
            header,
            object_hook=lambda tagged: _decode(tagged, raw),
            raw=False,
            use_list=False,
            strict_map_key=False,
        )
    except (CodecError, device_crops.CropsNotHere):
        raise
    except Exception as exc:  # msgpack's own errors, a field of the wrong kind
        raise CodecError(f"not a stage message: {type(exc).__name__}: {exc}") from None


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    name = type(obj).__name__
    if _MESSAGES.get(name) is type(obj):
        return {_MESSAGE: name, "values": tuple(obj.__dict__[field] for field in _FIELDS[name])}
    if isinstance(obj, ImageSpans):
        return obj.views()  # packed as bytes, straight from the received message
    if isinstance(obj, BaseException):
        return {_ERROR: _error_fields(obj)}
    if device_crops.is_cuda_tensor(obj):
        return {_CUDA: device_crops.handle(obj)}
    raise TypeError(f"{name} does not travel over a stage port")


def _error_fields(exc: BaseException) -> tuple[str, int, str, bool]:
    name = type(exc).__name__
    kind = name if _EXCEPTIONS.get(name) is type(exc) else ""
    message = str(exc) if kind else errors.message_for(exc)
    return kind, int(errors.code_for(exc)), message, errors.replica_lost(exc)


def _decode(tagged: dict, raw: memoryview) -> Any:
    if _ARRAY in tagged:
        dtype, shape, (offset, size) = tagged[_ARRAY], tagged["shape"], tagged["at"]
        if dtype not in _DTYPES or not all(type(n) is int and n >= 0 for n in shape):
            raise CodecError(f"an array of {str(dtype)[:20]!r}, shape {str(shape)[:40]}")
        if not (offset >= 0 and offset + size <= len(raw)):
            raise CodecError(f"an array's bytes past the message: {offset}+{size}")
        array = np.frombuffer(raw[offset : offset + size], dtype)
        return array.reshape(shape)  # a size that is not the shape's: ValueError
    if _MESSAGE in tagged:
        name, values = tagged[_MESSAGE], tagged["values"]
        cls = _MESSAGES.get(name) if isinstance(name, str) else None
        if cls is None or len(values) != len(_FIELDS[name]):
            raise CodecError(f"not a stage message: {str(name)[:40]!r}")
        message = object.__new__(cls)  # as messages.copied does: no __post_init__ again
        message.__dict__.update(zip(_FIELDS[name], values, strict=True))
        if cls is Batch:  # maps the stages fill in
            message.__dict__["image_failures"] = dict(message.image_failures)
            message.__dict__["job_failures"] = dict(message.job_failures)
        return message
    if _ERROR in tagged:
        kind, status, text, lost = tagged[_ERROR]
        if kind:
            return _EXCEPTIONS[kind](str(text))
        return errors.StageError(int(status), str(text), replica_lost=bool(lost))
    if _CUDA in tagged:
        return device_crops.open_handle(tagged[_CUDA])
    return tagged  # a plain map: Batch's failures by (job, image) or by job
