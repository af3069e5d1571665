"""Test helper: deploys the engine application the way a KubeRay `RayService`
does, from deploy/kuberay-rayservice.yaml's `serveConfigV2` (its args
overridden by the JSON in argv[2]), on a Ray cluster this process starts;
prints the cluster's address, then holds it until SIGTERM.

    python tests/support/ray_app_driver.py deploy/kuberay-rayservice.yaml '{"model": "..."}'
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys

import ray
import yaml
from ray import serve


def main() -> None:
    manifest, overrides = sys.argv[1], json.loads(sys.argv[2])
    service = next(doc for doc in yaml.safe_load_all(open(manifest)) if doc["kind"] == "RayService")
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (application,) = config["applications"]
    args = {**application["args"], **overrides}
    env = {k: v for k, v in os.environ.items() if k.startswith("LOCKGATE_") or k == "PYTHONPATH"}
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
             num_cpus=int(os.environ.get("DRIVER_NUM_CPUS", "4")), runtime_env={"env_vars": env})
    assert config["proxy_location"] == "Disabled"
    serve.start(http_options={"location": "NoServer"})
    module, attr = application["import_path"].split(":")
    build = getattr(importlib.import_module(module), attr)
    serve.run(build(args), name=application["name"], route_prefix=application["route_prefix"])
    print(ray.get_runtime_context().gcs_address, flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    main()
