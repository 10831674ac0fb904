"""The application builder: `serve run serve_app.app:build_app` or a Serve config file."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from engines.repository import resolve
from serve_app.config import AppConfig
from serve_app.ingress import Ingress
from serve_app.stages import Inference, Postprocess, Preprocess


def build_app(args: dict[str, Any]) -> Application:
    """Validate the config and fail now (before any replica starts) if the model is missing."""
    config = AppConfig.model_validate(args)
    resolve(config.model_repository, config.model, config.model_version)
    shared = config.model_dump(mode="json")
    if config.topology == "direct":
        return Ingress.bind(shared)
    if config.topology == "fused":
        return Ingress.bind(shared, Inference.bind(shared))
    return Ingress.bind(
        shared, Inference.bind(shared), Preprocess.bind(shared), Postprocess.bind(shared)
    )
