"""The application builder: `serve run serve_app.app:build_app` or a Serve config file."""

from __future__ import annotations

import os
from typing import Any

from ray.serve import Application

from engines.repository import resolve
from serve_app.config import AppConfig
from serve_app.inference import Inference
from serve_app.ingress import Ingress
from serve_app.stages import Postprocess, Preprocess

# Topology direct: the replica runs raystream on Serve's own event loop, not on a second
# loop in a second thread (Ray Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED does the same). The
# gRPC server and Serve's replica machinery then stop contending for the GIL from two
# threads: +19-28% requests/s on the CPU box (docs/benchmarks.md section 3). Safe here because
# nothing in the direct replica blocks its loop (decode and engine run in executors). A value
# already in the environment (a config's runtime_env, which the builder runs in) wins:
# deploy/serve_config.gpu-direct.yaml keeps Serve's default, which had the shorter tail on
# the H200 (docs/benchmarks.md section 2g).
DIRECT_REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def build_app(args: dict[str, Any]) -> Application:
    """Validate the config and fail now (before any replica starts) if the model is missing."""
    config = AppConfig.model_validate(args)
    resolve(config.model_repository, config.model, config.model_version)
    shared = config.model_dump(mode="json")
    if config.topology == "direct":
        # A config file's ray_actor_options replace these, and with them this runtime_env:
        # `raystream serve` and the direct configs in deploy/ set the variable themselves.
        env_vars = {name: os.environ.get(name, value) for name, value in DIRECT_REPLICA_ENV.items()}
        options = {**Ingress.ray_actor_options, "runtime_env": {"env_vars": env_vars}}
        return Ingress.options(ray_actor_options=options).bind(shared)
    if config.topology == "fused":
        return Ingress.bind(shared, Inference.bind(shared))
    return Ingress.bind(
        shared, Inference.bind(shared), Preprocess.bind(shared), Postprocess.bind(shared)
    )
