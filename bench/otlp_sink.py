"""An OTLP gRPC receiver that counts the spans and metric points it is sent and keeps
nothing: the collector for measuring tracing's cost (bench/scenarios/cpu.yaml,
`chained-traced*`; gpu.yaml, `gpu-traced*`).

    python bench/otlp_sink.py [--port 4317]
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as otlp_metrics
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as metrics_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

logger = logging.getLogger("otlp_sink")


class Sink(otlp_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self.points = 0  # histogram points (the ingress' latency, with exemplars)
        self.exemplars = 0

    async def Export(self, request: otlp.ExportTraceServiceRequest, context):
        for resource_spans in request.resource_spans:
            for scope in resource_spans.scope_spans:
                self.spans += len(scope.spans)
        return otlp.ExportTraceServiceResponse()


class MetricsSink(metrics_grpc.MetricsServiceServicer):
    def __init__(self, sink: Sink) -> None:
        self._sink = sink

    async def Export(self, request: otlp_metrics.ExportMetricsServiceRequest, context):
        for resource_metrics in request.resource_metrics:
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.histogram.data_points:
                        self._sink.points += 1
                        self._sink.exemplars += len(point.exemplars)
        return otlp_metrics.ExportMetricsServiceResponse()


async def main(port: int) -> None:
    server, sink = grpc.aio.server(), Sink()
    otlp_grpc.add_TraceServiceServicer_to_server(sink, server)
    metrics_grpc.add_MetricsServiceServicer_to_server(MetricsSink(sink), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    while True:
        await asyncio.sleep(10)
        logger.info(
            "spans received: %d; histogram points: %d, exemplars: %d",
            sink.spans,
            sink.points,
            sink.exemplars,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4317)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    asyncio.run(main(parser.parse_args().port))
