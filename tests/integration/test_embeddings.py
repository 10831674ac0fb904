"""Embeddings end to end: real Ray Serve in each topology, real photos, the real model; the
served vectors against the torch model run directly, what they mean, per-image errors, the
Python client, and `raystream embed` / `raystream similar` as a user runs them."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support import run_cli

from clients.client import Client
from raystream.v1 import classifier_pb2 as pb

from conftest import cosines, encode, start_app

pytestmark = pytest.mark.slow
INVALID_ARGUMENT = 3
# Real photos of distinct subjects, textures among them (scikit-image, bundled)
TEST_SET = (
    "chelsea",
    "coffee",
    "astronaut",
    "rocket",
    "camera",
    "coins",
    "hubble_deep_field",
    "immunohistochemistry",
    "moon",
    "brick",
    "grass",
    "gravel",
    "clock",
    "colorwheel",
)


@pytest.fixture(scope="module")
def test_set() -> dict[str, bytes]:
    from skimage import data

    return {name: encode(getattr(data, name)(), quality=95) for name in TEST_SET}


def altered(image: bytes) -> bytes:
    """The same photo as another site would hold it: 60% of its size, JPEG quality 60."""
    with Image.open(io.BytesIO(image)) as opened:
        small = opened.convert("RGB").resize(
            (opened.width * 3 // 5, opened.height * 3 // 5), Image.BILINEAR
        )
    buffer = io.BytesIO()
    small.save(buffer, "JPEG", quality=60)
    return buffer.getvalue()


async def _embed(server: str, items) -> dict:
    async with Client(server) as client:
        return {r.key: r async for r in client.embed(items, batch_size=5)}


async def _stream(server: str, requests: list[pb.ClassifyRequest]) -> dict:
    async with Client(server) as client:
        return {r.request_id: r async for r in client.stream(requests)}


async def test_served_vectors_are_the_torch_models(server, photos, model, torch_embedding):
    async with Client(server) as client:
        info = await client.model_info()
    assert info.embedding_dim == 1280 and info.embedding_space == model.spec.embedding_space
    assert info.embedding_space.startswith(f"efficientnet-lite0/{info.version}/sha256:")
    names = sorted(photos)
    results = await _embed(server, [(name, photos[name]) for name in names])
    assert all(results[name].ok for name in names)
    served = np.stack([results[name].vector for name in names])
    assert served.shape == (4, 1280) and served.dtype == np.float32
    assert cosines(served, torch_embedding([photos[n] for n in names])).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)


async def test_an_altered_copy_is_nearest_its_original(server, test_set) -> None:
    """The same photo resized and re-encoded scores a higher cosine with its original than
    with any other photo of the set."""
    originals = await _embed(server, list(test_set.items()))
    copies = await _embed(server, [(name, altered(data)) for name, data in test_set.items()])
    names = list(test_set)
    o = np.stack([originals[n].vector for n in names])
    c = np.stack([copies[n].vector for n in names])
    similarity = c @ o.T  # vectors of norm 1: the dot product is the cosine
    for i, name in enumerate(names):
        others = np.delete(similarity[i], i)
        assert similarity[i, i] > others.max(), (name, similarity[i, i], others.max())


async def test_a_bad_image_fails_alone_in_an_embedding_request(server, photos) -> None:
    chelsea = photos["chelsea"]
    images = [chelsea, chelsea[: len(chelsea) // 3], b"junk" + os.urandom(2044), photos["coffee"]]
    embedding_only = [pb.EMBEDDING]
    responses = await _stream(
        server,
        [
            pb.ClassifyRequest(request_id="mixed", images=images, outputs=embedding_only),
            pb.ClassifyRequest(request_id="after", images=[chelsea], outputs=embedding_only),
        ],
    )
    mixed = responses["mixed"]
    assert mixed.error.code == 0
    assert [r.error.code for r in mixed.results] == [0, INVALID_ARGUMENT, INVALID_ARGUMENT, 0]
    assert "truncated" in mixed.results[1].error.message
    for result in mixed.results:
        assert not result.labels
        assert result.HasField("embedding") == (result.error.code == 0)
    good = [np.array(r.embedding.values) for r in mixed.results[::3]]
    assert [len(v) for v in good] == [1280, 1280]
    after = np.array(responses["after"].results[0].embedding.values)
    assert cosines(after[None], good[0][None])[0] >= 0.9999


async def test_labels_and_embedding_in_one_request(server, photos) -> None:
    images = [photos["chelsea"], photos["rocket"]]
    responses = await _stream(
        server,
        [
            pb.ClassifyRequest(request_id="labels", images=images, top_k=3),
            pb.ClassifyRequest(
                request_id="both", images=images, top_k=3, outputs=[pb.LABELS, pb.EMBEDDING]
            ),
            pb.ClassifyRequest(request_id="embedding", images=images, outputs=[pb.EMBEDDING]),
        ],
    )
    labels, both, embedding = (responses[k] for k in ("labels", "both", "embedding"))
    assert all(not r.HasField("embedding") for r in labels.results)
    for mine, theirs in zip(both.results, labels.results, strict=True):
        assert [lb.class_id for lb in mine.labels] == [lb.class_id for lb in theirs.labels]
    vectors = [np.array([r.embedding.values for r in x.results]) for x in (both, embedding)]
    assert cosines(*vectors).min() >= 0.9999


async def test_an_unknown_output_is_a_bad_request(server, photos) -> None:
    responses = await _stream(
        server, [pb.ClassifyRequest(request_id="r", images=[photos["chelsea"]], outputs=[5])]
    )
    error = responses["r"].error
    assert error.code == INVALID_ARGUMENT and "unknown output 5" in error.message


# -- the CLI, as a user runs it ---------------------------------------------------------------


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory, test_set) -> Path:
    """A folder of the test photos and a file that is not an image, as a user's catalogue."""
    folder = tmp_path_factory.mktemp("catalogue")
    for name, data in test_set.items():
        (folder / f"{name}.jpg").write_bytes(data)
    (folder / "broken.jpg").write_bytes(b"not an image at all")
    return folder


@pytest.mark.parametrize("server", ["fused"], indirect=True)
@pytest.mark.parametrize("fmt", ["parquet", "npy"])
def test_embed_writes_a_row_per_image_and_similar_finds_the_original(
    server, catalogue, tmp_path, model, fmt
) -> None:
    from clients.embed_command import read_vectors

    out = tmp_path / f"vectors.{fmt}"
    done = run_cli("embed", str(catalogue), "--out", str(out), "--server", server)
    assert done.returncode == 1, done.stderr  # one image failed
    assert "broken.jpg  ERROR INVALID_ARGUMENT: " in done.stdout, done.stdout
    assert f"wrote {len(TEST_SET)} vectors of 1280 floats" in done.stdout, done.stdout
    rows = read_vectors(out)
    assert sorted(Path(key).stem for key in rows.keys) == sorted(TEST_SET)
    assert rows.vectors.shape == (len(TEST_SET), 1280) and rows.vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(rows.vectors, axis=1), 1.0, atol=1e-5)
    assert set(rows.model) == {"efficientnet-lite0"} and set(rows.version) == {model.spec.version}
    assert set(rows.embedding_space) == {model.spec.embedding_space}
    if fmt == "npy":  # a plain NumPy file: no pickles
        assert np.load(out)["vector"].shape == (len(TEST_SET), 1280)

    query = tmp_path / "query.jpg"
    query.write_bytes(altered((catalogue / "coffee.jpg").read_bytes()))
    found = run_cli("similar", str(query), "--index", str(out), "-k", "3", "--server", server)
    assert found.returncode == 0, found.stderr
    header, *lines = found.stdout.strip().splitlines()
    assert header.split() == ["rank", "cosine", "key"] and len(lines) == 3
    ranks = [line.split() for line in lines]
    assert [r[0] for r in ranks] == ["1", "2", "3"]
    assert Path(ranks[0][2]).name == "coffee.jpg", found.stdout
    scores = [float(r[1]) for r in ranks]
    assert scores == sorted(scores, reverse=True) and scores[0] > 0.7


@pytest.mark.parametrize("server", ["fused"], indirect=True)
def test_similar_refuses_an_index_of_another_embedding_space(server, tmp_path, photos) -> None:
    from clients.embed_command import Vectors, write_vectors

    index = tmp_path / "old.npy"
    vector = np.eye(1, 1280, dtype=np.float32)
    write_vectors(Vectors(["a.jpg"], vector, ["m"], ["1"], ["m/1/sha256:0"]), index, "npy")
    query = tmp_path / "q.jpg"
    query.write_bytes(photos["chelsea"])
    done = run_cli("similar", str(query), "--index", str(index), "--server", server)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "embedding space m/1/sha256:0" in done.stderr and "do not compare" in done.stderr


def test_embed_and_similar_keep_to_one_model_version(
    ray_cluster, two_versions, model, catalogue, tmp_path
) -> None:
    """During a migration, two versions served: `embed --model NAME/VERSION` writes that
    version's vectors, and `similar` embeds its query with the index's version, not with
    the default (the highest), whose vectors would not compare."""
    from ray import serve

    from clients.embed_command import read_vectors

    name, new = model.spec.name, model.spec.version
    old = str(int(new) - 1)
    port, _ = start_app(
        "versions",
        two_versions,
        topology="fused",
        engine={"kind": "onnxruntime"},
        models=[{"name": name, "versions": [old, new]}],
    )
    server = f"127.0.0.1:{port}"
    try:
        photos = tmp_path / "photos"
        photos.mkdir()
        for photo in ("coffee.jpg", "chelsea.jpg", "rocket.jpg"):
            (photos / photo).write_bytes((catalogue / photo).read_bytes())
        index = tmp_path / "old.npy"
        pin = ("--model", f"{name}/{old}", "--server", server)
        done = run_cli("embed", str(photos), "--out", str(index), *pin)
        assert done.returncode == 0, done.stderr
        assert set(read_vectors(index).version) == {old}
        query = tmp_path / "query.jpg"
        query.write_bytes(altered((photos / "coffee.jpg").read_bytes()))
        found = run_cli("similar", str(query), "--index", str(index), "--server", server)
        assert found.returncode == 0, found.stderr
        assert Path(found.stdout.splitlines()[1].split()[2]).name == "coffee.jpg", found.stdout
        pinned = run_cli("classify", str(photos), *pin)
        assert pinned.returncode == 0, pinned.stderr
        missing = run_cli("classify", str(photos), "--model", f"{name}/99", "--server", server)
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stdout, missing.stdout
    finally:
        serve.delete("versions")


async def test_fp16_vectors_on_both_apis_are_the_fp32_ones_in_half_the_bytes(
    server, test_set
) -> None:
    """raystream.v1's embedding_dtype FLOAT16 and OIP's `embedding_fp16` output: the same
    vectors as halves, cosine >= 0.9999 to FP32, half the bytes of the answer's vectors."""
    import grpc

    from raystream.oip import grpc_predict_v2_pb2 as oip
    from raystream.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    names = sorted(test_set)
    items = [(name, test_set[name]) for name in names]
    async with Client(server) as client:
        full = {r.key: r async for r in client.embed(items, batch_size=7)}
        half = {r.key: r async for r in client.embed(items, batch_size=7, fp16=True)}
    f32 = np.stack([full[n].vector for n in names])
    f16 = np.stack([half[n].vector for n in names])
    assert f32.dtype == np.float32 and f16.dtype == np.float16
    assert cosines(f16.astype(np.float32), f32).min() >= 0.9999
    request = pb.ClassifyRequest(images=[test_set["chelsea"]], outputs=[pb.EMBEDDING])
    sizes = []
    for dtype in (pb.FLOAT32, pb.FLOAT16):
        request.embedding_dtype = dtype
        answers = await _stream(server, [request])
        sizes.append(len(answers[""].results[0].embedding.SerializeToString()))
    assert sizes[1] <= sizes[0] // 2 + 8
    bad = pb.ClassifyRequest(request_id="bad", images=[test_set["chelsea"]], embedding_dtype=7)
    assert (await _stream(server, [bad]))["bad"].error.code == INVALID_ARGUMENT

    oip_request = oip.ModelInferRequest(model_name="efficientnet-lite0", id="h")
    oip_request.inputs.add(name="images", datatype="BYTES", shape=[2])
    chosen = [test_set["chelsea"], test_set["coffee"]]
    oip_request.raw_input_contents.append(
        b"".join(len(i).to_bytes(4, "little") + i for i in chosen)
    )
    for name in ("embedding", "embedding_fp16"):
        oip_request.outputs.add(name=name)
    async with grpc.aio.insecure_channel(server) as channel:
        reply = await oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(oip_request)
    assert [o.datatype for o in reply.outputs] == ["FP32", "FP16"]
    o32 = np.frombuffer(reply.raw_output_contents[0], "<f4").reshape(2, -1)
    o16 = np.frombuffer(reply.raw_output_contents[1], "<f2").reshape(2, -1)
    assert len(reply.raw_output_contents[1]) * 2 == len(reply.raw_output_contents[0])
    assert cosines(o16.astype(np.float32), o32).min() >= 0.9999
