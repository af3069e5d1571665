"""Scale-out on Ray Serve (`pip install 'lockgate[ray]'`, `lockgate serve
--replicas N`).

The front process keeps HTTP, the plugin pipeline (validate, template,
tokenize, enqueue) and the error contract; its model's engine is a
`RayEngine`, so `lockgate_enqueue` hands each request's work to an engine
replica on Ray Serve and gets back a handle that streams the deltas. Each
replica (`replica.EngineReplica`) loads the model and runs the same
`Engine` a single-process server runs.

* `wire` — what crosses between front and replica;
* `replica` — the replica's side;
* `engine` — the front's side (`RayEngine`, `RemoteRequestHandle`);
* `routing` — prefix-affinity request router;
* `board` — where replicas post their figures for `/health` and `/metrics`;
* `deployment` — starting Ray and deploying the replicas.
"""

from __future__ import annotations

import dataclasses

import pluggy

from lockgate.models import Model, open_model

__all__ = ["serve_on_ray"]

#: the Ray namespace of the replica boards
NAMESPACE = "lockgate"


def serve_on_ray(pm: pluggy.PluginManager, settings, progress=None) -> Model:
    """The model `settings` names, served by engine replicas on Ray Serve
    (`settings.replicas` of them, on the cluster at `settings.ray_address`).
    Returns once every replica has loaded the model; `Model.close()` takes
    them down."""
    from lockgate.plugins.ray.board import ReplicaBoard
    from lockgate.plugins.ray.deployment import RayCluster, ReplicaPlan, board_name, deploy, undeploy
    from lockgate.plugins.ray.engine import RayEngine

    plan = ReplicaPlan.from_settings(settings)
    chat_template = None if settings.chat_template is None else settings.chat_template.read_text()
    source = open_model(
        pm, settings.model, served_name=settings.served_model_name, chat_template=chat_template,
        tool_call_format=settings.tool_call_format, progress=progress,
    )
    source.metadata = None
    cluster = RayCluster(settings.ray_address)
    ray = cluster.ray
    board = None
    try:
        name = board_name()
        board = ray.remote(ReplicaBoard).options(name=name, namespace=NAMESPACE, num_cpus=0).remote()
        if progress:
            progress(f"starting {plan.count or f'{plan.low}..{plan.high}'} engine replicas on Ray Serve")
        # each replica serves its one engine in-process
        replica_settings = dataclasses.replace(settings, replicas=None)
        app_name = f"lockgate-{source.name}"
        deployment = deploy(replica_settings, plan, app_name, name, NAMESPACE)
        description = deployment.describe.remote().result()
    except BaseException:
        if board is not None:
            ray.kill(board)
        cluster.close()
        raise

    def close() -> None:
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
