"""raystream on a multi-node Ray cluster (`make test-cluster`): a head and two worker nodes
started with `ray start` on this machine, each declaring its own custom resources, Ray's token
authentication on; deploy/serve_config.cluster.yaml deployed with `serve deploy` (the ingress
on the head, Preprocess and Postprocess on node a, Inference on node b); a plain grpcio client
(TLS, the token) whose requests cross the nodes, the calls between stages over the replicas'
own ports (stage_ports). Then a load step against autoscaled Inference, the Serve
controller killed mid-stream, and two worker nodes lost mid-stream.

Every node is at 127.0.0.1 in a network namespace that has only loopback; `make test-cluster`
runs pytest in one (tests/cluster/loopback_cluster.py says why). The tests share one cluster
and run in file order: the last one takes nodes away for good."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import grpc
import pytest
from loopback_cluster import (
    APP,
    CLIENT_PORT,
    LoopbackCluster,
    Tap,
    add_spare_node,
    deploy_raystream,
    in_private_network,
    listening_sockets,
    start_three_nodes,
    urlopen_error,
)

from raystream.v1 import classifier_pb2 as pb

from conftest import ROOT

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        not in_private_network(),
        reason="needs a network namespace of its own with only loopback: `make test-cluster`",
    ),
]

CATS, COFFEE = range(281, 286), {967, 968, 504}
_spec = importlib.util.spec_from_file_location("bench_cluster", ROOT / "bench" / "cluster.py")
bench = sys.modules["bench_cluster"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def cluster():
    with LoopbackCluster() as cluster:
        start_three_nodes(cluster)
        yield cluster


@pytest.fixture(scope="module")
def deployed(cluster, model_repository):
    return deploy_raystream(cluster, model_repository)


def _where(cluster: LoopbackCluster) -> dict[str, set[str]]:
    """Deployment -> the nodes its running replicas are on."""
    return {
        name: {cluster.node_of(r["node_id"]) for r in cluster.replicas(APP, name)}
        for name in ("Ingress", "Preprocess", "Inference", "Postprocess")
    }


def _driver(cluster: LoopbackCluster, address: str, token: bool) -> subprocess.CompletedProcess:
    """A Ray driver in a process of its own that connects to `address` and counts the nodes
    (a Ray Client, for a ray:// address, that retries for 1 + 2 + 4 s, not Ray's 35)."""
    code = f"import ray; ray.init(address={address!r}); print('nodes', len(ray.nodes()))"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**cluster.env(token=token), "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_every_node_is_on_loopback(cluster) -> None:
    nodes = cluster.alive_nodes()
    assert len(nodes) == 3 and {n["node_ip"] for n in nodes} == {"127.0.0.1"}
    sockets = set(listening_sockets())
    # Ray's own servers (GCS, raylets, object managers, dashboard and its agents, the Ray
    # Client server, metrics) bind the node's address; only Serve's replicas bind every
    # interface (Serve's inter-deployment server, and the ingress as the config says).
    elsewhere = {
        s for s in sockets if s[0] not in ("127.0.0.1", "::1") and "ServeRepli" not in s[2]
    }
    assert not elsewhere, elsewhere
    assert any(port == CLIENT_PORT for _, port, _ in sockets)


def test_a_ray_client_without_the_token_cannot_connect(cluster) -> None:
    refused = _driver(cluster, cluster.address, token=False)
    assert refused.returncode != 0 and "token" in refused.stderr.lower(), refused.stderr[-2000:]
    client = _driver(cluster, f"ray://127.0.0.1:{CLIENT_PORT}", token=False)
    assert client.returncode != 0, client.stdout
    assert urlopen_error(cluster.dashboard + "/api/v0/nodes") in (401, 403)
    for address in (cluster.address, f"ray://127.0.0.1:{CLIENT_PORT}"):  # with the token
        allowed = _driver(cluster, address, token=True)
        ok = allowed.returncode == 0 and "nodes 3" in allowed.stdout
        assert ok, allowed.stderr[-2000:] + _client_server_log(cluster)


def _client_server_log(cluster: LoopbackCluster) -> str:
    """The end of the Ray Client server's log on the head: why a session did not start."""
    log = cluster.root / "ray" / "session_latest" / "logs" / "ray_client_server.err"
    return "\n--- ray_client_server.err ---\n" + (log.read_text()[-3000:] if log.exists() else "")


async def _classify(deployed, photos: dict[str, bytes], requests: int) -> list[pb.ClassifyResponse]:
    """`requests` requests of a cat and a coffee over one stream, as a plain grpcio client
    with TLS and the token; checks that a call without the token is refused."""
    credentials = grpc.ssl_channel_credentials(deployed.root_certificate)
    async with grpc.aio.secure_channel(deployed.target, credentials) as channel:
        classify = channel.stream_stream(
            "/raystream.v1.ImageClassifier/Classify",
            request_serializer=pb.ClassifyRequest.SerializeToString,
            response_deserializer=pb.ClassifyResponse.FromString,
        )
        images = [photos["chelsea"], photos["coffee"]]

        async def stream():
            for i in range(requests):
                yield pb.ClassifyRequest(request_id=str(i), images=images, top_k=1)

        metadata = (("authorization", f"Bearer {deployed.token}"),)
        answers = [r async for r in classify(stream(), metadata=metadata)]
        info = channel.unary_unary(
            "/raystream.v1.ImageClassifier/GetModelInfo",
            request_serializer=pb.ModelInfoRequest.SerializeToString,
            response_deserializer=pb.ModelInfo.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # no token, no answer
            await info(pb.ModelInfoRequest())
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert sorted(a.request_id for a in answers) == sorted(str(i) for i in range(requests))
    for answer in answers:
        cat, coffee = (result.labels[0].class_id for result in answer.results)
        assert cat in CATS and coffee in COFFEE
    return answers


async def test_requests_cross_the_nodes_the_config_places_replicas_on(
    cluster, deployed, photos
) -> None:
    assert _where(cluster) == {
        "Ingress": {"head"},
        "Preprocess": {"a"},
        "Inference": {"b"},
        "Postprocess": {"a"},
    }
    await _classify(deployed, photos, 6)


def _port_calls(cluster: LoopbackCluster, deployment: str) -> int:
    """Calls that `deployment`'s replica answered over its stage port (a driver of its own)."""
    code = (
        f"import ray; from ray import serve; ray.init(address={cluster.address!r}); "
        f"handle = serve.get_deployment_handle({deployment!r}, app_name={APP!r}); "
        "print('calls', handle.port_calls.remote().result())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=cluster.env(), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0 and "calls" in done.stdout, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


async def test_stage_calls_cross_the_nodes_over_the_replicas_ports(
    cluster, deployed, photos
) -> None:
    """The cluster config's calls between stages go over the replicas' own ports
    (stage_ports): the ingress (head) to Preprocess (a), Preprocess to Inference (b),
    Inference to Postprocess (a), once the callers have read the addresses (a second)."""
    stages = ("Preprocess", "Inference", "Postprocess")
    counts = [0] * len(stages)
    for _ in range(10):
        await _classify(deployed, photos, 4)
        counts = [_port_calls(cluster, name) for name in stages]
        if all(counts):
            break
    assert all(counts), dict(zip(stages, counts, strict=True))


STAGE_PORTS = range(9100, 9164)  # the cluster config's stage_ports (the default)


def seen_in_clear(tap: Tap, photo: bytes) -> bool:
    """Whether the tap read pieces of `photo`, or a label it was given, in clear."""
    pieces = [photo[at : at + 48] for at in range(1000, len(photo) - 48, 5000)]
    return any(piece in tap.payload for piece in pieces) or b"Egyptian cat" in tap.payload


async def test_without_rays_tls_a_tap_on_the_stage_ports_reads_the_photos(
    cluster, deployed, photos
) -> None:
    """This cluster runs without Ray's TLS: its stage calls are plain TCP, as Ray's own
    traffic then is, and a tap reads the photos and their labels (so the same tap can tell,
    in test_cluster_tls.py, that TLS hides them)."""
    with Tap(STAGE_PORTS) as tap:
        await _classify(deployed, photos, 4)
    assert tap.packets and seen_in_clear(tap, photos["chelsea"])


def test_a_load_step_adds_a_replica_latency_recovers_and_it_goes_away(cluster, deployed) -> None:
    """Inference without a model, each batch of at most 2 images taking 40 ms: a replica
    serves at most 50 img/s whatever the host's cores (as a GPU replica's time bounds it),
    so a second one is capacity that a 70 img/s step needs."""
    deployments = bench.autoscaling(max_replicas=2, upscale_s=5, downscale_s=20)
    deployments["Inference"]["user_config"] = {"max_batch_size": 2}
    deploy_raystream(cluster, ROOT / "models", deployments, bench.echo_engine(40))
    phases = [bench.Phase("base", 8, 4), bench.Phase("step", 50, 70), bench.Phase("after", 45, 4)]
    report = bench.measure(cluster, deployed, phases)
    head = report["headline"]
    assert report["exactly_once"] and set(report["requests"]["codes"]) == {"OK"}
    assert head["replicas_before"] == 1 and head["replicas_peak"] == 2, report["replicas"]
    assert head["scaled_up_after_s"] is not None and head["scaled_down_after_s"] is not None
    queued = head["latency_step_until_scale_up"]["p50_ms"]
    recovered = head["latency_last_20s_of_step"]["p50_ms"]
    assert recovered < queued / 2, head


def test_the_serve_controller_killed_mid_stream(cluster, deployed, model_repository) -> None:
    deploy_raystream(cluster, model_repository)  # the model again, after the step's echo
    before = {name: _pids(cluster, name) for name in ("Preprocess", "Inference", "Ingress")}
    event = bench.Event(8, "controller killed", lambda: bench.kill_controller(cluster))
    report = bench.measure(cluster, deployed, [bench.Phase("stream", 25, 10)], events=(event,))
    assert isinstance(report["events"][0]["result"], int), report["events"]  # a pid: killed
    assert report["exactly_once"] and set(report["requests"]["codes"]) == {"OK"}
    assert cluster.wait_running(APP)  # the restarted controller took the application back
    after = {name: _pids(cluster, name) for name in before}
    assert after == before  # ...and its replicas, which kept serving


def _pids(cluster: LoopbackCluster, deployment: str) -> set[int]:
    return {r["pid"] for r in cluster.replicas(APP, deployment)}


def test_two_worker_nodes_lost_mid_stream(cluster, deployed) -> None:
    """Node a (Preprocess, Postprocess) and then node b (Inference) lose their raylet: each
    request is answered once, OK (the ingress sends a call that lost a replica once more)
    or UNAVAILABLE saying to send it again; the stream goes on; Serve restarts the lost
    replicas on node c."""
    add_spare_node(cluster)
    events = (
        bench.Event(10, "node a lost", lambda: cluster.kill_raylet("a")),
        bench.Event(45, "node b lost", lambda: cluster.kill_raylet("b")),
    )
    report = bench.measure(cluster, deployed, [bench.Phase("stream", 80, 10)], events=events)
    print(report["headline"], report["requests"])  # the outage, for the record (pytest -s)
    codes = report["requests"]["codes"]
    assert report["exactly_once"] and not report["requests"]["stream_errors"]
    assert set(codes) <= {"OK", "UNAVAILABLE"}, report["requests"]
    assert all("send it again" in m for m in report["requests"]["messages"]), report["requests"]
    assert all(isinstance(e["result"], int) for e in report["events"]), report["events"]
    last = [r for r in report["per_second"] if 65 <= r["t"] < 80]
    assert sum(r["images_ok"] for r in last) >= 0.8 * sum(r["images_sent"] for r in last)
    where = _where(cluster)
    assert where["Preprocess"] == where["Postprocess"] == where["Inference"] == {"c"}, where
