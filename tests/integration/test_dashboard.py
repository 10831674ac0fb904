"""deploy/grafana/raystream.json asks only for metrics that a real server exports: every
metric name in every query of the dashboard is in the Prometheus text of Ray's metrics agent
while raystream serves (real Ray Serve, topology chained over the stage ports, the result
cache on, the real model and photos)."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import grpc
import pytest

from raystream.v1 import classifier_pb2 as pb
from raystream.v1 import classifier_pb2_grpc as pb_grpc

from conftest import ROOT, start_app

pytestmark = pytest.mark.slow
APP = "dashboard"
DASHBOARD = ROOT / "deploy" / "grafana" / "raystream.json"
# PromQL words that are not metric names: aggregations, their clauses, operators' keywords
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and"}
KEYWORDS |= {"or", "unless", "offset", "inf", "nan"}


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its variables'."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(METRIC, label): the metric is the name asked for
            queries.append(re.sub(r"label_values\((\w+),\s*\w+\)", r"\1", variable["definition"]))
    return queries


def metric_names(query: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers left once the strings, label
    matchers, ranges and grouping clauses are taken out, that are not called (functions) and
    not keywords."""
    query = re.sub(r'"(?:[^"\\]|\\.)*"', "", query)  # label values, quantile-free strings
    query = re.sub(r"\{[^}]*\}", " ", query)  # label matchers
    query = re.sub(r"\[[^\]]*\]", " ", query)  # ranges ($__rate_interval, 1m)
    query = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", query)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", query):
        rest = query[match.end() :].lstrip()
        if rest.startswith("(") or match.group() in KEYWORDS:
            continue  # a function (rate, sum, histogram_quantile, scalar) or a keyword
        names.add(match.group())
    return names


def test_metric_names_come_out_of_promql() -> None:
    query = (
        'histogram_quantile(0.9, sum by (le) (rate(ray_a_bucket{application=~"$application",'
        'code!="OK"}[$__rate_interval]))) / scalar(sum(ray_b)) + on(deployment) ray_c'
    )
    assert metric_names(query) == {"ray_a_bucket", "ray_b", "ray_c"}


def exported_names(text: str) -> set[str]:
    """Sample names in Prometheus text."""
    return {
        re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group()
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


@pytest.fixture(scope="module")
def dashboard_server(ray_cluster, model_repository):
    from ray import serve

    port, _ = start_app(
        APP,
        model_repository,
        topology="chained",
        stage_ports=(9100, 9163),  # the stage ports' own gauge (Serve's count only handle calls)
        engine={"kind": "onnxruntime"},
        cache={"max_bytes": 1 << 20},
        limits={"max_images_per_request": 4},
    )
    yield f"127.0.0.1:{port}"
    serve.delete(APP)


async def _send(address: str, requests: list[pb.ClassifyRequest]) -> list[pb.ClassifyResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ImageClassifierStub(channel)
        return [response async for response in stub.Classify(iter(requests))]


async def test_every_metric_the_dashboard_asks_for_is_exported(
    dashboard_server, metrics_url, photos
) -> None:
    wanted = set().union(*map(metric_names, dashboard_queries()))
    # not vacuous: raystream's own and Serve's, histograms by their series
    assert {
        "ray_raystream_request_duration_ms_bucket",
        "ray_raystream_batch_size_bucket",
        "ray_raystream_engine_image_total",
        "ray_raystream_cache_image_total",
        "ray_raystream_stage_port_calls_in_flight",
        "ray_serve_deployment_replica_healthy",
        "ray_serve_deployment_queued_queries",
    } <= wanted, wanted
    # What moves every series: answers (a repeated photo: cache hits), a bad image, a
    # request over the image limit (refused before running).
    requests = [
        pb.ClassifyRequest(request_id="photos", images=[photos["coffee"], photos["chelsea"]]),
        pb.ClassifyRequest(request_id="again", images=[photos["coffee"], b"junk"]),
        pb.ClassifyRequest(request_id="too-many", images=[photos["rocket"]] * 5),
    ]
    responses = await _send(dashboard_server, requests)
    codes = {r.request_id: r.error.code for r in responses}
    assert codes["too-many"] == grpc.StatusCode.INVALID_ARGUMENT.value[0], responses
    missing: set[str] = wanted
    deadline = time.monotonic() + 120  # replicas report every second; Serve's own metrics too
    while missing and time.monotonic() < deadline:
        with urllib.request.urlopen(metrics_url, timeout=10) as reply:
            missing = wanted - exported_names(reply.read().decode())
        if missing:
            time.sleep(1)  # polling the metrics endpoint
    assert not missing, f"the dashboard asks for metrics nobody exports: {sorted(missing)}"
