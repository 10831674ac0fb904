"""Helpers shared by the tests: stage batches for the tests that drive the stages directly
(GPU hosts run them too), and waiting for a condition the code under test makes true."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from raystream.v1 import classifier_pb2 as pb
from serve_app.core.messages import Batch, Job

# Model control's token (model_control.token_file) in the test servers that load and unload.
CONTROL_TOKEN = "control-secret"
CONTROL_METADATA = (("authorization", f"Bearer {CONTROL_TOKEN}"),)


def model_control(directory: Path) -> dict[str, str]:
    """The `model_control` args that allow loads and unloads with CONTROL_TOKEN, its file
    written in `directory`."""
    path = directory / "control-token"
    path.write_text(CONTROL_TOKEN + "\n")
    return {"token_file": str(path)}


def batch_of(*requests: list[bytes]) -> Batch:
    """A stage batch with one job per list of image bytes, top 1 each."""
    return Batch(
        jobs=tuple(Job(id=str(i), images=tuple(r), top_k=1) for i, r in enumerate(requests))
    )


def top_classes(answers) -> list[list[int]]:
    """Each answer's top class per image, or the image's error code."""
    responses = [pb.ClassifyResponse.FromString(a.payload) for a in answers]
    return [
        [r.labels[0].class_id if r.labels else r.error.code for r in response.results]
        for response in responses
    ]


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Returns once `condition()` holds, polling the loop; TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)  # polling


ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, prelude: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """`raystream ARGS` in a process of its own, from the repository; `prelude`: Python run
    first in that process."""
    code = f"{prelude}\nimport sys\nfrom clients.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


class OtlpReceiver:
    """A real OTLP gRPC collector on a free loopback port (`endpoint` once started): the
    spans (TraceService) and histogram points (MetricsService) exported to it, each with
    its process' `raystream.deployment` and pid."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.points: list[dict] = []  # histogram data points, with their exemplars
        self.endpoint = ""
        self._server = None

    async def start(self) -> OtlpReceiver:
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        self._server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.endpoint = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        await self._server.stop(None)

    def trace(self, trace_id: str) -> list[dict]:
        return [span for span in self.spans if span["trace_id"] == trace_id]

    def histogram(self, name: str) -> list[dict]:
        return [point for point in self.points if point["name"] == name]


def _resource(resource) -> dict[str, object]:
    attributes = {a.key: a.value for a in resource.attributes}
    return {
        "deployment": attributes["raystream.deployment"].string_value,
        "pid": attributes["process.pid"].int_value,
    }


class _Traces:
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    async def Export(self, request, context):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        for resource_spans in request.resource_spans:
            where = _resource(resource_spans.resource)
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self._receiver.spans.append(
                        {
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "start_ns": span.start_time_unix_nano,
                            "end_ns": span.end_time_unix_nano,
                            "attributes": {a.key: a.value for a in span.attributes},
                            **where,
                        }
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics:
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    async def Export(self, request, context):
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2

        for resource_metrics in request.resource_metrics:
            where = _resource(resource_metrics.resource)
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.histogram.data_points:
                        self._receiver.points.append(
                            {
                                "name": metric.name,
                                "count": point.count,
                                "bounds": list(point.explicit_bounds),
                                "bucket_counts": list(point.bucket_counts),
                                "exemplars": [
                                    {
                                        "trace_id": e.trace_id.hex(),
                                        "span_id": e.span_id.hex(),
                                        "value": e.as_double,
                                    }
                                    for e in point.exemplars
                                ],
                                **where,
                            }
                        )
        return metrics_service_pb2.ExportMetricsServiceResponse()
