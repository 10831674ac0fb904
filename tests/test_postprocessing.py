"""Softmax and top-k against reference implementations (scipy, full sort)."""

import numpy as np
from scipy.special import softmax as scipy_softmax

from serve_app.postprocessing import labels_for, softmax, top_k


def test_softmax_matches_scipy() -> None:
    logits = np.random.default_rng(0).normal(0, 10, (5, 1000)).astype(np.float32)
    np.testing.assert_allclose(
        softmax(logits), scipy_softmax(logits.astype(np.float64), axis=1), rtol=1e-5, atol=1e-7
    )


def test_softmax_is_stable_for_large_logits() -> None:
    probs = softmax(np.array([[1000.0, 1000.0, -1000.0]], np.float32))
    np.testing.assert_allclose(probs, [[0.5, 0.5, 0.0]])


def test_top_k_matches_full_sort() -> None:
    probs = softmax(np.random.default_rng(1).normal(size=(7, 1000)).astype(np.float32))
    for k in (1, 5, 1000):
        ids, scores = top_k(probs, k)
        expected = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, expected)
        np.testing.assert_array_equal(scores, np.take_along_axis(probs, expected, axis=1))


def test_labels_carry_names_and_probabilities() -> None:
    logits = np.array([[0.0, 3.0, 1.0]], np.float32)
    (labels,) = labels_for(logits, 2, ["a", "b", "c"])
    assert [(lb.class_id, lb.name) for lb in labels] == [(1, "b"), (2, "c")]
    assert abs(labels[0].score - float(softmax(logits)[0, 1])) < 1e-7
    assert labels_for(np.empty((0, 3), np.float32), 2, ["a", "b", "c"]) == []


def test_labels_agree_with_softmax_and_top_k() -> None:
    """labels_for computes the softmax for the winners only: same ids, same scores."""
    logits = (np.random.default_rng(2).normal(size=(9, 1000)) * 4).astype(np.float32)
    names = [str(i) for i in range(1000)]
    for k in (1, 5, 1000):
        ids, scores = top_k(softmax(logits), k)
        labels = labels_for(logits, k, names)
        np.testing.assert_array_equal([[lb.class_id for lb in row] for row in labels], ids)
        np.testing.assert_allclose(
            [[lb.score for lb in row] for row in labels], scores, rtol=1e-5, atol=1e-7
        )


def test_postprocess_gives_every_class_score_only_when_asked() -> None:
    """The Open Inference Protocol's `probabilities` output: a softmax row per good image
    (not a Label per class), failures keep their place and get none."""
    from serve_app.messages import ImageFailure, Inferred, StageTiming
    from serve_app.stages import postprocess

    logits = np.random.default_rng(2).normal(0, 3, (2, 10)).astype(np.float32)
    failure = ImageFailure(index=1, code=3, message="not an image")
    inferred = Inferred(3, logits, (0, 2), (failure,), StageTiming())
    names = tuple(f"class{i}" for i in range(10))
    with_scores = postprocess(inferred, 2, names, scores=True).outcomes
    np.testing.assert_allclose(with_scores[0].scores, softmax(logits)[0], rtol=1e-6)
    np.testing.assert_allclose(with_scores[2].scores, softmax(logits)[1], rtol=1e-6)
    assert with_scores[1].scores is None and with_scores[1].failure == failure
    assert with_scores[2].labels[0].class_id == logits[1].argmax()
    assert len(with_scores[2].labels) == 2
    assert all(o.scores is None for o in postprocess(inferred, 2, names).outcomes)
