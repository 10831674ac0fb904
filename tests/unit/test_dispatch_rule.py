"""The dispatcher's settings, worked out at run time (serve_app/core/dispatch_rule.py): on each
shipped config they are those that were set by hand in it and measured
(docs/performance.md#why-the-shipped-settings), and replicas added while the ingress runs
raise its calls in flight."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import yaml
from support import until

from engines.base import EngineInfo
from serve_app.config import AppConfig, deployment_name, groups
from serve_app.core import serving
from serve_app.core.dispatch_rule import Fleet, dispatch_settings
from serve_app.core.messages import Answer, Batch, Job, Served
from serve_app.core.serving import ServingCore
from serve_app.tuning import GATHER_S, SPILL_AFTER_S

from conftest import ROOT

GPU_KINDS = ("torch-cuda", "tensorrt")


def _application(path: str) -> dict:
    if path.endswith("rayservice.yaml"):
        (service,) = [d for d in yaml.safe_load_all((ROOT / path).read_text())
                      if d["kind"] == "RayService"]  # fmt: skip
        return yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    return yaml.safe_load((ROOT / path).read_text())["applications"][0]


def _settings(path: str, cores: int, autoscaled_to: str = "min_replicas") -> tuple:
    """The settings for the config at `path` on a host of `cores`, its autoscaled callee at
    `autoscaled_to` replicas: (requests per call, calls in flight, spread, images per call)."""
    app = _application(path)
    config = AppConfig.model_validate({**app["args"], "security": {}})
    deployments = {d["name"]: d for d in app["deployments"]}
    first = groups(config)[0] if groups(config) else None
    callee = deployments.get(deployment_name(first), {}) if first else {}
    replicas = callee.get("num_replicas") or callee.get("autoscaling_config", {}).get(
        autoscaled_to, 1
    )
    ingresses = deployments["Ingress"].get("num_replicas", 1)
    fleet = Fleet(replicas, ingresses, cores)
    on_gpu = config.engine.kind in GPU_KINDS or config.decode == "gpu"
    settings = dispatch_settings(
        fleet, on_gpu, config.engine.batch_capacity, local_calls=first is None
    )
    assert (settings.gather_s, settings.spill_after_s) == (GATHER_S, SPILL_AFTER_S) == (0.003, 0.02)
    return (
        settings.requests_per_call,
        settings.calls_in_flight,
        settings.spread_images,
        settings.max_images,
    )


@pytest.mark.parametrize(
    ("path", "cores", "autoscaled_to", "expected"),
    [
        # The 2-core CPU default: 64 requests a call, 2 calls, at most 128 images a call,
        # with Preprocess at 1 replica or scaled to 2.
        ("deploy/serve_config.yaml", 2, "min_replicas", (64, 2, 0, 128)),
        ("deploy/serve_config.yaml", 2, "max_replicas", (64, 2, 0, 128)),
        # One GPU host: 6 ingress replicas over 12 Inference replicas, or 8 Preprocess
        ("deploy/serve_config.gpu.yaml", 16, "min_replicas", (32, 8, 64, 0)),
        ("bench/configs/serve_config.gpu-chained.yaml", 16, "min_replicas", (32, 8, 64, 0)),
        # Set by hand: 64 / 4 with no bound on the images (now 128, as on every CPU engine)
        ("deploy/serve_config.cluster.yaml", 4, "min_replicas", (64, 4, 0, 128)),
        # The default's 64 / 4 (the ingress runs the stages: no call to pay for)
        ("deploy/serve_config.direct.yaml", 2, "min_replicas", (64, 4, 0, 128)),
        # Set by hand: 16 / 8, copied from an earlier GPU config that measured 32 a call faster
        ("deploy/rayservice.yaml", 8, "min_replicas", (32, 8, 0, 0)),
        ("deploy/rayservice.yaml", 8, "max_replicas", (32, 16, 256, 0)),
    ],
)
def test_the_shipped_configs_get_the_settings_measured_on_them(
    path, cores, autoscaled_to, expected
) -> None:
    assert _settings(path, cores, autoscaled_to) == expected


def test_no_shipped_config_sets_the_dispatcher() -> None:
    removed = ("requests_per_call", "max_calls_in_flight", "max_call_wait_s",
               "spread_min_images", "max_images_per_call")  # fmt: skip
    for path in [*(ROOT / "deploy").glob("*.yaml"), *(ROOT / "bench").rglob("*.yaml")]:
        text = path.read_text()
        assert not [name for name in removed if name in text], path
    with pytest.raises(ValueError, match="max_calls_in_flight"):
        AppConfig.model_validate({"max_calls_in_flight": 4})  # a config of old: refused


def test_calls_in_flight_follow_the_callees_replicas_and_share_among_ingresses() -> None:
    def calls(replicas: int, ingresses: int, cores: int = 64, on_gpu: bool = False) -> int:
        return dispatch_settings(Fleet(replicas, ingresses, cores), on_gpu, 64).calls_in_flight

    assert [calls(r, 1) for r in (1, 2, 3)] == [4, 8, 12]
    assert [calls(4, i) for i in (1, 2, 3, 8)] == [16, 8, 6, 2]
    assert calls(4, 1, cores=6) == 6  # a CPU host: no more calls than cores
    assert calls(1, 16) == 1  # every ingress keeps a call
    assert [calls(r, 6, on_gpu=True) for r in (6, 12, 18, 24)] == [8, 8, 12, 16]


class HeldCalls:
    """The stages: every call waits for `gate`; the most calls in flight at once recorded."""

    def __init__(self) -> None:
        self.gate, self.running, self.most = asyncio.Event(), 0, 0

    async def __call__(self, batch: Batch) -> list[Answer]:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await self.gate.wait()
        finally:
            self.running -= 1
        return [Answer(payload=b"", code=0) for _ in batch.jobs]


async def test_replicas_added_raise_the_calls_in_flight_without_a_restart(
    monkeypatch, tmp_path
) -> None:
    monkeypatch.setattr(serving, "RETUNE_S", 0.0)  # the replicas read again at each request
    engine = EngineInfo("echo", (3, 8, 8), 10, 64, "fp32", "cpu")
    fleet = Fleet(callee_replicas=1, ingress_replicas=1, cores=64)
    stages = HeldCalls()
    core = ServingCore(
        AppConfig(model_repository=tmp_path),
        Served("m", "1", engine, ""),
        stages,
        fleet=lambda: fleet,
        # the rule's, with no extra call for requests that wait while the calls are held
        settings=lambda fleet, engine: dataclasses.replace(
            dispatch_settings(fleet, False, engine.max_batch_size), spill_after_s=60
        ),
    )
    loop = asyncio.get_running_loop()
    answers = []

    def submit(count: int) -> None:
        for _ in range(count):
            answers.append(loop.create_future())
            core.submit(Job(id=str(len(answers)), images=(b"x",), model="m/1"),
                        answers[-1].set_result, f"stream-{len(answers)}")  # fmt: skip

    submit(6)  # at low load each goes at once, up to the 4 calls of one callee replica
    await until(lambda: stages.running == 4)
    assert core.dispatching("m/1").calls_in_flight == 4
    assert len(core._dispatcher("m/1")._queue) == 2
    fleet = Fleet(callee_replicas=2, ingress_replicas=1, cores=64)  # a replica added
    submit(1)  # seen at the next request: the two queued take a new slot, and it another
    await until(lambda: stages.running == 6)
    assert core.dispatching("m/1").calls_in_flight == 8
    submit(3)  # two more calls, then the queue again
    await until(lambda: stages.running == 8)
    assert len(core._dispatcher("m/1")._queue) == 1
    stages.gate.set()
    assert [a.code for a in await asyncio.gather(*answers)] == [0] * 10
    assert stages.most == 8 and core.requests_in_flight == 0
