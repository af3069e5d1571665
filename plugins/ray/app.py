"""The engine replicas as a Ray Serve application of their own, for a
cluster manager to deploy (a KubeRay `RayService`'s `serveConfigV2`, or
`serve run`): `import_path: lockgate.plugins.ray.app:build`, with the
settings of `lockgate serve` as `args` (names as in the settings table,
values as text). `served_model_name` is required and the application must
be named `lockgate-<served_model_name>`: a front started with
`lockgate serve --served-model-name NAME --ray-address ADDRESS` attaches
to it instead of deploying replicas itself. See deploy/kuberay-rayservice.yaml.
"""

from __future__ import annotations

from typing import Any

from lockgate.settings import InvalidSetting, Settings


def build(args: dict[str, Any]):
    """Ray Serve's application builder: `args` → the bound engine deployment."""
    import ray

    from lockgate.plugins.ray import NAMESPACE, application_name
    from lockgate.plugins.ray.board import ReplicaBoard
    from lockgate.plugins.ray.deployment import ReplicaPlan, board_name, engine_application

    settings = Settings.from_env(**{name: None if value is None else str(value) for name, value in args.items()})
    if not settings.served_model_name:
        raise InvalidSetting("the engine application needs served_model_name (the front names it too)")
    plan = ReplicaPlan.from_settings(settings) if settings.replicas is not None else ReplicaPlan(1, 1, 1)
    board = board_name(application_name(settings.served_model_name))
    if ray.is_initialized():
        # outlives this build task: the replicas and the front find it by name
        ray.remote(ReplicaBoard).options(
            name=board, namespace=NAMESPACE, num_cpus=0, get_if_exists=True, lifetime="detached"
        ).remote()
    return engine_application(settings, plan, board, NAMESPACE)
