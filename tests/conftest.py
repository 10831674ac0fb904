"""Shared fixtures: real photos, the real exported model, a real Ray Serve app on a free port,
and the engine parity check every engine passes (tests/unit and tests/gpu run it).

tests/unit: no Ray, no server. tests/integration: real Ray Serve and gRPC. tests/gpu: needs a
CUDA GPU (its tests skip elsewhere, saying so)."""

from __future__ import annotations

import io
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clients.local_ray import loopback_env

ROOT = Path(__file__).resolve().parents[1]
# The tests' own local Ray stays on 127.0.0.1, as `raystream serve`'s does (clients/local_ray.py):
# set before anything starts Ray.
os.environ.update(loopback_env())


def encode(array: np.ndarray, fmt: str = "JPEG", **params: object) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt, **params)
    return buffer.getvalue()


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, Path]:
    """The tests' certificates (tests/certificates.py make_pki)."""
    from certificates import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def photos() -> dict[str, bytes]:
    """Real photos from scikit-image, as JPEG bytes (the format clients send most)."""
    from skimage import data

    return {
        name: encode(getattr(data, name)(), quality=95)
        for name in ("chelsea", "coffee", "astronaut", "rocket")
    }


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository `make test` exported into, if its newest version is in the current
    export format (logits and embedding); else exported afresh into a temporary folder (with
    the torch program where a CUDA GPU is, which the torch-cuda engine loads)."""
    from engines.export import export_model, is_current

    repo = ROOT / "models"
    if is_current(repo, "efficientnet-lite0"):
        return repo
    import torch  # only to export: importing it costs seconds

    repo = tmp_path_factory.mktemp("models")
    export_model(repo, "efficientnet-lite0", with_torch=torch.cuda.is_available())
    return repo


@pytest.fixture(scope="session")
def model(model_repository: Path):
    from engines.repository import resolve

    return resolve(model_repository, "efficientnet-lite0")


@pytest.fixture(scope="session")
def labels_only_repository(model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository holding the model as the export format 1 (before embeddings) wrote it:
    model.onnx with the `logits` output only, model.json without the embedding fields."""
    import json

    import onnx

    from engines.repository import ONNX_FILE, SPEC_FILE, sha256_file

    root = tmp_path_factory.mktemp("labels-only")
    target = root / model.spec.name / "1"
    target.mkdir(parents=True)
    graph = onnx.load(str(model.onnx_path))
    del graph.graph.output[1:]  # ONNX Runtime drops the nodes nothing reads any more
    onnx.save(graph, str(target / ONNX_FILE))
    spec = json.loads(model.spec.to_json())
    for key in ("export_format", "embedding_dim", "weights_sha256", "program_sha256"):
        del spec[key]
    spec["onnx_sha256"] = sha256_file(target / ONNX_FILE)
    (target / SPEC_FILE).write_text(json.dumps({**spec, "version": "1"}))
    return root


class TorchModel:
    """The FP32 torch model (EfficientNet-Lite0, pretrained), run directly: the ground truth
    of every engine and of the server. Its embedding is read with a hook on the classifier's
    input, apart from the exported model's own embedding output."""

    def __init__(self) -> None:
        from engines.export import EXPORTABLE

        self.net = EXPORTABLE["efficientnet-lite0"].build().eval()

    def __call__(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 (N, C, H, W) preprocessed images -> (softmax, L2-normalized embedding)."""
        import torch

        from engines.scores import softmax

        pooled: list = []
        hook = self.net._fc.register_forward_pre_hook(lambda _, args: pooled.append(args[0]))
        try:
            with torch.inference_mode():
                logits = self.net(torch.from_numpy(batch)).numpy()
        finally:
            hook.remove()
        features = pooled[0].numpy().astype(np.float64)
        return softmax(logits), features / np.linalg.norm(features, axis=1, keepdims=True)


@pytest.fixture(scope="session")
def torch_model() -> TorchModel:
    return TorchModel()


@pytest.fixture(scope="session")
def torch_embedding(model, torch_model) -> Callable[[list[bytes]], np.ndarray]:
    """Encoded images -> the torch model's embeddings, preprocessed as the server does."""
    from engines.base import normalize
    from engines.images import decode

    spec = model.spec.preprocess

    def embed(images: list[bytes]) -> np.ndarray:
        crops = np.stack([decode(image, spec) for image in images])
        return torch_model(normalize(crops, spec.mean_array, spec.std_array))[1]

    return embed


@dataclass(frozen=True)
class Reference:
    batch: np.ndarray  # real photos, preprocessed as the server does: (N, C, H, W) float32
    probabilities: np.ndarray  # the FP32 torch model's softmax
    embedding: np.ndarray  # its pooled features (its classifier's input), L2-normalized


@pytest.fixture(scope="session")
def engine_reference(model, torch_model) -> Reference:
    """Real photos and the FP32 torch model's outputs on them: the engines' ground truth."""
    from engines.export import check_photos

    batch = check_photos(model.spec.preprocess)
    return Reference(batch, *torch_model(batch))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def check_engine_parity(
    model, reference: Reference, kind: str, precision: str, atol: float, min_cosine: float
) -> None:
    """The one parity test every engine must pass: the reference's winners and softmax within
    `atol`, its embedding within `min_cosine` and of norm 1, whatever the batch composition
    and whatever sits in a bucket's padding."""
    from engines import create_engine
    from engines.scores import softmax

    batch = reference.batch
    with create_engine(kind, model, max_batch_size=8, precision=precision) as engine:
        engine.warmup()
        if hasattr(engine, "captured"):  # every bucket, for the padding checks below
            assert engine.captured.wait(300)
        assert engine.info.embedding_dim == reference.embedding.shape[1]
        out = engine.infer(batch)
        got = softmax(out.logits)
        np.testing.assert_array_equal(got.argmax(1), reference.probabilities.argmax(1))
        assert np.abs(got - reference.probabilities).max() <= atol
        assert out.embedding.dtype == np.float32
        assert cosines(out.embedding, reference.embedding).min() >= min_cosine
        np.testing.assert_allclose(np.linalg.norm(out.embedding, axis=1), 1.0, atol=1e-5)
        # Batch composition changes nothing beyond the precision's tolerance...
        singles = [engine.infer(batch[i : i + 1]) for i in range(3)]
        three = engine.infer(batch[:3])
        single_probs = np.concatenate([softmax(s.logits) for s in singles])
        np.testing.assert_array_equal(softmax(three.logits).argmax(1), single_probs.argmax(1))
        assert np.abs(softmax(three.logits) - single_probs).max() <= atol
        single_embedding = np.concatenate([s.embedding for s in singles])
        assert cosines(three.embedding, single_embedding).min() >= min_cosine
        # ...and what sits in the padding of a bucket (3 runs padded to 4) changes nothing.
        engine.infer(batch[[3, 3, 3, 3]])  # leaves image 3 in the padding row
        again = engine.infer(batch[:3])
        np.testing.assert_array_equal(again.logits, three.logits)
        np.testing.assert_array_equal(again.embedding, three.embedding)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from serve_app.config import BY_VALUE_ENV

    ray.init(
        num_cpus=4,  # logical: the plain and the secured test apps fit side by side
        include_dashboard=False,
        log_to_driver=False,
        # as the shipped configs: stage calls by value (serve_app/pipeline/topology.py StageHandle)
        runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0", **BY_VALUE_ENV}},
        _metrics_export_port=free_port(),
        _system_config={"metrics_report_interval_ms": 1000},  # metrics tests poll briefly
    )
    yield
    ray.shutdown()


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 up) and above Ray's worker ports
    (10002-19999). A port found by binding port 0 is an ephemeral one, which the Ray
    processes a test starts may take before the test's server binds it (a clean-clone run,
    2026-12-01: the ingress could not bind, and `raystream serve` waited ten minutes)."""
    for port in random.sample(range(20000, 32768), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-32767")


@pytest.fixture(scope="session")
def metrics_url(ray_cluster) -> str:
    """Where Ray's metrics agent serves Prometheus text for this test cluster."""
    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


def deploy_app(app: dict) -> None:
    """Deploy one Serve application from its config entry (as `serve deploy` takes it) and
    wait until it runs; deploying it again with new args or user_config redeploys it."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate({"proxy_location": "Disabled", "applications": [app]})
    serve.start(proxy_location="Disabled")
    _get_global_client().deploy_apps(config, _blocking=True)


def start_app(name: str, model_repository: Path, **args: object):
    """Build and run raystream as Serve application `name`, gRPC on a free port: returns
    (port, ingress handle). The caller deletes it (`serve.delete(name)`)."""
    from ray import serve

    from serve_app.app import build_app

    serve.start(proxy_location="Disabled")
    app = build_app({"model_repository": str(model_repository), "port": 0, **args})
    handle = serve.run(app, name=name, route_prefix=None)
    return handle.port.remote().result(), handle


@pytest.fixture(scope="session", params=["chained", "fused", "direct", "chained-port"])
def server(request, ray_cluster, two_versions: Path, tmp_path_factory) -> str:
    """The whole application under real Ray Serve, gRPC on a free loopback port, in each
    topology (serve_app/pipeline/topology.py), serving the highest of two versions in its
    repository;
    `chained-port`: chained, the stage calls over the replicas' ports (stage_port.py), the
    images to Preprocess through shared memory (shared_images.py, automatic on one node)."""
    from ray import serve
    from support import model_control

    topology, _, calls = request.param.partition("-")
    port, handle = start_app(
        "raystream",
        two_versions,
        topology=topology,
        stage_ports=(9100, 9163) if calls == "port" else None,
        engine={"kind": "onnxruntime"},
        limits={"max_images_per_request": 16},
        # test_tritonclient loads and unloads, with support.CONTROL_TOKEN
        model_control=model_control(tmp_path_factory.mktemp("control")),
    )
    request.config.raystream_ingress = handle  # for tests that inspect the ingress
    yield f"127.0.0.1:{port}"
    serve.shutdown()


def add_version(repository: Path, model, version: str) -> None:
    """Another version of `model` in `repository`: the same weights (its model files linked),
    its own model.json. (No other pretrained architecture installs offline here.)"""
    import json

    target = repository / model.spec.name / version
    target.mkdir(parents=True)
    for path in model.path.iterdir():
        if path.is_file() and path.name != "model.json":
            (target / path.name).symlink_to(path)
    spec = json.loads(model.spec.to_json())
    (target / "model.json").write_text(json.dumps({**spec, "version": version}))


@pytest.fixture(scope="session")
def two_versions(model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with two versions of the default model: the model's own, the highest,
    and the one below it (versions 1 and 2 where the model is version 2)."""
    root = tmp_path_factory.mktemp("two-versions")
    add_version(root, model, str(int(model.spec.version) - 1))
    add_version(root, model, model.spec.version)
    return root
