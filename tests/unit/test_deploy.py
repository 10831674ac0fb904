"""Deployment files are valid: the cluster launcher config by Ray's own validation, the Serve
configs by Serve's schema and by raystream's AppConfig, with room for a redeploy's surge; the
cluster files keep Ray's token authentication on and its ports inside the cluster.
(`raystream serve` run as a user runs it: tests/integration/test_serve.py; the cluster config
on a real multi-node cluster: tests/cluster.)"""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from serve_app.config import AppConfig, deployment_name, groups

from conftest import ROOT

SERVE_CONFIGS = sorted((ROOT / "deploy").glob("serve_config*.yaml"))
CLUSTER_CONFIG = ROOT / "deploy" / "serve_config.cluster.yaml"  # for a cluster, not one host
HOST_CONFIGS = [path for path in SERVE_CONFIGS if path != CLUSTER_CONFIG]
# Layouts kept for comparison in the benchmarks, not shipped
BENCH_CONFIGS = sorted((ROOT / "bench" / "configs").glob("serve_config*.yaml"))


def _rayservice() -> tuple[dict, dict]:
    """deploy/rayservice.yaml's RayService and NetworkPolicy."""
    docs = {
        d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy" / "rayservice.yaml").read_text())
    }
    return docs["RayService"], docs["NetworkPolicy"]


def _args(app: dict) -> dict:
    """The application's args without the security files, which exist only where it runs."""
    return {**app["args"], "security": {}}


def test_ray_cluster_yaml_passes_rays_validation() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    validate_config(prepare_config(config))
    types = config["available_node_types"]
    assert config["head_node_type"] in types and "gpu_inference" in types


@pytest.mark.parametrize("path", SERVE_CONFIGS + BENCH_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_are_valid(path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(config)
    app = config["applications"][0]
    AppConfig.model_validate(_args(app))
    names = {d["name"] for d in app.get("deployments", [])}
    config = AppConfig.model_validate({**_args(app), "model_repository": "."})
    expected = {"Ingress", *map(deployment_name, groups(config))}
    assert names <= expected, f"{path.name} configures deployments its topology lacks"


# The smallest host each shipped config is for: a 2-core CPU machine, or one H200 with 16 cores.
CPU_HOST, GPU_HOST = {"CPU": 2, "GPU": 0}, {"CPU": 16, "GPU": 1}


def _redeploy_need(deployments: list[dict]) -> dict[str, float]:
    """CPUs and GPUs that Ray must find while a redeploy runs: each deployment's replicas
    (autoscaled ones at their minimum) plus the surge of new ones started before the old
    stop (`max_surge_percent`)."""
    from serve_app.app import DEFAULTS
    from serve_app.ingress.deployment import Ingress

    defaults = {"Ingress": Ingress.ray_actor_options} | {
        name: options["ray_actor_options"] for name, options in DEFAULTS.items()
    }
    need = {"CPU": 0.0, "GPU": 0.0}
    for d in deployments:
        options = d.get("ray_actor_options", defaults[d["name"]])
        replicas = d.get("autoscaling_config", {}).get("min_replicas", d.get("num_replicas", 1))
        replicas += math.ceil(replicas * d.get("max_surge_percent", 0) / 100)
        need["CPU"] += replicas * options.get("num_cpus", 1)
        need["GPU"] += replicas * options.get("num_gpus", 0)
    return need


@pytest.mark.parametrize("path", HOST_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_leave_room_for_the_redeploy_surge(path: Path) -> None:
    """With max_surge_percent, a redeploy starts the new replicas before the old ones stop,
    and when Ray has no room for them "old replicas keep serving while replacements wait"
    (Serve's schema): the redeploy does not finish. So every config must fit its host with
    the surge replicas too."""
    need = _redeploy_need(yaml.safe_load(path.read_text())["applications"][0]["deployments"])
    host = GPU_HOST if need["GPU"] > 0 else CPU_HOST
    for resource, count in host.items():
        assert need[resource] <= count + 1e-9, f"{path.name} needs {need} during a redeploy"


def test_the_kuberay_service_leaves_room_for_the_redeploy_surge() -> None:
    """The same for deploy/rayservice.yaml, against its cluster at its smallest: the head pod
    and the GPU group's minReplicas worker pods (Ray counts a pod's CPU and GPU limits). In
    total only: that each replica fits on one pod is not checked."""
    service = _rayservice()[0]["spec"]
    serve_config = yaml.safe_load(service["serveConfigV2"])
    need = _redeploy_need(serve_config["applications"][0]["deployments"])
    cluster = service["rayClusterConfig"]
    pods = [(1, cluster["headGroupSpec"])]
    pods += [(group["minReplicas"], group) for group in cluster["workerGroupSpecs"]]
    have = {"CPU": 0.0, "GPU": 0.0}
    for count, group in pods:
        [container] = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        have["CPU"] += count * float(limits["cpu"])
        have["GPU"] += count * float(limits.get("nvidia.com/gpu", 0))
    for resource, count in have.items():
        assert need[resource] <= count + 1e-9, f"rayservice.yaml needs {need}, has {have}"


def test_serve_direct_gives_the_ingress_inferences_settings() -> None:
    from clients.serve_command import _serve_config

    config, app = _serve_config(ROOT / "deploy" / "serve_config.gpu.yaml", {"topology": "direct"})
    [ingress] = config["applications"][0]["deployments"]  # Inference is hosted by Ingress
    assert app.topology == "direct" and ingress["name"] == "Ingress"
    assert ingress["user_config"]["max_batch_size"] == 64
    # Inference's 0.075 GPU each, halved: room for the redeploy surge (max_surge_percent 100)
    assert ingress["ray_actor_options"]["num_gpus"] == 0.0375
    env_vars = config["applications"][0]["runtime_env"]["env_vars"]
    assert env_vars["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="port"):
        AppConfig.model_validate({"port": 70000})
    with pytest.raises(ValueError, match="kind"):
        AppConfig.model_validate({"engine": {"kind": "tensorflow"}})
    with pytest.raises(ValueError, match="Extra inputs"):
        AppConfig.model_validate({"prot": 9000})
    with pytest.raises(ValueError, match="gpu_hybrid_decode needs decode: gpu"):
        AppConfig.model_validate({"experimental": {"gpu_hybrid_decode": True}})


def test_serve_stops_when_the_ingress_cannot_bind_its_port() -> None:
    """Another process took the port after `raystream serve` found it free: Serve would
    retry the replica and never be ready; raystream stops at the first such error."""
    import io
    import time

    from clients.serve_command import _FatalErrorWatch

    line = (
        "(ServeReplica:raystream:Ingress pid=7) RuntimeError: Failed to bind to address "
        "127.0.0.1:46515; set GRPC_VERBOSITY=debug environment variable to see more\n"
    )
    watch = _FatalErrorWatch(io.StringIO(line))
    deadline = time.monotonic() + 5
    while watch.error is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the watch's thread
    assert watch.error == "Failed to bind to address 127.0.0.1:46515: is the port in use?"


def test_kuberay_rayservice_embeds_a_valid_serve_config() -> None:
    from ray.serve.schema import ServeDeploySchema

    service = _rayservice()[0]
    assert service["kind"] == "RayService" and service["apiVersion"] == "ray.io/v1"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    args = serve_config["applications"][0]["args"]
    # Paths in the manifest exist only in the cluster's image: check the rest of the args.
    AppConfig.model_validate({**args, "security": {}})
    assert set(args["security"]) == {"tls_cert", "tls_key", "auth_token_file"}


ROLES = {"Ingress": "raystream_ingress", "Preprocess": "raystream_decode"}
ROLES |= {"Inference": "raystream_inference", "Postprocess": "raystream_decode"}


def test_the_cluster_config_places_each_stage_by_its_nodes_resource() -> None:
    """Each deployment asks for its role's custom resource, which ray_cluster.yaml's node
    types declare; clients reach it from other machines, so with TLS and a token."""
    app = yaml.safe_load(CLUSTER_CONFIG.read_text())["applications"][0]
    launcher = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    declared = {r for t in launcher["available_node_types"].values() for r in t["resources"]}
    for d in app["deployments"]:
        assert set(d["ray_actor_options"]["resources"]) == {ROLES[d["name"]]}, d["name"]
    assert set(ROLES.values()) <= declared
    assert app["args"]["host"] == "0.0.0.0"
    assert set(app["args"]["security"]) == {"tls_cert", "tls_key", "auth_token_file"}


def test_the_cluster_launcher_turns_token_auth_on_and_keeps_the_dashboard_local() -> None:
    config = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    starts = [
        command
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for command in config[key]
        if "ray start" in command
    ]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token " in c for c in starts)
    assert "~/.ray/auth_token" in config["file_mounts"]  # the same token on every node
    [head] = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in head
    text = (ROOT / "ray_cluster.yaml").read_text()
    assert "0.0.0.0" not in text and "ray-client-server-port" not in text


def test_the_kuberay_service_turns_token_auth_on_and_keeps_ray_inside_the_cluster() -> None:
    service, policy = _rayservice()
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "raystream-ray-token"}
    head = cluster["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    # The operator deploys the Serve config through the dashboard, over the head Service:
    # it must listen on the pod's address (KubeRay's default), behind the token.
    assert "dashboard-host" not in head["rayStartParams"]
    [container] = head["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "metrics": 8080, "grpc": 9000}
    # The NetworkPolicy covers every Ray pod, and opens only gRPC to anyone.
    label = policy["spec"]["podSelector"]["matchLabels"]
    groups = [head, *cluster["workerGroupSpecs"]]
    assert all(g["template"]["metadata"]["labels"].items() >= label.items() for g in groups)
    rules = policy["spec"]["ingress"]
    from_anyone = [r for r in rules if "from" not in r]
    assert [p["port"] for r in from_anyone for p in r["ports"]] == [9000]
    # Every rule names its ports: Ray's own are pinned alike on every pod, and only those
    # (with the GCS and the dashboard) are open between the pods, beside the stage ports.
    assert all(rule.get("ports") for rule in rules)
    pins = [g["rayStartParams"] for g in groups]
    keys = ("node-manager-port", "object-manager-port", "runtime-env-agent-port")
    keys += ("dashboard-agent-grpc-port", "dashboard-agent-listen-port")
    assert all({k: p[k] for k in keys} == {k: pins[0][k] for k in keys} for p in pins)
    pinned = {6379, 8265, *(int(pins[0][k]) for k in keys)}
    pinned |= set(range(int(pins[0]["min-worker-port"]), int(pins[0]["max-worker-port"]) + 1))
    [ray_rule] = [r for r in rules if 6379 in _ports(r)]
    assert _ports(ray_rule) == pinned
    [stage_rule] = [r for r in rules if 9100 in _ports(r)]
    assert _ports(stage_rule) == set(range(9100, 9164))
    dashboard = [r for r in rules if r is not ray_rule and 8265 in _ports(r)]
    [operator] = dashboard[0]["from"]
    assert operator["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}


def _ports(rule: dict) -> set[int]:
    """The ports a NetworkPolicy rule admits."""
    return {n for p in rule["ports"] for n in range(p["port"], p.get("endPort", p["port"]) + 1)}


def _calls(app) -> tuple[str, list]:
    """A bound deployment's name and the deployments it calls (the handles it is given)."""
    bound = app._bound_deployment
    return bound.name, [_calls(a) for a in bound.init_args[1:] if hasattr(a, "_bound_deployment")]


@pytest.mark.parametrize(
    ("topology", "calls"),
    [
        (
            "chained",
            ("Ingress", [("Preprocess", []), ("Inference", [("Postprocess", [])])]),
        ),
        (
            [["preprocess", "inference"], ["postprocess"]],
            ("Ingress", [("Inference", [("Postprocess", [])])]),
        ),
        ("fused", ("Ingress", [("Inference", [])])),
        ("direct", ("Ingress", [])),
    ],
)
def test_the_ingress_calls_the_groups_up_to_inference_and_inference_calls_the_rest(
    topology, calls
) -> None:
    from serve_app.app import build_app

    app = build_app({"model_repository": str(ROOT / "models"), "topology": topology})
    assert _calls(app) == calls


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_stage_calls_go_by_value_under_serve_deploy_and_raystream_serve(path: Path) -> None:
    """The configs with stage deployments raise the replicas' message limit themselves (for
    `serve deploy`), and `raystream serve` raises it for any config that does not."""
    import yaml

    from clients.serve_command import _serve_config
    from serve_app.config import BY_VALUE_ENV, MESSAGE_LIMIT_ENV

    app = yaml.safe_load(path.read_text())["applications"][0]
    if app["args"].get("topology") != "direct":
        assert app["runtime_env"]["env_vars"] == BY_VALUE_ENV
    if path in HOST_CONFIGS:
        config, _ = _serve_config(path, {})
        env_vars = config["applications"][0]["runtime_env"]["env_vars"]
        assert env_vars[MESSAGE_LIMIT_ENV] == BY_VALUE_ENV[MESSAGE_LIMIT_ENV]


def test_autoscaled_stage_deployments_count_their_port_calls(tmp_path: Path) -> None:
    """Calls over the stage ports are not Serve requests: every shipped autoscaled stage
    deployment names raystream's policy (for `serve deploy` and KubeRay), and `raystream
    serve` names it where a config names no policy, keeping one that a config names."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    from clients.serve_command import _serve_config
    from serve_app.pipeline.autoscaling import POLICY

    apps = [yaml.safe_load(path.read_text())["applications"][0] for path in SERVE_CONFIGS]
    apps.append(yaml.safe_load(_rayservice()[0]["spec"]["serveConfigV2"])["applications"][0])
    autoscaled = [
        d["autoscaling_config"]
        for app in apps
        for d in app.get("deployments", [])
        if d["name"] != "Ingress" and "autoscaling_config" in d
    ]
    assert len(autoscaled) == 3  # the default's Preprocess, the cluster's and KubeRay's Inference
    assert all(a["policy"] == {"policy_function": POLICY} for a in autoscaled), autoscaled

    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    deployments = {d["name"]: d for d in config["applications"][0]["deployments"]}
    del deployments["Preprocess"]["autoscaling_config"]["policy"]
    serves_own = {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}
    del deployments["Inference"]["num_replicas"]
    deployments["Inference"]["autoscaling_config"] = {"policy": serves_own}
    deployments["Postprocess"]["num_replicas"] = "auto"  # Serve's default autoscaling
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    served, _ = _serve_config(path, {})
    policies = {
        d["name"]: d.get("autoscaling_config", {}).get("policy")
        for d in served["applications"][0]["deployments"]
    }
    assert policies == {
        "Ingress": None,
        "Preprocess": {"policy_function": POLICY},
        "Inference": serves_own,
        "Postprocess": {"policy_function": POLICY},
    }
    ServeDeploySchema.model_validate(served)
    # ...and builds the autoscaling configs with these policies (num_replicas "auto": its
    # fields over Serve's defaults, as Serve merges them)
    for d in served["applications"][0]["deployments"]:
        if "autoscaling_config" in d:
            fields = d["autoscaling_config"]
            if d.get("num_replicas") == "auto":
                fields = {**AutoscalingConfig.default().model_dump(exclude_unset=True), **fields}
            built = AutoscalingConfig(**fields)
            assert built.policy.policy_function == policies[d["name"]]["policy_function"]


PORTS = [9100, 9163]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"topology": "direct"}, []),
        ({"topology": "direct", "stage_ports": PORTS}, []),
        ({"topology": "fused"}, ["Ingress -> Inference: Serve handle"]),
        (
            {"topology": "fused", "stage_ports": PORTS},
            ["Ingress -> Inference: stage port, else Serve handle"],
        ),
        (
            {"topology": "chained"},
            [
                "Ingress -> Preprocess: Serve handle",
                "Ingress -> Inference: Serve handle",
                "Inference -> Postprocess: Serve handle",
            ],
        ),
        (
            {"topology": "chained", "stage_ports": PORTS},
            [
                "Ingress -> Preprocess: stage port, else Serve handle",
                "Preprocess -> Inference: stage port, else Serve handle",
                "Inference -> Postprocess: stage port, else Serve handle",
            ],
        ),
        (
            {"topology": [["preprocess", "inference"], ["postprocess"]]},
            ["Ingress -> Inference: Serve handle", "Inference -> Postprocess: Serve handle"],
        ),
        (
            {"topology": [["preprocess", "inference"], ["postprocess"]], "stage_ports": PORTS},
            [
                "Ingress -> Inference: stage port, else Serve handle",
                "Inference -> Postprocess: stage port, else Serve handle",
            ],
        ),
    ],
)
def test_the_route_of_each_topology(settings, expected) -> None:
    """One description of who calls whom and how (serve_app/pipeline/route.py), which the
    ready line and ModelInfo.route print."""
    from serve_app.pipeline.route import route

    assert [str(hop) for hop in route(AppConfig.model_validate(settings)).hops] == expected


@pytest.mark.parametrize(
    ("topology", "ports", "ingress_holds", "next_of"),
    [
        ("direct", None, [], {}),
        ("fused", None, ["Inference"], {}),
        ("chained", None, ["Preprocess", "Inference"], {"Inference": "Postprocess"}),
        (
            "chained",
            PORTS,
            ["Preprocess", "Inference"],
            {"Preprocess": "Inference", "Inference": "Postprocess"},
        ),
    ],
)
def test_build_app_binds_the_deployments_its_route_names(
    model_repository, topology, ports, ingress_holds, next_of
) -> None:
    """build_app binds what the route says, and hands every deployment the same Wiring: the
    ingress holds the handles up to Inference, each stage deployment the one it calls."""
    from serve_app.app import build_app
    from serve_app.pipeline.route import Wiring

    app = build_app(
        {"model_repository": str(model_repository), "topology": topology, "stage_ports": ports}
    )
    ingress = app._bound_deployment
    config, wiring, *handles = ingress.init_args
    assert isinstance(wiring, Wiring) and "stage_token" not in config and "instance" not in config
    assert wiring.route.hops == Wiring.of(AppConfig.model_validate(config)).route.hops
    assert [h._bound_deployment.name for h in handles] == ingress_holds
    bound = {}
    for handle in handles:  # walk the stage deployments, each to the one it calls
        while handle is not None:
            deployment = handle._bound_deployment
            _, given, _, handle = deployment.init_args
            assert given is wiring  # one route for every deployment
            bound[deployment.name] = None if handle is None else handle._bound_deployment.name
    assert {k: v for k, v in bound.items() if v} == next_of


# Settings that people set: every field of the application args, nested models' fields
# counted one by one, with the Inference deployment's user_config; not the experimental block.
USER_FIELD_LIMIT = 30


def _fields(model: type, prefix: str = "") -> list[str]:
    from pydantic import BaseModel

    from serve_app.config import ModelEntry

    names = []
    for name, field in model.model_fields.items():
        nested = field.annotation
        if isinstance(nested, type) and issubclass(nested, BaseModel) and nested is not ModelEntry:
            names += _fields(nested, f"{prefix}{name}.")
        else:
            names.append(f"{prefix}{name}")
    return names


def test_a_person_can_read_every_setting() -> None:
    """At most 30 settings, each with its line in docs/configuration.md."""
    from serve_app.config import BatchingConfig

    fields = [f for f in _fields(AppConfig) if not f.startswith("experimental.")]
    fields += _fields(BatchingConfig)
    assert len(fields) <= USER_FIELD_LIMIT, fields
    documented = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f for f in fields if f"| `{f}` |" not in documented]
    assert not missing, f"settings without their line in docs/configuration.md: {missing}"


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        ({"stage_calls": "port"}, "stage_ports"),
        ({"model_version": "2"}, "models"),
        ({"cache": {"enabled": True}}, "cache.max_bytes"),
        ({"tracing": {"enabled": True}}, "tracing.otlp_endpoint"),
        ({"model_control": {"enabled": True}}, "model_control.token_file"),
        ({"shared_images_bytes": 1 << 20}, "shared memory"),
        ({"preprocess_threads": 4}, "num_cpus"),
        ({"limits": {"drain_timeout_s": 5}}, "graceful_shutdown_timeout_s"),
        ({"preprocess_decodes_on_gpu": True}, "experimental"),
        ({"instance": "x"}, "build_app"),
    ],
)
def test_a_setting_that_went_says_what_to_write_instead(args, hint) -> None:
    ((section, value),) = args.items()
    name = next(iter(value)) if isinstance(value, dict) else section
    with pytest.raises(ValueError, match=f"'{name}' is no longer a setting") as refused:
        AppConfig.model_validate(args)
    assert hint in str(refused.value)


def test_batching_settings_that_went_say_so() -> None:
    from serve_app.config import BatchingConfig

    with pytest.raises(ValueError, match="'batcher' is no longer a setting"):
        BatchingConfig.model_validate({"batcher": "serve"})


def test_the_drain_follows_the_deployments_graceful_shutdown() -> None:
    """The ingress drains for its deployment's graceful_shutdown_timeout_s less a margin
    for closing (Serve kills the replica at its end), at least half of it; outside a
    replica, for Serve's default less the margin."""
    from serve_app.pipeline.topology import drain_timeout_s
    from serve_app.tuning import DRAIN_MARGIN_S, GRACEFUL_SHUTDOWN_S
    from serve_app.tuning import drain_timeout_s as drain_for

    assert drain_for(60.0) == 60.0 - DRAIN_MARGIN_S
    assert drain_for(8.0) == 4.0
    assert drain_for(None) == drain_timeout_s() == GRACEFUL_SHUTDOWN_S - DRAIN_MARGIN_S


@pytest.mark.parametrize(
    ("cpus", "threads", "in_worker"),
    [
        (None, 2, True),
        (0.5, 2, True),
        (2.0, 2, True),
        (2.5, 3, True),
        (12.0, 12, True),
        (12.0, 2, False),
    ],
)
def test_the_decode_threads_follow_the_replicas_num_cpus(
    monkeypatch, cpus, threads, in_worker
) -> None:
    """A replica decodes on as many threads as the CPUs Ray gave it (ray_actor_options'
    num_cpus, rounded up), at least 2 (one stays free for cheap images); outside Ray, or in
    a driver (a test session that started Ray), 2."""
    import ray

    from serve_app.pipeline import topology

    class Context:
        worker = SimpleNamespace(mode=ray.WORKER_MODE if in_worker else ray.SCRIPT_MODE)

        def get_assigned_resources(self) -> dict[str, float]:
            assert in_worker, "only available when the process is a worker"  # as Ray's
            return {} if cpus is None else {"CPU": cpus}

    monkeypatch.setattr(ray, "is_initialized", lambda: cpus is not None)
    monkeypatch.setattr(ray, "get_runtime_context", Context)
    assert topology.decode_threads() == threads
