"""Starting Ray, deploying the engine replicas on Ray Serve, and taking
them down again."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lockgate.settings import InvalidSetting

#: seconds between Ray Serve's health checks of a replica
HEALTH_CHECK_PERIOD = 2.0
#: ongoing requests per replica Ray Serve's autoscaler aims at, as a share
#: of what one replica admits (`--max-num-seqs`)
AUTOSCALE_TARGET_SHARE = 0.75


@dataclass(frozen=True)
class ReplicaPlan:
    """How many replicas: a fixed `count`, or autoscaled between `low` and `high`."""

    count: int | None
    low: int = 1
    high: int = 1

    @classmethod
    def from_settings(cls, settings) -> "ReplicaPlan":
        raw = str(settings.replicas).strip()
        if raw == "auto":
            if not 1 <= settings.min_replicas <= settings.max_replicas:
                raise InvalidSetting(
                    f"--min-replicas ({settings.min_replicas}) must be at least 1 and at most "
                    f"--max-replicas ({settings.max_replicas})"
                )
            return cls(None, settings.min_replicas, settings.max_replicas)
        try:
            count = int(raw)
        except ValueError:
            count = 0
        if count < 1:
            raise InvalidSetting(f"--replicas must be a positive integer or auto, got {raw!r}")
        return cls(count, count, count)


class RayCluster:
    """The Ray cluster the replicas run on: joined, or started in this
    process for `--ray-address local`; `close()` leaves what it started."""

    def __init__(self, address: str) -> None:
        try:
            import ray
        except ImportError:
            raise InvalidSetting(
                "--replicas needs Ray Serve: pip install 'lockgate[ray]'"
            ) from None
        self.ray = ray
        self.started_here = not ray.is_initialized()
        if self.started_here:
            # Replicas import lockgate and load plugins like this process:
            # they get its LOCKGATE_* variables and import path.
            env = {k: v for k, v in os.environ.items() if k.startswith("LOCKGATE_")}
            if os.environ.get("PYTHONPATH"):
                env["PYTHONPATH"] = os.environ["PYTHONPATH"]
            ray.init(
                # "local" starts a cluster even where this machine runs another
                address=address,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                runtime_env={"env_vars": env},
            )

    def close(self) -> None:
        if self.started_here:
            self.ray.shutdown()


def deployment_options(settings, plan: ReplicaPlan) -> dict:
    """The Ray Serve options of the engine deployment."""
    options = {
        "name": "engine",
        "ray_actor_options": {"num_cpus": settings.cpus_per_replica, "num_gpus": settings.gpus_per_replica},
        # what one engine admits, running and waiting: beyond it a replica
        # is full and the router tries another
        "max_ongoing_requests": settings.max_num_seqs + settings.max_queue,
        # requests the front holds while every replica is full; past that,
        # BackPressureError, which the front answers with 429
        "max_queued_requests": max(settings.max_queue, 1),
        "health_check_period_s": HEALTH_CHECK_PERIOD,
        "graceful_shutdown_timeout_s": settings.shutdown_grace,
    }
    if plan.count is None:
        options["autoscaling_config"] = {
            "min_replicas": plan.low,
            "max_replicas": plan.high,
            "target_ongoing_requests": max(1, int(settings.max_num_seqs * AUTOSCALE_TARGET_SHARE)),
        }
    else:
        options["num_replicas"] = plan.count
    if settings.prefix_cache:
        options["request_router_config"] = {
            "request_router_class": "lockgate.plugins.ray.routing:PrefixAffinityRouter",
            "request_router_kwargs": {"imbalance": max(1, settings.max_num_seqs // 2)},
        }
    return options


def engine_application(settings, plan: ReplicaPlan, board: str, namespace: str):
    """The Ray Serve application of the engine replicas (bound, not running)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from lockgate.plugins.ray.replica import EngineReplica

    options = deployment_options(settings, plan)
    if "request_router_config" in options:
        options["request_router_config"] = RequestRouterConfig(**options["request_router_config"])
    # each replica serves its one engine in-process
    replica_settings = settings.replaced(replicas=None)
    return serve.deployment(EngineReplica).options(**options).bind(replica_settings, board, namespace)


def deploy(settings, plan: ReplicaPlan, app_name: str, board: str, namespace: str):
    """Deploy the engine replicas as the Ray Serve application `app_name`
    and return its `DeploymentHandle` once every replica has loaded the model."""
    from ray import serve

    # the front is the HTTP server: Ray Serve runs no proxy of its own
    serve.start(http_options={"location": "NoServer"})
    return serve.run(engine_application(settings, plan, board, namespace), name=app_name, route_prefix=None)


def running_application(app_name: str):
    """The handle of engine replicas someone else deployed as `app_name`
    (a KubeRay `RayService`), or None when there is no such application."""
    from ray import serve

    try:
        applications = serve.status().applications
    except Exception:  # Serve is not running on this cluster
        return None
    if app_name not in applications:
        return None
    return serve.get_deployment_handle("engine", app_name=app_name)


def undeploy(app_name: str) -> None:
    from ray import serve

    try:
        serve.delete(app_name)
    except Exception:  # the cluster is going away anyway
        pass


def board_name(app_name: str) -> str:
    """The replica board of application `app_name` (one per application,
    so a front that attaches to replicas finds theirs)."""
    return f"{app_name}-board"

