"""The vector files of `raystream embed` (Parquet and .npy) and the nearest-neighbour search of
`raystream similar`, without a server; the client side's imports stay light."""

from __future__ import annotations

import resource
import subprocess
import sys

import numpy as np
import pytest
from support import run_cli

from clients.embed_command import EmbedError, Vectors, nearest, read_vectors, write_vectors
from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as rpc

from conftest import ROOT


def _rows(n: int = 5, dim: int = 16) -> Vectors:
    vectors = np.random.default_rng(0).normal(size=(n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    keys = [f"photos/{i}-é.jpg" for i in range(n)]  # any path a folder may hold
    return Vectors(keys, vectors, ["m"] * n, ["2"] * n, ["m/2/sha256:abc"] * n)


@pytest.mark.parametrize("fmt", ["parquet", "npy"])
def test_a_vector_file_reads_back_as_written(tmp_path, fmt) -> None:
    rows = _rows()
    path = tmp_path / f"v.{fmt}"
    write_vectors(rows, path, fmt)
    back = read_vectors(path)
    assert back.keys == rows.keys and back.model == rows.model
    assert back.version == rows.version and back.embedding_space == rows.embedding_space
    assert back.vectors.dtype == np.float32
    np.testing.assert_array_equal(back.vectors, rows.vectors)


def test_a_parquet_file_has_a_column_per_field(tmp_path) -> None:
    import pyarrow.parquet as pq

    write_vectors(_rows(dim=8), tmp_path / "v.parquet", "parquet")
    table = pq.read_table(tmp_path / "v.parquet")
    assert table.column_names == ["key", "vector", "model", "version", "embedding_space"]
    vector = table.schema.field("vector").type
    assert vector.list_size == 8 and str(vector.value_type) == "float"


def test_what_is_not_a_vector_file_is_one_clear_error(tmp_path) -> None:
    (tmp_path / "x.npy").write_bytes(b"nope")
    with pytest.raises(EmbedError, match="is not a vector file of `raystream embed`"):
        read_vectors(tmp_path / "x.npy")
    with pytest.raises(EmbedError, match="no such file"):
        read_vectors(tmp_path / "missing.parquet")


def test_nearest_orders_by_cosine() -> None:
    rows = _rows(n=50)
    query = rows.vectors[7] * 0.9 + rows.vectors[3] * 0.1
    query /= np.linalg.norm(query)
    scores = rows.vectors @ query
    expected = np.argsort(-scores, kind="stable")
    found = nearest(rows.vectors, query, 3)
    assert [row for row, _ in found] == expected[:3].tolist() and found[0][0] == 7
    np.testing.assert_allclose([cos for _, cos in found], scores[expected[:3]])
    assert [row for row, _ in nearest(rows.vectors, query, 500)] == expected.tolist()


def test_the_client_side_imports_neither_ray_nor_torch_nor_onnxruntime() -> None:
    """`pip install raystream[client]` brings none of them: embed and similar work without."""
    code = (
        "import sys\n"
        "from clients import cli, client, embed_command\n"
        "cli.build_parser().parse_args(['embed', 'x.jpg', '--out', 'v.npy'])\n"
        "heavy = {'ray', 'torch', 'onnxruntime', 'pyarrow'} & set(sys.modules)\n"
        "print(sorted(heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert done.stdout.strip() == "[]"


class _AnswersAtOnce(rpc.ImageClassifierServicer):
    """A stand-in server: every image's vector at once, so the client's own cost shows."""

    vector = pb.Embedding(values=np.ones(1280, np.float32) / np.sqrt(1280))

    def Classify(self, requests, context):
        for request in requests:
            results = [pb.ImageResult(embedding=self.vector) for _ in request.images]
            yield pb.ClassifyResponse(request_id=request.request_id, results=results)

    def GetModelInfo(self, request, context):
        return pb.ModelInfo(
            name="m", version="1", embedding_dim=1280, embedding_space="m/1", max_batch_size=64
        )


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_the_embed_job_reuses_the_memory_it_frees(tmp_path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    server = grpc.server(ThreadPoolExecutor(4), options=[("grpc.max_send_message_length", -1)])
    rpc.add_ImageClassifierServicer_to_server(_AnswersAtOnce(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # the sizes of the built-in photos as JPEGs, over and over (the server reads none)
        photos = []
        for i, size in enumerate((35_042, 72_326, 68_052, 51_929, 59_366, 35_155, 265_201)):
            photos.append(tmp_path / f"{i}.jpg")
            photos[-1].write_bytes(np.random.default_rng(i).bytes(size))
        images = 24_000
        manifest = tmp_path / "manifest.csv"
        manifest.write_text(
            "key,path\n" + "".join(f"k{i},{photos[i % len(photos)]}\n" for i in range(images))
        )
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        done = run_cli(
            *("embed", "--manifest", str(manifest), "--key-column", "key"),
            *("--path-column", "path", "--out", str(tmp_path / "out")),
            *("--server", f"127.0.0.1:{port}"),
        )
        assert done.returncode == 0, done.stderr
        faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
    finally:
        server.stop(None)
    # Once the job had written its first row group (10,000 rows), the memory it freed went
    # back to the kernel and faulted in again for every request: 33 page faults an image
    # over 24,000, against 1.5 with it kept.
    assert faults / images < 10, f"{faults / images:.0f} page faults an image"
