"""Deployment files are valid: the cluster launcher config by Ray's own validation, the Serve
configs by Serve's schema and by raystream's AppConfig."""

from pathlib import Path

import pytest
import yaml

from serve_app.config import AppConfig

ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIGS = sorted((ROOT / "deploy").glob("serve_config*.yaml"))


def test_ray_cluster_yaml_passes_rays_validation() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    validate_config(prepare_config(config))
    types = config["available_node_types"]
    assert config["head_node_type"] in types and "gpu_inference" in types


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_are_valid(path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(config)
    app = config["applications"][0]
    AppConfig.model_validate(app["args"])
    names = {d["name"] for d in app.get("deployments", [])}
    expected = {"Ingress", "Inference"}
    if app["args"].get("topology", "chained") == "chained":
        expected |= {"Preprocess", "Postprocess"}
    assert names <= expected, f"{path.name} configures deployments its topology lacks"


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="port"):
        AppConfig.model_validate({"port": 70000})
    with pytest.raises(ValueError, match="kind"):
        AppConfig.model_validate({"engine": {"kind": "tensorflow"}})
    with pytest.raises(ValueError, match="Extra inputs"):
        AppConfig.model_validate({"prot": 9000})


def test_serve_reports_config_errors_before_starting_anything() -> None:
    import socket
    import subprocess
    import sys

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    for args, expected in (
        (["--port", "99999"], "port"),
        (["--port", str(busy.getsockname()[1])], "already listens"),
        (["--config", "nope.yaml"], "not found"),
        (["--model-repository", "/nonexistent"], "raystream export"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "clients.cli", "serve", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr and "Traceback" not in result.stderr
    busy.close()


def test_kuberay_rayservice_embeds_a_valid_serve_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    service = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService" and service["apiVersion"] == "ray.io/v1"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    args = serve_config["applications"][0]["args"]
    # Paths in the manifest exist only in the cluster's image: check the rest of the args.
    AppConfig.model_validate({**args, "security": {}})
    assert set(args["security"]) == {"tls_cert", "tls_key", "auth_token_file"}
