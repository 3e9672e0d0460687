"""Start (or join) a Ray cluster, start engine instances in it, and put the proxy's backend in front of them.

    app, cluster = serve_cluster(llm_kwargs, prefill=1, decode=1)     # or replicas=2
    uvicorn.run(app)                                                  # the OpenAI API, unchanged

Each instance is an ``EngineInstance`` actor that Ray restarts when its process dies (``max_restarts``); calls in
flight when it died fail (the proxy retries or reports them, see backend.py), calls made while it restarts wait for
it. On a GPU node each instance takes one GPU (``num_gpus=1``); on CPU each takes ``num_cpus`` logical CPUs
(default 0: a small machine can host more instances than cores, each with ``num_threads`` torch threads).
"""
from __future__ import annotations

import logging
from typing import Any

from leapdecode.cluster.backend import ClusterEngine, Instance
from leapdecode.cluster.frontend import EngineFront, FrontLLM
from leapdecode.cluster.instance import EngineInstance

logger = logging.getLogger(__name__)

RAY_HINT = "Ray is needed to serve with several instances: pip install 'ray>=2.40'"


def start_instances(llm_kwargs: dict, *, replicas: int = 0, prefill: int = 0, decode: int = 0,
                    ray_address: str | None = None, num_threads: int | None = None, num_cpus: float = 0,
                    num_gpus: float | None = None, max_restarts: int = 3, max_queued_requests: int = 512,
                    ready_timeout: float = 600.0, **backend_kwargs: Any) -> ClusterEngine:
    """Start the instances (joining the Ray cluster at ``ray_address``, or a local one) and wait until each has
    loaded its model; returns the proxy's backend, which stops them at its shutdown."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(RAY_HINT) from None
    for name, value in (("replicas", replicas), ("prefill", prefill), ("decode", decode)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if not replicas and not (prefill and decode):
        raise ValueError("give replicas >= 1, or prefill >= 1 and decode >= 1")
    if replicas and (prefill or decode):
        raise ValueError("replicas cannot be combined with prefill/decode instances")
    if llm_kwargs.get("tensor_parallel_size", 1) > 1 and not replicas:
        raise ValueError("prefill/decode disaggregation does not support tensor_parallel_size > 1 yet "
                         "(KV transfer reads one process's cache); use replicas")
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    if num_gpus is None:
        device = llm_kwargs.get("device")
        num_gpus = 1 if device is not None and str(device).startswith("cuda") else 0
    actor_class = ray.remote(EngineInstance).options(max_restarts=max_restarts, max_task_retries=0,
                                                      num_cpus=num_cpus, num_gpus=num_gpus)
    layout = [("replica", replicas), ("prefill", prefill), ("decode", decode)]
    instances = []
    for role, count in layout:
        for k in range(count):
            name = f"{role}-{k}"
            actor = actor_class.remote(name, role, llm_kwargs, num_threads, max_queued_requests)
            instances.append(Instance(name, role, actor))
    try:
        infos = ray.get([inst.actor.ping.remote() for inst in instances], timeout=ready_timeout)
    except Exception:
        _stop(instances, started_ray)
        raise
    for inst, info in zip(instances, infos):
        inst.pid = info["pid"]
    block_size = llm_kwargs.get("block_size", 16)
    return ClusterEngine(instances, block_size, on_shutdown=lambda: _stop(instances, started_ray), **backend_kwargs)


def serve_cluster(llm_kwargs: dict, *, api_key: str | None = None, served_model_name: str | None = None,
                  app_kwargs: dict | None = None, **instance_kwargs: Any):
    """The OpenAI app in front of new instances: ``(app, backend)``."""
    from leapdecode.server import build_app
    front = FrontLLM(EngineFront(llm_kwargs))
    backend = start_instances(llm_kwargs, **instance_kwargs)
    app = build_app(front, api_key=api_key, served_model_name=served_model_name, backend=backend,
                    **(app_kwargs or {}))
    return app, backend


def _stop(instances: list[Instance], shutdown_ray: bool) -> None:
    import ray
    for inst in instances:
        try:
            ray.kill(inst.actor, no_restart=True)
        except Exception:                      # noqa: BLE001 - already gone
            pass
    if shutdown_ray:
        ray.shutdown()
