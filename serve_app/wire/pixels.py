"""The check on input a client preprocessed itself (either protocol's `pixels`): a request
check like the ingress' others, so it raises the server's InvalidArgument. The image policy
(decoding, limits, crops) is the model's, in engines/images.py."""

from __future__ import annotations

import math

import numpy as np

from serve_app.errors import InvalidArgument


def client_pixels(
    shape: tuple[int, ...], values: np.ndarray | bytes, input_shape: tuple[int, ...], name: str
) -> np.ndarray:
    """Input the client preprocessed itself (either protocol's `pixels`): float32 values
    (or their little-endian bytes) of shape (N, *input_shape), N >= 1, all finite;
    InvalidArgument names what is wrong."""
    if isinstance(values, bytes):
        if len(values) % 4:
            raise InvalidArgument(f"input {name!r}: {len(values)} bytes are not float32 values")
        values = np.frombuffer(values, dtype="<f4")
    shape = tuple(map(int, shape))
    if len(shape) != 1 + len(input_shape) or shape[1:] != tuple(input_shape) or shape[0] < 1:
        raise InvalidArgument(
            f"input {name!r} must have shape [N, {', '.join(map(str, input_shape))}], "
            f"got {list(shape)}"
        )
    if values.size != math.prod(shape):
        raise InvalidArgument(
            f"input shape {list(shape)} holds {math.prod(shape)} values, got {values.size}"
        )
    if not np.isfinite(values).all():
        raise InvalidArgument(f"input {name!r} has NaN or inf")
    return values.astype(np.float32, copy=False).reshape(shape)
