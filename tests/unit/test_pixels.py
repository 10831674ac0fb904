"""The check on client-preprocessed input (serve_app/wire/pixels.py): what it accepts, and that
each refusal is the server's InvalidArgument naming what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

from serve_app.errors import InvalidArgument
from serve_app.wire.pixels import client_pixels

SHAPE = (3, 4, 4)


def test_float32_bytes_or_values_of_the_model_shape_are_taken() -> None:
    values = np.arange(2 * 48, dtype=np.float32)
    got = client_pixels((2, *SHAPE), values.astype("<f4").tobytes(), SHAPE, "pixels")
    assert got.dtype == np.float32 and got.shape == (2, *SHAPE)
    np.testing.assert_array_equal(got.ravel(), values)
    same = client_pixels((2, *SHAPE), values, SHAPE, "pixels")
    np.testing.assert_array_equal(same, got)


@pytest.mark.parametrize(
    ("shape", "values", "says"),
    [
        ((1, *SHAPE), b"abc", "3 bytes are not float32 values"),
        ((1, 3, 5, 5), np.zeros(75, np.float32), "must have shape [N, 3, 4, 4], got [1, 3, 5, 5]"),
        ((0, *SHAPE), np.zeros(0, np.float32), "must have shape [N, 3, 4, 4]"),
        ((2, *SHAPE), np.zeros(48, np.float32), "holds 96 values, got 48"),
        ((1, *SHAPE), np.full(48, np.nan, np.float32), "NaN or inf"),
    ],
)
def test_wrong_input_is_invalid_argument_naming_the_problem(shape, values, says) -> None:
    with pytest.raises(InvalidArgument) as raised:
        client_pixels(shape, values, SHAPE, "pixels")
    assert says in str(raised.value)
