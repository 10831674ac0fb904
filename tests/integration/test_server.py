"""End to end: real Ray Serve, a real gRPC stream on a free port, real photos, the real model."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from support import run_cli

from clients.client import Client
from engines.base import normalize
from engines.images import decode
from engines.scores import softmax
from raystream.v1 import classifier_pb2 as pb
from serve_app.transport import shared_images

from conftest import ROOT

pytestmark = pytest.mark.slow
CATS = range(281, 286)
COFFEE = {967, 968, 504}


async def _stream(server: str, requests: list[pb.ClassifyRequest]) -> list[pb.ClassifyResponse]:
    async with Client(server) as client:
        return [r async for r in client.stream(requests)]


async def test_real_photos_get_correct_labels_matching_onnx(server, photos, model) -> None:
    async with Client(server) as client:
        results = [
            r
            async for r in client.classify(
                [("chelsea", photos["chelsea"]), ("coffee", photos["coffee"])], top_k=5
            )
        ]
    by_key = {r.key: r for r in results}
    assert by_key["chelsea"].labels[0].class_id in CATS
    assert by_key["coffee"].labels[0].class_id in COFFEE
    # The server's scores equal the ONNX model run directly with the same preprocessing.
    spec = model.spec.preprocess
    session = ort.InferenceSession(str(model.onnx_path), providers=["CPUExecutionProvider"])
    for name in ("chelsea", "coffee"):
        pixels = decode(photos[name], spec)[None]
        probs = softmax(
            session.run(None, {"input": normalize(pixels, spec.mean_array, spec.std_array)})[0]
        )[0]
        labels = by_key[name].labels
        assert [lb.class_id for lb in labels] == list(np.argsort(-probs)[:5])
        np.testing.assert_allclose(
            [lb.score for lb in labels], probs[[lb.class_id for lb in labels]], atol=1e-4
        )
        assert labels[0].name == model.spec.labels[labels[0].class_id]


async def test_bad_images_fail_alone_and_the_stream_goes_on(server, photos) -> None:
    chelsea = photos["chelsea"]
    requests = [
        pb.ClassifyRequest(
            request_id="mixed",
            images=[
                chelsea,
                chelsea[: len(chelsea) // 3],
                b"junk" + os.urandom(4092),
                b"",
                photos["coffee"],
            ],
        ),
        pb.ClassifyRequest(request_id="after", images=[chelsea]),
    ]
    responses = {r.request_id: r for r in await _stream(server, requests)}
    assert sorted(responses) == ["after", "mixed"]
    mixed = responses["mixed"]
    assert mixed.error.code == 0 and len(mixed.results) == 5
    codes = [r.error.code for r in mixed.results]
    assert codes == [0, 3, 3, 3, 0]
    assert "truncated" in mixed.results[1].error.message
    assert "not a supported image" in mixed.results[2].error.message
    assert "empty" in mixed.results[3].error.message
    assert mixed.results[0].labels[0].class_id in CATS
    assert mixed.results[4].labels[0].class_id in COFFEE
    assert responses["after"].results[0].labels[0].class_id in CATS


async def test_request_errors_are_answered_in_their_response(server, photos) -> None:
    one = [photos["coffee"]]
    requests = [
        pb.ClassifyRequest(request_id="top_k", images=one, top_k=1001),
        pb.ClassifyRequest(request_id="model", images=one, model="resnet9000"),
        pb.ClassifyRequest(request_id="many", images=one * 17),  # limit is 16 in conftest
        pb.ClassifyRequest(request_id="ok", images=one, top_k=2),
    ]
    responses = {r.request_id: r for r in await _stream(server, requests)}
    assert responses["top_k"].error.code == 3
    assert "top_k must be in 1..1000, got 1001" in responses["top_k"].error.message
    assert responses["model"].error.code == 5 and "resnet9000" in responses["model"].error.message
    assert responses["many"].error.code == 3 and "17 images" in responses["many"].error.message
    assert not responses["many"].results
    assert responses["ok"].error.code == 0 and len(responses["ok"].results[0].labels) == 2


async def test_many_requests_on_one_stream_each_answered_once(server, photos) -> None:
    names = list(photos)
    requests = [
        pb.ClassifyRequest(request_id=f"r{i}", images=[photos[names[i % 4]]] * (1 + i % 3))
        for i in range(40)
    ]
    responses = await _stream(server, requests)
    assert sorted(r.request_id for r in responses) == sorted(f"r{i}" for i in range(40))
    for response in responses:
        i = int(response.request_id[1:])
        assert len(response.results) == 1 + i % 3
        assert response.timing.total_ms > 0 and response.timing.batch_size >= 1


async def test_preprocessed_pixels_give_the_same_labels_as_images(
    server, photos, model_repository
) -> None:
    """raystream.v1 `pixels`: the client sends the model input it preprocessed itself; the
    labels and scores are those of the image path. A wrong tensor fails alone."""
    from clients.loadgen import model_input

    names = ("chelsea", "coffee")
    pixels = model_input(model_repository, "efficientnet-lite0", tuple(photos[n] for n in names))
    tensor = pb.Tensor(shape=pixels.shape, data=pixels.astype("<f4").tobytes())
    bad_shape = pb.Tensor(shape=[1, 3, 100, 100], data=bytes(4 * 3 * 100 * 100))
    nan = pb.Tensor(shape=[1, 3, 224, 224], data=np.full((1, 3, 224, 224), np.nan, "<f4").tobytes())
    replies = await _stream(
        server,
        [
            pb.ClassifyRequest(request_id="pixels", pixels=tensor),
            pb.ClassifyRequest(request_id="images", images=[photos[n] for n in names]),
            pb.ClassifyRequest(request_id="shape", pixels=bad_shape),
            pb.ClassifyRequest(request_id="nan", pixels=nan),
            pb.ClassifyRequest(request_id="both", pixels=tensor, images=[photos["chelsea"]]),
            pb.ClassifyRequest(request_id="bytes", pixels=pb.Tensor(shape=[1], data=b"abc")),
        ],
    )
    by_id = {r.request_id: r for r in replies}
    assert len(replies) == 6 and len(by_id) == 6
    ours, theirs = by_id["pixels"].results, by_id["images"].results
    assert [r.labels[0].class_id for r in ours] == [r.labels[0].class_id for r in theirs]
    assert ours[0].labels[0].class_id in CATS and ours[1].labels[0].class_id in COFFEE
    assert abs(ours[1].labels[0].score - theirs[1].labels[0].score) < 1e-4
    assert by_id["pixels"].timing.batch_size >= 2
    for bad, says in [
        ("shape", "[N, 3, 224, 224]"),
        ("nan", "NaN"),
        ("both", "not both"),
        ("bytes", "not float32"),
    ]:
        assert by_id[bad].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], bad
        assert says in by_id[bad].error.message and not by_id[bad].results


async def test_unary_and_stream_agree(server, photos) -> None:
    images = [photos["astronaut"], photos["rocket"]]
    async with Client(server) as client:
        unary = await client.classify_once(images, top_k=3)
    (streamed,) = await _stream(server, [pb.ClassifyRequest(images=images, top_k=3)])
    for a, b in zip(unary.results, streamed.results, strict=True):
        assert [lb.class_id for lb in a.labels] == [lb.class_id for lb in b.labels]
        np.testing.assert_allclose(
            [lb.score for lb in a.labels], [lb.score for lb in b.labels], atol=1e-6
        )


async def test_model_info(server, model) -> None:
    async with Client(server) as client:
        info = await client.model_info()
        assert (info.name, info.version, info.engine) == (
            "efficientnet-lite0",
            model.spec.version,
            "onnxruntime",
        )
        assert list(info.input_shape) == [-1, 3, 224, 224] and info.num_classes == 1000
        assert info.precision == "fp32" and info.max_batch_size >= 1
        # Which ingress replica answers (the fixture runs one): host:pid, the same each time.
        replica = await client.replica()
        assert ":" in replica and await client.replica() == replica
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.model_info("other")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_cli_classifies_a_folder(server, photos, tmp_path: Path) -> None:
    (tmp_path / "nested").mkdir()
    (tmp_path / "cat.jpg").write_bytes(photos["chelsea"])
    (tmp_path / "nested" / "coffee.jpg").write_bytes(photos["coffee"])
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    result = await asyncio.to_thread(
        run_cli, "classify", str(tmp_path), "--server", server, "--json", "--top-k", "3"
    )
    rows = {Path(row["file"]).name: row for row in map(json.loads, result.stdout.splitlines())}
    assert result.returncode == 1, result.stderr  # one image failed
    assert rows["cat.jpg"]["labels"][0]["class_id"] in CATS
    assert len(rows["coffee.jpg"]["labels"]) == 3
    assert rows["broken.png"]["error"]["code"] == 3
    table = await asyncio.to_thread(
        run_cli, "classify", str(tmp_path / "cat.jpg"), "--server", server
    )
    assert table.returncode == 0 and "cat" in table.stdout


def test_cli_reports_a_server_that_is_down() -> None:
    result = run_cli("info", "--server", "127.0.0.1:1", "--timeout", "2")
    assert result.returncode == 2
    assert "cannot reach the server" in result.stderr and "Traceback" not in result.stderr


async def test_load_generator_reports_what_it_sent(
    server, photos, model_repository, tmp_path: Path
) -> None:
    from clients.loadgen import Workload, plot_sweep, run_load

    workload = Workload(
        images=tuple(photos.values()),
        batch_size=2,
        streams=2,
        in_flight=2,
        duration_s=30,
        max_requests=5,
    )
    report = await run_load(server, workload)
    assert report.requests == 10 and not report.errors
    assert report.images_per_s > 0 and report.mean_batch_size >= 2
    assert report.latency_ms["p50"] <= report.latency_ms["p99"] <= report.latency_ms["max"]
    # The server's own share of each request, inside the end-to-end time.
    server_ms = report.server_total_ms
    assert 0 < server_ms["p50"] <= server_ms["p99"] <= report.latency_ms["max"]
    plot_sweep([report, report], tmp_path / "sweep.png", "test")
    # The model input instead of the images (the server decodes nothing).
    from clients.loadgen import model_input

    pixels = model_input(model_repository, "efficientnet-lite0", workload.images)
    report = await run_load(server, replace(workload, pixels=pixels, batch_size=3))
    assert report.requests == 10 and not report.errors and report.offered["input"] == "pixels"
    assert report.images_per_s > 0 and report.mean_batch_size >= 3
    # Unary calls, and streams spread over the client's connections (clients/spread.py),
    # sending the same encoded requests.
    for variant in (replace(workload, unary=True), replace(workload, spread=True, connections=2)):
        report = await run_load(server, variant)
        assert report.requests == 10 and not report.errors and report.mean_batch_size >= 2
    # Split over two processes and two connections, which look for two ingress replicas
    # (there is one): the same requests, counted once each.
    report = await run_load(server, replace(workload, connections=2), processes=2)
    assert report.requests == 10 and not report.errors and report.images_per_s > 0
    assert report.offered["processes"] == 2 and report.offered["ingress_replicas"] == 1
    assert 0 < report.server_total_ms["p99"] <= report.latency_ms["max"]  # merged processes
    # Open loop at a low rate: arrivals due after the end are not waited for.
    report = await run_load(
        server, replace(workload, rate=1.0, streams=4, duration_s=3, max_requests=None)
    )
    assert report.requests > 0 and not report.errors
    assert report.requests / report.requests_per_s < 3 + 2  # seconds the run took
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


async def test_every_input_path_gives_the_same_winners(server, model_repository, capsys) -> None:
    """bench/input_paths.py, the check the GPU servers ran: JPEG bytes over both protocols,
    unary and streamed, and client-made `pixels` give the same winners; bad input fails
    alone with INVALID_ARGUMENT."""
    spec = importlib.util.spec_from_file_location("input_paths", ROOT / "bench" / "input_paths.py")
    input_paths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(input_paths)
    assert await input_paths.check(server, model_repository) == 0
    out = capsys.readouterr().out
    assert out.count("| 7 / 7 |") == 5 and out.count(": yes") == 4


async def test_bench_cli_brackets_its_load_with_the_in_process_baseline(
    server, model_repository, tmp_path: Path
) -> None:
    """`raystream bench --baseline`: the same model in this process, half before the load
    and half after; the ratio uses their mean and bench.json keeps both."""
    result = run_cli(
        "bench",
        "--server",
        server,
        "--batch-size",
        "2",
        "--requests",
        "3",
        "--duration",
        "2",
        "--baseline",
        "--engine",
        "onnxruntime",
        "--repository",
        str(model_repository),
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["reports"][0]["requests"] == 3 and not data["reports"][0]["errors"]
    spread = data["baseline_before_after"]
    assert set(spread) == {
        "decode_and_engine_images_per_s",
        "engine_images_per_s",
        "engine_fp32_images_per_s",
    }
    for key, (before, after) in spread.items():
        assert before > 0 and after > 0
        assert data["baseline"][key] == (before + after) / 2
    assert "(server / in-process = " in result.stdout


async def test_health_and_reflection(server) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with grpc.aio.insecure_channel(server) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "raystream.v1.ImageClassifier"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(iter([request])):
            names = {s.name for s in reply.list_services_response.service}
            assert {
                "raystream.v1.ImageClassifier",
                "inference.GRPCInferenceService",
                "grpc.health.v1.Health",
            } <= names


async def test_a_client_that_disconnects_leaves_no_work_behind(server, photos, request) -> None:
    ingress = request.config.raystream_ingress
    sent = asyncio.Event()

    async def requests():
        for i in range(30):
            yield pb.ClassifyRequest(request_id=f"gone-{i}", images=[photos["astronaut"]] * 4)
        sent.set()
        await asyncio.sleep(3600)  # keep the stream open until the client cancels it

    async with grpc.aio.insecure_channel(server) as channel:
        from raystream.v1 import classifier_pb2_grpc as pb_grpc

        call = pb_grpc.ImageClassifierStub(channel).Classify(requests())
        await sent.wait()
        await call.read()  # at least one answer: the server is working on the others
        assert await ingress.requests_in_flight.remote() > 0
        call.cancel()
    for _ in range(100):  # poll: cancelled work drains without a fixed sleep
        if await ingress.requests_in_flight.remote() == 0:
            break
        await asyncio.sleep(0.1)  # polling
    assert await ingress.requests_in_flight.remote() == 0
    # The server goes on serving others.
    (response,) = await _stream(server, [pb.ClassifyRequest(images=[photos["coffee"]])])
    assert response.results[0].labels[0].class_id in COFFEE


async def test_stage_calls_travel_as_configured(server, photos, request) -> None:
    """With `stage_ports`: every stage replica answers calls over its own port once the
    callers read the addresses (within a second or two), and the ingress hands the images
    to Preprocess through shared memory; by handle, none does."""
    from ray import serve

    topology, _, calls = request.node.callspec.params["server"].partition("-")
    deployments = {"chained": ["Preprocess", "Inference", "Postprocess"], "fused": ["Inference"]}
    if topology not in deployments:
        pytest.skip("topology direct has no stage deployments")
    handles = [
        serve.get_deployment_handle(name, app_name="raystream") for name in deployments[topology]
    ]
    counts = []
    for _ in range(40):
        (response,) = await _stream(server, [pb.ClassifyRequest(images=[photos["coffee"]])])
        assert response.results[0].labels[0].class_id in COFFEE
        counts = [await handle.port_calls.remote() for handle in handles]
        if calls != "port" or all(counts):
            break
        await asyncio.sleep(0.25)  # polling
    assert all(counts) if calls == "port" else not any(counts), counts
    if calls == "port" and shutil.disk_usage(shared_images.SHM_DIR).total >= 128 << 20:
        owners = {  # the processes whose segments are in /dev/shm: the ingress replica's
            int(path.name.removeprefix(shared_images.PREFIX).split("-")[0])
            for path in shared_images.SHM_DIR.glob(f"{shared_images.PREFIX}*")
        }
        ingress = request.config.raystream_ingress
        assert await ingress.pid.remote() in owners, "the images went in the calls"


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_prometheus_metrics_move(server, photos, metrics_url) -> None:
    import urllib.request

    def scrape() -> str:
        with urllib.request.urlopen(metrics_url, timeout=5) as reply:
            return reply.read().decode()

    # Every count is compared with its value before this test's requests: earlier tests
    # raised them all, so absolute values would prove nothing.
    expected = {
        ("ray_raystream_inference_request_total", ("code", "OK")): 4,
        ("ray_raystream_inference_image_total", ("code", "OK")): 5,  # 3 beside junk, 2 good
        ("ray_raystream_inference_image_total", ("code", "INVALID_ARGUMENT")): 3,
        ("ray_raystream_request_duration_ms_count", None): 4,
        ("ray_raystream_batch_size_count", None): 1,
    }

    def counts(text: str) -> dict:
        return {
            (name, label): _metric(text, name, **dict([label] if label else []))
            for name, label in expected
        } | {"compute": _metric(text, "ray_raystream_stage_duration_ms_total", stage="compute")}

    before = counts(await asyncio.to_thread(scrape))
    requests = [
        pb.ClassifyRequest(request_id=str(i), images=[photos["coffee"], b"junk"]) for i in range(3)
    ]
    requests.append(pb.ClassifyRequest(request_id="good", images=[photos["coffee"]] * 2))
    await _stream(server, requests)

    def moved(now: dict) -> bool:
        return (
            all(now[key] - before[key] >= n for key, n in expected.items())
            and now["compute"] > before["compute"]
        )

    # Ray's agent exports every second in the test cluster, and a count from an earlier test
    # can arrive after `before`: wait for every count, not the first to move.
    for _ in range(60):
        now = counts(await asyncio.to_thread(scrape))
        if moved(now):
            break
        await asyncio.sleep(0.5)  # polling
    deltas = {key: now[key] - before[key] for key in now}
    assert moved(now), deltas


async def test_failed_requests_are_logged_as_json_with_request_and_stream_ids(server, photos):
    import glob

    import ray

    requests = [pb.ClassifyRequest(request_id="log-me", images=[photos["coffee"], b"junk"])]
    await _stream(server, requests)
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    for _ in range(200):  # the replica's log handler writes within moments; CI is slow
        lines = [
            line
            for path in glob.glob(str(logs / "replica_raystream_Ingress_*.log"))
            for line in Path(path).read_text().splitlines()
            if '"log-me"' in line
        ]
        if lines:
            break
        await asyncio.sleep(0.1)  # polling
    assert lines, f"no log line for request 'log-me' under {logs}"
    record = json.loads(lines[-1][lines[-1].index("{") :])
    assert record["event"] == "raystream.request" and record["failed_images"] == 1
    assert record["stream"] != "unary" and record["images"] == 2 and record["code"] == "OK"


async def test_raystreams_own_log_lines_reach_the_replicas_serve_logs(server) -> None:
    """The replica holding inference says which model versions it loaded, in its Serve log
    file (serve_app/observability/logs.py), in every topology."""
    import glob

    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    for _ in range(200):
        lines = [
            line
            for path in glob.glob(str(logs / "replica_raystream_*.log"))
            for line in Path(path).read_text().splitlines()
            if re.search(r"model efficientnet-lite0/\d+ loaded", line)
        ]
        if lines:
            break
        await asyncio.sleep(0.1)  # polling
    assert lines, f"no 'model ... loaded' line under {logs}"


async def test_direct_topology_takes_the_batching_user_config(
    ray_cluster, model_repository, photos
) -> None:
    """topology direct: the ingress replica hosts the model, and its user_config is the
    batching config the Inference deployment takes in the other topologies."""
    from ray import serve

    from serve_app.config import AppConfig
    from serve_app.ingress.deployment import Ingress
    from serve_app.pipeline.route import Wiring

    config = AppConfig(
        model_repository=model_repository, port=0, topology="direct", engine={"kind": "onnxruntime"}
    )
    serve.start(proxy_location="Disabled")
    ingress = Ingress.options(user_config={"max_batch_size": 4})
    handle = serve.run(
        ingress.bind(config.model_dump(mode="json"), Wiring.of(config)),
        name="direct-batching",
        route_prefix=None,
    )
    try:
        assert (await handle.batching.remote())["max_batch_size"] == 4
        server = f"127.0.0.1:{await handle.port.remote()}"
        request = pb.ClassifyRequest(request_id="six", images=[photos["chelsea"]] * 6)
        [response] = await _stream(server, [request])
        assert [r.labels[0].class_id in CATS for r in response.results] == [True] * 6
        assert response.timing.batch_size == 4  # 6 images ran in engine batches of <= 4
    finally:
        serve.delete("direct-batching")


async def test_the_batcher_fills_its_batches(ray_cluster, model_repository, photos):
    """In a real replica, the batcher fills engine batches from requests that wait
    together: eight requests of 8 images with a wait for company run as two batches of 32,
    not eight of 8."""
    from ray import serve

    from serve_app.config import AppConfig
    from serve_app.ingress.deployment import Ingress
    from serve_app.pipeline.route import Wiring

    config = AppConfig(
        model_repository=model_repository, port=0, topology="direct", engine={"kind": "echo"}
    )
    batching = {"max_batch_size": 32, "batch_wait_timeout_s": 0.5}
    name = "fill"
    serve.start(proxy_location="Disabled")
    handle = serve.run(
        Ingress.options(user_config=batching).bind(
            config.model_dump(mode="json"), Wiring.of(config)
        ),
        name=name,
        route_prefix=None,
    )
    try:
        server = f"127.0.0.1:{await handle.port.remote()}"
        requests = [
            pb.ClassifyRequest(request_id=str(i), images=[photos["coffee"]] * 8) for i in range(8)
        ]
        responses = await _stream(server, requests)
        assert sorted(r.request_id for r in responses) == [str(i) for i in range(8)]
        assert [r.timing.batch_size for r in responses] == [32] * 8
    finally:
        serve.delete(name)
