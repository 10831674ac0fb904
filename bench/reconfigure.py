"""Change the running raystream application's batching `user_config` without a restart, the
way `serve deploy` applies an edited config (Serve calls each replica's `reconfigure`):

    python bench/reconfigure.py deploy/serve_config.gpu-direct.yaml target_p99_ms=10 \
        batch_wait_timeout_s=0.002

CONFIG is the file `raystream serve --config` started from (unchanged: any other difference
would restart replicas); each KEY=VALUE (a YAML value, `null` for the default) goes into the
user_config of the deployment that batches (Inference, or Ingress in topology direct). Run on
the machine of that Ray cluster; each run starts from CONFIG's user_config. Prints the
user_config applied.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("changes", nargs="+", metavar="KEY=VALUE")
    args = parser.parse_args()
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from clients.serve_command import _serve_config

    config, app = _serve_config(args.config, {})  # as raystream serve deployed it
    batching = "Ingress" if app.topology == "direct" else "Inference"
    deployment = next(d for d in config["applications"][0]["deployments"] if d["name"] == batching)
    user_config = deployment.setdefault("user_config", {})
    for change in args.changes:
        key, _, value = change.partition("=")
        user_config[key] = yaml.safe_load(value)
    ray.init(address="auto", log_to_driver=False)
    serve.start(proxy_location=config.get("proxy_location", "Disabled"))  # the running one
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config), _blocking=True)
    print(f"{batching} user_config: {user_config}")


if __name__ == "__main__":
    main()
