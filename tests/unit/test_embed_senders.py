"""`raystream embed --senders N`: child processes send, the parent alone writes the shards;
against a stand-in gRPC server whose vector is a function of the image's bytes."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pyarrow.parquet as pq
import pytest
from support import run_cli

from clients.shard_store import FAILURES, STATE
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as rpc

DIM = 1280


def _vector(image: bytes) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(image, digest_size=8).digest())
    vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return vector / np.linalg.norm(vector)


class _EmbedsByBytes(rpc.ImageClassifierServicer):
    """Each image's vector from its bytes; `refuse`: every stream fails with that code."""

    def __init__(self, refuse: grpc.StatusCode | None = None) -> None:
        self.refuse = refuse
        self.streams = 0

    def Classify(self, requests, context):
        self.streams += 1
        if self.refuse is not None:
            context.set_code(self.refuse)
            context.set_details("no streams for you")
            return
        for request in requests:
            results = [
                pb.ImageResult(embedding=pb.Embedding(values=_vector(image)))
                for image in request.images
            ]
            yield pb.ClassifyResponse(request_id=request.request_id, results=results)

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(
            name="m", version="1", embedding_dim=DIM, embedding_space="m/1", max_batch_size=64
        )


@pytest.fixture
def serve():
    servers = []

    def start(servicer) -> str:
        server = grpc.server(ThreadPoolExecutor(8), options=[("grpc.max_send_message_length", -1)])
        rpc.add_ImageClassifierServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def _catalog(folder, images: int, missing: tuple[int, ...] = ()):
    folder.mkdir()
    lines = ["key,path"]
    for i in range(images):
        path = folder / f"{i}.jpg"
        if i not in missing:
            path.write_bytes(f"image {i}".encode() * 20)
        lines.append(f"sku-{i},{path}")
    manifest = folder / "manifest.csv"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def _embed(manifest, out, server: str, *more: str):
    return run_cli(
        *("embed", "--manifest", str(manifest), "--key-column", "key", "--out", str(out)),
        *("--server", server, "--batch-size", "8", "--shard-rows", "700", *more),
    )


def test_senders_write_every_key_once_with_its_own_vector(tmp_path, serve) -> None:
    server = serve(_EmbedsByBytes())
    images, missing = 3_000, (5, 1_234)
    manifest = _catalog(tmp_path / "photos", images, missing)
    done = _embed(manifest, tmp_path / "out", server, "--senders", "3")
    assert done.returncode == 1, done.stderr  # the two missing files
    assert f"{images - 2} vectors of 1280 floats" in done.stdout, done.stdout

    rows: dict[str, np.ndarray] = {}
    for shard in sorted((tmp_path / "out").glob("shard-*.parquet")):
        table = pq.read_table(shard)
        assert table.num_rows <= 700
        for key, vector in zip(table["key"].to_pylist(), table["vector"].to_numpy(), strict=True):
            assert key not in rows
            rows[key] = np.asarray(vector, np.float32)
    assert sorted(rows) == sorted(f"sku-{i}" for i in range(images) if i not in missing)
    for i in (0, 1, 2, 999, 2_999):  # each key's own vector, not a neighbour's
        image = (tmp_path / "photos" / f"{i}.jpg").read_bytes()
        np.testing.assert_array_equal(rows[f"sku-{i}"], _vector(image))
    failures = [json.loads(line) for line in (tmp_path / "out" / FAILURES).read_text().split("\n")
                if line]  # fmt: skip
    assert sorted(f["key"] for f in failures) == ["sku-1234", "sku-5"]
    assert {f["code"] for f in failures} == {"NOT_FOUND"}
    assert json.loads((tmp_path / "out" / STATE).read_text())["committed"]["complete"]


def test_a_sender_that_fails_ends_the_job_with_its_error_in_one_line(tmp_path, serve) -> None:
    refusing = _EmbedsByBytes(refuse=grpc.StatusCode.PERMISSION_DENIED)
    manifest = _catalog(tmp_path / "photos", 100)
    done = _embed(manifest, tmp_path / "out", serve(refusing), "--senders", "2")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (error,) = done.stderr.strip().splitlines()
    assert error.startswith("raystream: ") and refusing.streams >= 1

    # what was done is committed and whole: a server that answers finishes the job
    again = _embed(manifest, tmp_path / "out", serve(_EmbedsByBytes()), "--senders", "3")
    assert again.returncode in (0, 1), again.stderr  # 1: images the refusals failed
    committed = json.loads((tmp_path / "out" / STATE).read_text())["committed"]
    assert committed["complete"] and committed["vectors"] + committed["failures"] == 100


def test_senders_need_an_output_folder(tmp_path) -> None:
    done = run_cli("embed", str(tmp_path), "--out", str(tmp_path / "v.npy"), "--senders", "2")
    assert done.returncode == 2 and "--senders writes an output folder" in done.stderr
