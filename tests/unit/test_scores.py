"""Softmax and top-k against reference implementations (scipy, full sort)."""

import numpy as np
from scipy.special import softmax as scipy_softmax

from engines.scores import softmax, top_k_softmax


def test_softmax_matches_scipy() -> None:
    logits = np.random.default_rng(0).normal(0, 10, (5, 1000)).astype(np.float32)
    np.testing.assert_allclose(
        softmax(logits), scipy_softmax(logits.astype(np.float64), axis=1), rtol=1e-5, atol=1e-7
    )


def test_softmax_is_stable_for_large_logits() -> None:
    probs = softmax(np.array([[1000.0, 1000.0, -1000.0]], np.float32))
    np.testing.assert_allclose(probs, [[0.5, 0.5, 0.0]])


def test_top_k_softmax_matches_a_full_sort_of_the_softmax() -> None:
    """top_k_softmax computes probabilities for the winners only: same ids and scores as
    sorting the whole softmax."""
    logits = (np.random.default_rng(2).normal(size=(9, 1000)) * 4).astype(np.float32)
    probs = softmax(logits)
    for k in (1, 5, 16, 17, 1000):  # both ways of finding the winners (16 | 17)
        ids, scores = top_k_softmax(logits, k)
        expected = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, expected)
        np.testing.assert_allclose(
            scores, np.take_along_axis(probs, expected, axis=1), rtol=1e-5, atol=1e-7
        )
    ids, scores = top_k_softmax(np.empty((0, 3), np.float32), 2)
    assert ids.shape == (0, 2) and scores.shape == (0, 2)


def test_top_k_softmax_breaks_ties_by_the_lower_class() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)
    ids, scores = top_k_softmax(logits, 3)
    np.testing.assert_array_equal(ids, [[1, 2, 4], [0, 1, 2]])
    np.testing.assert_allclose(scores[1], [0.2, 0.2, 0.2], rtol=1e-6)
