"""Scale-out on Ray Serve (`pip install 'lockgate[ray]'`, `lockgate serve
--replicas N`): the engine `ray` (`lockgate_register_engines`).

The front process keeps HTTP, the plugin pipeline (validate, template,
tokenize, enqueue) and the error contract; its model's engine is a
`RayEngine`, so `lockgate_enqueue` hands each request's work to an engine
replica on Ray Serve and gets back a handle that streams the deltas. Each
replica (`replica.EngineReplica`) loads the model and runs the same
`Engine` a single-process server runs.

* `affinity` — the prompt-prefix hashes the router places requests by;
* `replica` — the replica's side;
* `engine` — the front's side (`RayEngine`, `RemoteRequestHandle`);
* `routing` — prefix-affinity request router;
* `board` — where replicas post their figures for `/health` and `/metrics`;
* `deployment` — starting Ray and deploying the replicas;
* `app` — the replicas as an application for a KubeRay `RayService`.
"""

from __future__ import annotations

import pluggy

from lockgate.models import Model, open_model
from lockgate.models.loading import source_options
from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.settings import Setting

__all__ = ["application_name", "serve_on_ray"]

#: the Ray namespace of the replica boards
NAMESPACE = "lockgate"


#: the settings this plugin adds to `lockgate serve`
SETTINGS = (
    Setting("replicas", str, None,
            "engine replicas on Ray Serve (`lockgate[ray]`; given, it chooses the `ray` engine): a number, or "
            "`auto` to scale between "
            "`--min-replicas` and `--max-replicas` on ongoing requests",
            default_text="none: one engine in this process", metavar="N"),
    Setting("min_replicas", int, 1, "fewest replicas with `--replicas auto`"),
    Setting("max_replicas", int, 4, "most replicas with `--replicas auto`"),
    Setting("ray_address", str, "local",
            "the Ray cluster replicas run on: `local` starts one in this process; `auto` or "
            "`HOST:6379` joins an existing one from one of its nodes (KubeRay included), and attaches to "
            "replicas already deployed there as `lockgate-<served model name>`", metavar="ADDRESS"),
    Setting("gpus_per_replica", float, 0.0, "GPUs Ray gives each replica (0: CPU replicas)"),
    Setting("cpus_per_replica", float, 1.0,
            "CPUs Ray reserves for each replica (its executor threads are `--num-threads`)"),
)


@hookimpl
def lockgate_register_engines(register):
    # `--replicas` chooses this engine when `--engine` names none
    register("ray", serve_on_ray, chosen_by="replicas")


@hookimpl
def lockgate_add_settings(register) -> None:
    for setting in SETTINGS:
        register(setting)


def serve_on_ray(pm: pluggy.PluginManager, settings, progress=None, reserve=None) -> Model:
    """The model `settings` names, served by engine replicas on Ray Serve
    (`settings.replicas` of them, on the cluster at `settings.ray_address`).
    On a cluster that already runs the application `lockgate-<model name>`
    (deployed by a KubeRay `RayService`, see `lockgate.plugins.ray.app`),
    the front attaches to its replicas instead of deploying its own.
    Returns once the replicas have loaded the model; `Model.close()` takes
    down what this call deployed. `reserve` is not called: the replicas'
    memory is the cluster's to place, not this server's budget's."""
    from lockgate.plugins.ray.board import ReplicaBoard
    from lockgate.plugins.ray.deployment import (
        RayCluster, ReplicaPlan, board_name, deploy, running_application, undeploy,
    )
    from lockgate.plugins.ray.engine import RayEngine

    plan = ReplicaPlan.from_settings(settings)
    source = open_model(pm, settings.model_source, progress=progress, **source_options(settings))
    source.metadata = None
    app_name = application_name(source.name)
    cluster = RayCluster(settings.ray_address)
    ray = cluster.ray
    deployment = None if settings.ray_address == "local" else running_application(app_name)
    owned = deployment is None
    board = None
    try:
        board = ray.remote(ReplicaBoard).options(
            name=board_name(app_name), namespace=NAMESPACE, num_cpus=0, get_if_exists=True
        ).remote()
        if owned:
            if progress:
                progress(f"starting {plan.count or f'{plan.low}..{plan.high}'} engine replicas on Ray Serve")
            deployment = deploy(settings, plan, app_name, board_name(app_name), NAMESPACE)
        elif progress:
            progress(f"attaching to the engine replicas of {app_name} on Ray Serve")
        description = deployment.describe.remote().result()
    except BaseException:
        if board is not None and owned:
            ray.kill(board)
        cluster.close()
        raise

    def close() -> None:
        if owned:
            undeploy(app_name)
            ray.kill(board)
        cluster.close()

    engine = RayEngine(
        source.name, deployment, board,
        retry_after=settings.engine_options().retry_after,
        prefix_affinity=settings.prefix_cache,
        description=description,
        on_close=close,
    )
    return source.serve_with(engine)


def application_name(model_name: str) -> str:
    """The Ray Serve application of the engine replicas serving `model_name`."""
    return f"lockgate-{model_name}"
