from pathlib import Path

import pytest

from engines.repository import ModelNotFoundError, list_versions, resolve


def test_resolves_the_highest_version(model_repository: Path, tmp_path: Path) -> None:
    ref = resolve(model_repository, "efficientnet-lite0")
    assert ref.spec.version == list_versions(model_repository, "efficientnet-lite0")[-1]
    assert ref.onnx_path.is_file() and ref.spec.num_classes == 1000
    assert ref.spec.labels[285] == "Egyptian cat"


def test_missing_model_says_what_exists(model_repository: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"'nope' not found .* `raystream export`"):
        resolve(model_repository, "nope")
    with pytest.raises(ModelNotFoundError, match="has no version '999'"):
        resolve(model_repository, "efficientnet-lite0", "999")
