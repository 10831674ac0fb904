"""Embeddings on a GPU: the torch-CUDA engine (FP16, CUDA graphs capturing both outputs) in a
replica with the three stages, against the FP32 torch model; nvJPEG's crops; and a model from
before embeddings on torch-CUDA."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from support import batch_of

from raystream.v1 import classifier_pb2 as pb
from serve_app.config import STAGES, AppConfig, BatchingConfig, EngineConfig
from serve_app.core.messages import Batch, Job
from serve_app.pipeline.topology import StageGroup

from conftest import cosines

HAS_CUDA = torch.cuda.is_available()
HAS_GPU_DECODE = HAS_CUDA and importlib.util.find_spec("torchvision") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
PHOTOS = ("chelsea", "coffee", "astronaut", "rocket")


async def _group(model_repository, **config) -> StageGroup:
    group = await StageGroup.create(
        AppConfig(
            model_repository=model_repository,
            engine=EngineConfig(kind="torch-cuda", precision="fp16", batch_capacity=64),
            **config,
        ),
        STAGES,
    )
    group.reconfigure(BatchingConfig(max_batch_size=64).model_dump())
    return group


def _vectors(response: pb.ClassifyResponse) -> np.ndarray:
    return np.array([r.embedding.values for r in response.results if not r.error.code])


async def test_torch_cuda_fp16_vectors_match_the_fp32_torch_model(
    model_repository, photos, torch_embedding
) -> None:
    """cosine >= 0.999 against FP32 torch, norm 1, in one engine batch of 45 images (the
    bucket planner runs it as several graphs or one padded), beside a labels-only request
    and a bad image."""
    group = await _group(model_repository)
    assert group.info().engine.embedding_dim == 1280
    images = [photos[name] for name in PHOTOS]
    many = images * 9 + images[:1]  # 37
    jobs = (
        Job(id="e", images=(*images, b"junk"), labels=False, embedding=True),
        Job(id="l", images=tuple(images), top_k=1),
        Job(id="many", images=tuple(many), top_k=1, embedding=True),
    )
    answers = await group.run(Batch(jobs=jobs))
    embedding, labels, both = (pb.ClassifyResponse.FromString(a.payload) for a in answers)
    assert [r.error.code for r in embedding.results] == [0, 0, 0, 0, 3]
    assert all(not r.labels for r in embedding.results)
    assert all(r.labels and not r.HasField("embedding") for r in labels.results)
    expected = torch_embedding(images)
    got = _vectors(embedding)
    assert got.shape == (4, 1280)
    assert cosines(got, expected).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    vectors = _vectors(both)
    assert vectors.shape == (37, 1280) and all(r.labels for r in both.results)
    assert cosines(vectors, torch_embedding(many)).min() >= 0.999


@pytest.mark.skipif(not HAS_GPU_DECODE, reason="needs torchvision (nvJPEG)")
async def test_nvjpeg_crops_give_each_photo_its_own_vector(
    model_repository, photos, torch_embedding
) -> None:
    """decode: gpu: nvJPEG's crops differ from PIL's by a few grey levels, so each photo's
    vector is nearest the FP32 torch vector of the same photo, and of norm 1."""
    group = await _group(model_repository, decode="gpu")
    images = [photos[name] for name in PHOTOS]
    (answer,) = await group.run(
        Batch(jobs=(Job(id="g", images=tuple(images), labels=False, embedding=True),))
    )
    got = _vectors(pb.ClassifyResponse.FromString(answer.payload))
    similarity = got @ torch_embedding(images).T
    assert (similarity.argmax(axis=1) == np.arange(len(images))).all(), similarity
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


async def test_a_model_from_before_embeddings_serves_labels_on_torch_cuda(
    model, tmp_path, photos
) -> None:
    """A torch.export program with the logits only (export format 1) loads; the engine
    reports embedding_dim 0 and the replica answers labels."""
    from engines.export import EXPORTABLE
    from engines.repository import SPEC_FILE, TORCH_FILE

    target = tmp_path / model.spec.name / "1"
    target.mkdir(parents=True)
    plain = EXPORTABLE["efficientnet-lite0"].build().eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(
        plain, (torch.zeros(2, 3, 224, 224),), dynamic_shapes=({0: batch},)
    )
    torch.export.save(program, str(target / TORCH_FILE))
    spec = json.loads(model.spec.to_json())
    for key in ("export_format", "embedding_dim", "weights_sha256", "program_sha256"):
        del spec[key]
    (target / SPEC_FILE).write_text(json.dumps({**spec, "version": "1"}))
    group = await _group(tmp_path)
    info = group.info()
    assert info.engine.embedding_dim == 0 and info.embedding_space == ""
    (answer,) = await group.run(batch_of([photos["chelsea"]]))
    result = pb.ClassifyResponse.FromString(answer.payload).results[0]
    assert result.labels[0].class_id in range(281, 286) and not result.HasField("embedding")
