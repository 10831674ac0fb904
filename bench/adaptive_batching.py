"""The adaptive batch wait against a fixed one, in one run: the same open-loop rate sweep
(one stream per 2 req/s, requests of --batch-size images, Poisson arrivals) against raystream
(fused topology, the default model) with `user_config` {batch_wait_timeout_s: 0} and with
{target_p99_ms: T, batch_wait_timeout_s: ceiling}. Prints a table and writes JSON plus one PNG
per mode (latency percentiles against throughput, as `raystream bench --sweep` draws them).

    python bench/adaptive_batching.py --rates 2,6,10,14 --target-ms 150 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.loadgen import Workload, builtin_photos, plot_sweep, run_load


def sweep(mode: dict, workloads: list[Workload], repository: Path, engine: str) -> list:
    from ray import serve

    from serve_app.config import AppConfig
    from serve_app.inference import Inference
    from serve_app.ingress import Ingress

    config = AppConfig(
        model_repository=repository, port=0, topology="fused", engine={"kind": engine}
    ).model_dump(mode="json")
    inference = Inference.options(user_config={"max_batch_size": 32, **mode})
    serve.start(proxy_location="Disabled")
    handle = serve.run(
        Ingress.bind(config, inference.bind(config)), name="adaptive", route_prefix=None
    )
    address = f"127.0.0.1:{handle.port.remote().result()}"
    reports = []
    for workload in workloads:
        report = asyncio.run(run_load(address, workload))
        batching = serve.get_deployment_handle("Inference", "adaptive").batching.remote()
        wait_ms = batching.result()["wait_s"] * 1000
        print(f"  rate {workload.rate:5.1f}/s: {report.line()}  wait {wait_ms:.1f} ms", flush=True)
        reports.append(report)
    serve.delete("adaptive")
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2,6,10,14", help="requests/s, comma-separated")
    parser.add_argument("--batch-size", type=int, default=1, help="images per request")
    parser.add_argument("--target-ms", type=float, default=150.0, help="adaptive p99 target")
    parser.add_argument("--ceiling-ms", type=float, default=50.0, help="longest adaptive wait")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--engine", default="onnxruntime")
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/adaptive"))
    args = parser.parse_args()

    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    base = Workload(images=builtin_photos(), batch_size=args.batch_size, duration_s=args.duration)
    workloads = [
        replace(base, rate=float(r), streams=max(1, round(float(r) / 2)))
        for r in args.rates.split(",")
    ]
    modes = {
        "fixed-0": {"batch_wait_timeout_s": 0.0},
        f"adaptive-p99-{args.target_ms:.0f}ms": {
            "target_p99_ms": args.target_ms,
            "batch_wait_timeout_s": args.ceiling_ms / 1000,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, mode in modes.items():
        print(f"{name}: user_config {mode}", flush=True)
        reports = sweep(mode, workloads, args.repository.resolve(), args.engine)
        results[name] = [vars(r) for r in reports]
        plot_sweep(reports, args.out / f"{name}.png", f"raystream, {name}")
    (args.out / "adaptive.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\n{'rate/s':>7} " + " ".join(f"{n:>34}" for n in modes))
    for i, workload in enumerate(workloads):
        cells = []
        for name in modes:
            r = results[name][i]
            cells.append(
                f"batch {r['mean_batch_size']:4.1f} p50 {r['latency_ms']['p50']:6.1f} "
                f"p99 {r['latency_ms']['p99']:6.1f}"
            )
        print(f"{workload.rate:7.1f} " + " ".join(f"{c:>34}" for c in cells))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
