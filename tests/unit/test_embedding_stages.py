"""Embeddings without Ray or gRPC: the model files' two outputs, what the stages compute and
carry for each kind of request, the v1 and OIP answers, and models from before embeddings.
The three stages' real code, chained in-process, on the real model (ONNX Runtime)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engines import EngineError, create_engine
from engines import scores as postprocessing
from engines.export import is_current
from engines.repository import EXPORT_FORMAT, ModelSpec, resolve
from raystream.oip import grpc_predict_v2_pb2 as oip
from raystream.v1 import classifier_pb2 as pb
from serve_app.config import STAGES, AppConfig, EngineConfig
from serve_app.core.messages import Batch, Job, OipOutput
from serve_app.core.serving import ServingCore
from serve_app.errors import InvalidArgument
from serve_app.pipeline.topology import StageGroup
from serve_app.protocol import v1
from serve_app.protocol.oip import OpenInferenceService
from serve_app.protocol.streams import StreamRunner
from serve_app.wire.answers import embedding_bytes

from conftest import cosines

INVALID_ARGUMENT = 3


@pytest.fixture(scope="module")
async def group(model_repository) -> StageGroup:
    """All three stages in one group (topology fused, as direct runs them too)."""
    config = AppConfig(model_repository=model_repository, engine=EngineConfig(kind="onnxruntime"))
    return await StageGroup.create(config, STAGES)


def test_the_exported_model_has_both_outputs(model) -> None:
    spec = model.spec
    assert spec.export_format == EXPORT_FORMAT and spec.embedding_dim == 1280
    assert len(spec.weights_sha256) == 64
    assert (
        spec.embedding_space
        == f"efficientnet-lite0/{spec.version}/sha256:{spec.weights_sha256[:16]}"
    )
    with create_engine("onnxruntime", model, max_batch_size=2) as engine:
        out = engine.infer(np.zeros((2, 3, 224, 224), np.float32))
    assert out.logits.shape == (2, 1000) and out.embedding.shape == (2, 1280)
    assert engine.info.embedding_dim == 1280


def test_the_embedding_space_changes_with_model_version_and_weights(model) -> None:
    from dataclasses import replace

    spec = model.spec
    others = [
        replace(spec, name="other"),
        replace(spec, version=spec.version + "0"),
        replace(spec, weights_sha256="0" * 64),
    ]
    spaces = {spec.embedding_space, *(other.embedding_space for other in others)}
    assert len(spaces) == 4
    assert replace(spec, embedding_dim=0).embedding_space == ""


async def _answers(group: StageGroup, *jobs: Job) -> list[pb.ClassifyResponse]:
    answers = await group.run(Batch(jobs=jobs))
    assert all(a.code == 0 for a in answers), [a.message for a in answers]
    return [pb.ClassifyResponse.FromString(a.payload) for a in answers]


async def test_each_request_gets_what_it_asked_for_from_one_batch(
    group, photos, torch_embedding
) -> None:
    images = (photos["chelsea"], b"not an image", photos["coffee"])
    labels, embedding, both = await _answers(
        group,
        Job(id="labels", images=images, top_k=3),
        Job(id="embedding", images=images, labels=False, embedding=True),
        Job(id="both", images=images, top_k=2, embedding=True),
    )
    expected = torch_embedding([photos["chelsea"], photos["coffee"]])
    for response in (labels, embedding, both):
        assert [r.error.code for r in response.results] == [0, INVALID_ARGUMENT, 0]
        assert not response.results[1].HasField("embedding") and not response.results[1].labels
    assert all(len(r.labels) == 3 and not r.HasField("embedding") for r in labels.results[::2])
    assert all(not r.labels and r.HasField("embedding") for r in embedding.results[::2])
    assert all(len(r.labels) == 2 and r.HasField("embedding") for r in both.results[::2])
    for response in (embedding, both):
        got = np.array([r.embedding.values for r in response.results[::2]], np.float32)
        assert got.shape == (2, 1280)
        assert cosines(got, expected).min() >= 0.9999
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # the labels of a request that asked for both are those of a labels-only request
    assert [lb.class_id for lb in both.results[0].labels] == [
        lb.class_id for lb in labels.results[0].labels[:2]
    ]


async def test_an_embedding_request_costs_no_softmax(group, photos, monkeypatch) -> None:
    """The softmax runs on the rows of requests that asked for labels only."""
    rows: list[int] = []
    real = postprocessing.top_k_softmax

    def counted(logits, k):
        rows.append(len(logits))
        return real(logits, k)

    monkeypatch.setattr(postprocessing, "top_k_softmax", counted)
    images = (photos["chelsea"], photos["coffee"], photos["rocket"])
    await _answers(group, Job(id="e", images=images, labels=False, embedding=True))
    assert rows == []
    await _answers(
        group,
        Job(id="e", images=images, labels=False, embedding=True),
        Job(id="l", images=images[:1]),
    )
    assert rows == [1]


async def test_labels_only_batches_carry_no_embeddings(group, photos) -> None:
    batch = Batch(jobs=(Job(id="l", images=(photos["chelsea"],)),))
    for stage in (group.model("").preprocess, group.model("").inference):
        batch = await stage.run(batch)
    assert batch.embeddings is None and batch.top_ids is not None
    batch = Batch(jobs=(Job(id="e", images=(photos["chelsea"],), labels=False, embedding=True),))
    for stage in (group.model("").preprocess, group.model("").inference):
        batch = await stage.run(batch)
    assert batch.embeddings.shape == (1, 1280) and batch.top_ids is None


async def test_oip_embedding_output(group, photos, torch_embedding) -> None:
    outputs = (OipOutput("embedding", "embedding"), OipOutput("labels", "labels", 2))
    job = Job(
        id="o",
        images=(photos["coffee"], photos["rocket"]),
        top_k=2,
        embedding=True,
        protocol="oip",
        oip_outputs=outputs,
    )
    (answer,) = await group.run(Batch(jobs=(job,)))
    response = oip.ModelInferResponse.FromString(answer.payload)
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("embedding", "FP32", [2, 1280]),
        ("labels", "BYTES", [2, 2]),
    ]
    got = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(2, 1280)
    assert cosines(got, torch_embedding([photos["coffee"], photos["rocket"]])).min() >= 0.9999


def test_v1_outputs_default_to_labels_and_refuse_unknown_values() -> None:
    assert v1.outputs([]) == (True, False)
    assert v1.outputs([pb.OUTPUT_UNSPECIFIED]) == (True, False)
    assert v1.outputs([pb.EMBEDDING]) == (False, True)
    assert v1.outputs([pb.EMBEDDING, pb.LABELS]) == (True, True)
    with pytest.raises(InvalidArgument, match=r"unknown output 7; outputs: LABELS \(1\)"):
        v1.outputs([pb.LABELS, 7])


def test_oip_ranks_classes_only_for_outputs_that_have_them() -> None:
    """Triton's `classification` parameter on any output name returns labels; the embedding
    has no classes to rank, so it is refused, not answered with labels under its name."""
    from serve_app.protocol.oip import _outputs

    request = oip.ModelInferRequest()
    for name in ("probabilities", "top"):
        request.outputs.add(name=name).parameters["classification"].int64_param = 3
    assert [(o.name, o.kind, o.k) for o in _outputs(request, 1280)] == [
        ("probabilities", "labels", 3),
        ("top", "labels", 3),
    ]
    request.outputs.add(name="embedding").parameters["classification"].int64_param = 3
    with pytest.raises(InvalidArgument, match="'embedding' has no classes to rank"):
        _outputs(request, 1280)


def test_embedding_bytes_parse_as_the_values() -> None:
    vector = np.random.default_rng(0).normal(size=1280).astype(np.float32)
    parsed = pb.Embedding.FromString(embedding_bytes(vector))
    np.testing.assert_array_equal(np.array(parsed.values, np.float32), vector)
    assert pb.Embedding(values=vector.tolist()).SerializeToString() == embedding_bytes(vector)


# -- models exported before embeddings ---------------------------------------------------


def test_a_model_from_before_embeddings_loads_labels_only(labels_only_repository) -> None:
    ref = resolve(labels_only_repository, "efficientnet-lite0")
    assert ref.spec.export_format == 1 and ref.spec.embedding_dim == 0
    assert ref.spec.embedding_space == ""
    assert not is_current(labels_only_repository, "efficientnet-lite0")
    with create_engine("onnxruntime", ref, max_batch_size=2) as engine:
        out = engine.infer(np.zeros((2, 3, 224, 224), np.float32))
    assert engine.info.embedding_dim == 0
    assert out.logits.shape == (2, 1000) and out.embedding.shape == (2, 0)


def test_a_model_json_that_disagrees_with_its_onnx_file_is_refused(
    labels_only_repository, tmp_path
) -> None:
    ref = resolve(labels_only_repository, "efficientnet-lite0")
    spec = json.loads(ref.spec.to_json()) | {"export_format": 2, "embedding_dim": 1280}
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").symlink_to(ref.onnx_path)
    (tmp_path / "m" / "1" / "model.json").write_text(json.dumps(spec | {"name": "m"}))
    with pytest.raises(EngineError, match=r"outputs \['logits'\], its model.json says"):
        create_engine("onnxruntime", resolve(tmp_path, "m"))


async def test_a_model_from_before_embeddings_refuses_embedding_requests(
    labels_only_repository, photos
) -> None:
    config = AppConfig(
        model_repository=labels_only_repository, engine=EngineConfig(kind="onnxruntime")
    )
    group = await StageGroup.create(config, STAGES)
    core = ServingCore(config, group.info(), group.run)
    assert group.info().embedding_space == ""
    # raystream.v1: the request is answered at once, INVALID_ARGUMENT
    answered = []
    request = pb.ClassifyRequest(request_id="e", images=[photos["chelsea"]], outputs=[2])
    service = v1.ClassifierService(core, StreamRunner(8))
    service._start(request, tuple(request.images), answered.append, None, "f", "s")
    (refused,) = [pb.ClassifyResponse.FromString(a.payload) for a in answered]
    assert refused.error.code == INVALID_ARGUMENT and not refused.results
    assert "has no embedding output" in refused.error.message
    # OIP: the same refusal, and ModelMetadata-style listings leave it out
    oip_request = oip.ModelInferRequest(model_name="efficientnet-lite0", id="o")
    oip_request.inputs.add(name="images", datatype="BYTES", shape=[1])
    oip_request.inputs[0].contents.bytes_contents.append(photos["chelsea"])
    oip_request.outputs.add(name="embedding")
    with pytest.raises(InvalidArgument, match="has no embedding output"):
        OpenInferenceService(core, StreamRunner(8))._job(oip_request, None, "f")
    # labels as ever
    (response,) = await _answers(group, Job(id="l", images=(photos["chelsea"],), top_k=1))
    assert response.results[0].labels[0].class_id in range(281, 286)


def test_model_json_from_before_embeddings_reads_as_format_1(model) -> None:
    raw = json.loads(model.spec.to_json())
    for key in ("export_format", "embedding_dim", "weights_sha256"):
        del raw[key]
    spec = ModelSpec.from_json(json.dumps(raw))
    assert (spec.export_format, spec.embedding_dim, spec.weights_sha256) == (1, 0, "")


def test_export_if_missing_adds_a_version_to_a_repository_from_before_embeddings(
    labels_only_repository, tmp_path, capsys
) -> None:
    """`make model` (export --if-missing) on a repository whose newest version predates
    embeddings exports a new version, which the server then serves by default; once it
    exists, it does nothing."""
    import shutil

    from clients.cli import main

    repository = tmp_path / "models"
    shutil.copytree(labels_only_repository, repository)
    args = ["export", "--repository", str(repository), "--if-missing", "--onnx-only"]
    assert main(args) == 0
    assert "has no embedding output (an older export format)" in capsys.readouterr().out
    newest = resolve(repository, "efficientnet-lite0")
    assert newest.spec.version == "2" and newest.spec.embedding_dim == 1280
    assert is_current(repository, "efficientnet-lite0")
    assert main(args) == 0
    assert "is in" in capsys.readouterr().out
    assert resolve(repository, "efficientnet-lite0").spec.version == "2"
