"""The proxy's engine: the server's ``AsyncEngine`` surface (submit, start, shutdown, accepting) over instances.

``build_app(front, backend=ClusterEngine(...))`` serves the OpenAI API unchanged in front of engine instances that
run in Ray actors (``instance.py``). Two layouts:

- **replicas**: every instance runs whole requests; ``PrefixRouter`` sends each to the instance most likely to
  hold its prompt's prefix (unless it is much busier).
- **disaggregated**: a prefill instance (prefix-routed) computes the prompt and exports the KV of its full blocks;
  Ray's object store carries them to a decode instance (the least busy), which imports them as a prefix-cache hit
  and streams the completion. The proxy only passes the payload's reference along; it never holds the KV.

Failures: an instance whose actor dies fails its in-flight calls; the proxy retries such a request once, from its
prompt, on a live instance (or on the same one, which Ray restarts) when nothing of it has reached the client yet
or the client only waits for the final answer (``RequestHandle.replayable``); otherwise the client gets a clear
error. A monitor pings every instance; ``health()`` says which are up, and the server's /health answers 503 while a
role has no live instance.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from leapdecode.cluster.router import PrefixRouter
from leapdecode.outputs import RequestOutput
from leapdecode.server.async_engine import EngineUnavailableError, QueueFullError, RequestHandle
from leapdecode.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


@dataclass
class Instance:
    """The proxy's view of one engine actor."""
    name: str
    role: str                 # "replica" | "prefill" | "decode"
    actor: Any                # a Ray actor handle of EngineInstance
    alive: bool = True
    pid: int | None = None    # the actor's process: a new one means Ray restarted it (its cache is empty)


@dataclass
class _Route:
    group: str
    index: int                # into the group's instances
    instance: Instance
    prefill: Instance | None = None


class ClusterEngine:
    def __init__(self, instances: Sequence[Instance], block_size: int, *, metrics: ServerMetrics | None = None,
                 health_interval: float = 1.0, ping_timeout: float = 5.0, retry_timeout: float = 120.0,
                 on_shutdown: Callable[[], None] | None = None) -> None:
        groups: dict[str, list[Instance]] = {"replica": [], "prefill": [], "decode": []}
        for inst in instances:
            groups[inst.role].append(inst)
        if groups["replica"] and (groups["prefill"] or groups["decode"]):
            raise ValueError("a cluster is either replicas or prefill + decode instances, not both")
        if not groups["replica"] and not (groups["prefill"] and groups["decode"]):
            raise ValueError("a disaggregated cluster needs at least one prefill and one decode instance")
        self.instances = list(instances)
        self.groups = {role: group for role, group in groups.items() if group}
        self.disaggregated = "replica" not in self.groups
        self.routers = {role: PrefixRouter(len(group), block_size) for role, group in self.groups.items()}
        self.metrics = metrics or ServerMetrics()
        self.health_interval, self.ping_timeout = health_interval, ping_timeout
        self.retry_timeout = retry_timeout            # how long a retry waits for a dead instance's restart
        self.on_shutdown = on_shutdown
        self.retries = 0                              # requests restarted from their prompt after a failure
        self._tasks: dict[RequestHandle, list[asyncio.Task]] = {}
        self._monitor: asyncio.Task | None = None
        self._accepting = True
        self._closed = False

    # -- the AsyncEngine surface used by the server -------------------------------------------------------------
    def start(self) -> None:
        if self._monitor is None and not self._closed:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    @property
    def running(self) -> bool:
        return not self._closed

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._closed and all(any(i.alive for i in g) for g in self.groups.values())

    @property
    def num_queued(self) -> int:
        return 0                                      # each instance bounds its own queue (QueueFullError)

    @property
    def num_in_flight(self) -> int:
        return sum(len(tasks) for tasks in self._tasks.values())

    async def submit(self, prompts: Sequence[Any], params: Sequence[Any], request_ids: Sequence[str]) -> RequestHandle:
        """One remote request per prompt, all or nothing: returns once every instance admitted its request, or
        raises its error (ValueError for bad input, QueueFullError, EngineUnavailableError)."""
        if not self.accepting:
            raise EngineUnavailableError("no live instance can take the request (starting, shutting down, or "
                                         "every instance of a role is down)")
        self.start()
        loop = asyncio.get_running_loop()
        handle = RequestHandle(self, list(request_ids), loop)
        admitted = [loop.create_future() for _ in prompts]
        arrival = time.time()
        self._tasks[handle] = [loop.create_task(self._serve(handle, i, rid, _token_ids(p), sp, admitted[i], arrival))
                               for i, (rid, p, sp) in enumerate(zip(request_ids, prompts, params))]
        for task in self._tasks[handle]:
            task.add_done_callback(lambda t, h=handle: self._task_done(h, t))
        try:
            for future in admitted:
                await future
        except BaseException:
            self._cancel(handle)
            raise
        return handle

    def _post(self, command: tuple) -> None:
        """RequestHandle.abort lands here: stop the handle's remote requests (their instances free the blocks)."""
        if command[0] == "abort":
            self._cancel(command[1])

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for handle in list(self._tasks):
            handle._fail(EngineUnavailableError("the server is shutting down"))
            self._cancel(handle)
        self._closed = True
        if self._monitor is not None:
            self._monitor.cancel()
        if self.on_shutdown is not None:
            self.on_shutdown()

    def health(self) -> dict:
        """What the server's /health reports for a cluster."""
        status = "ok" if all(i.alive for i in self.instances) else ("degraded" if self.accepting else "unavailable")
        return {"status": status, "layout": "disaggregated" if self.disaggregated else "replicas",
                "instances": [{"name": i.name, "role": i.role, "alive": i.alive} for i in self.instances]}

    # -- one remote request --------------------------------------------------------------------------------------
    async def _serve(self, handle: RequestHandle, index: int, request_id: str, prompt_ids: list[int], params: Any,
                     admitted: asyncio.Future, arrival: float) -> None:
        first_token: float | None = None
        for attempt in (0, 1):
            route = None
            try:
                route = self._route(prompt_ids)
                async for ref in self._open(route, request_id, prompt_ids, params):
                    out = await ref
                    if out is None:                   # the instance admitted the request
                        _settle(admitted)
                        continue
                    if first_token is None and any(c.token_ids for c in out.outputs):
                        first_token = time.time()
                    _client_clock(out, arrival, first_token)
                    handle._publish(index, out)
                    if out.finished:
                        self.metrics.observe_finished(out)
                return
            except asyncio.CancelledError:
                if route is not None:
                    self._abort_remote(route, request_id)
                raise
            except Exception as exc:                  # noqa: BLE001 - sorted below: the request's or an instance's
                failed = _failed_instances(exc, route)
                if not failed:                        # the request's own error (bad input, a full queue)
                    err = _cause(exc)
                    if admitted.done():
                        handle._fail(err)
                    else:
                        _settle(admitted, err)
                    return
                for inst in failed:
                    inst.alive = False
                published = handle.snapshot()[index]
                untouched = published is None or not any(c.token_ids for c in published.outputs)
                if (attempt == 0 and (untouched or handle.replayable) and self._accepting and not self._closed
                        and await self._until_live(self.retry_timeout)):
                    logger.warning("instance %s failed serving %s; retrying it from its prompt",
                                   failed[0].name, request_id)
                    self.retries += 1
                    first_token = None
                    continue
                err = EngineUnavailableError(f"instance {failed[0].name} failed while serving the request "
                                             f"({type(exc).__name__}); it is being restarted, retry the request")
                if admitted.done():
                    handle._fail(err)
                else:
                    _settle(admitted, err)
                return
            finally:
                if route is not None:
                    self._release(route)

    def _route(self, prompt_ids: list[int]) -> _Route:
        """The instance to run the request (disaggregated: a decode instance and the prefill instance before it)."""
        if self.disaggregated:
            p = self._pick("prefill", prompt_ids)
            d = self._pick("decode", prompt_ids, prefix_aware=False)
            return _Route("decode", d, self.groups["decode"][d], self.groups["prefill"][p])
        i = self._pick("replica", prompt_ids)
        return _Route("replica", i, self.groups["replica"][i])

    def _pick(self, role: str, prompt_ids: list[int], prefix_aware: bool = True) -> int:
        group, router = self.groups[role], self.routers[role]
        live = [i for i, inst in enumerate(group) if inst.alive] or list(range(len(group)))   # none: Ray restarts
        chosen = router.pick(prompt_ids if prefix_aware else [], live)
        router.started(chosen)
        return chosen

    def _open(self, route: _Route, request_id: str, prompt_ids: list[int], params: Any):
        if route.prefill is None:
            return route.instance.actor.generate.remote(request_id, prompt_ids, params)
        kv = route.prefill.actor.prefill.remote(request_id, prompt_ids)   # stays in the object store
        return route.instance.actor.generate.remote(request_id, prompt_ids, params, kv)

    def _release(self, route: _Route) -> None:
        self.routers[route.group].ended(route.index)
        if route.prefill is not None:
            self.routers["prefill"].ended(self.groups["prefill"].index(route.prefill))

    def _abort_remote(self, route: _Route, request_id: str) -> None:
        for inst in (route.instance, route.prefill):
            if inst is not None:
                try:
                    inst.actor.abort.remote(request_id)
                except Exception:                     # noqa: BLE001 - a dead actor has nothing to free
                    pass

    def _cancel(self, handle: RequestHandle) -> None:
        for task in self._tasks.get(handle, ()):
            task.cancel()

    def _task_done(self, handle: RequestHandle, task: asyncio.Task) -> None:
        tasks = self._tasks.get(handle)
        if tasks is None:
            return
        if not task.cancelled() and task.exception() is not None:    # a bug in _serve: fail the request
            handle._fail(task.exception())
        if all(t.done() for t in tasks):
            del self._tasks[handle]

    # -- health --------------------------------------------------------------------------------------------------
    async def _until_live(self, timeout: float) -> bool:
        """Wait until every role has a live instance again (Ray restarting a dead one takes a model load)."""
        deadline = time.monotonic() + timeout
        while not self.accepting:
            if time.monotonic() > deadline or self._closed:
                return False
            await asyncio.gather(*(self._ping(inst) for inst in self.instances if not inst.alive))
            await asyncio.sleep(0.2)
        return True

    async def _watch(self) -> None:
        while not self._closed:
            await asyncio.gather(*(self._ping(inst) for inst in self.instances))
            await asyncio.sleep(self.health_interval)

    async def _ping(self, inst: Instance) -> None:
        try:
            info = await asyncio.wait_for(_await_ref(inst.actor.ping.remote()), self.ping_timeout)
        except Exception:                             # noqa: BLE001 - dead, restarting or unreachable
            inst.alive = False
            return
        if inst.pid is not None and info["pid"] != inst.pid:
            group = self.groups[inst.role]
            self.routers[inst.role].forget(group.index(inst))   # restarted: its prefix cache is empty
        inst.pid, inst.alive = info["pid"], bool(info["accepting"])


async def _await_ref(ref: Any) -> Any:
    return await ref


def _token_ids(prompt: Any) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    raise TypeError("a cluster takes prompts as token ids (the server tokenizes in its preparation pool)")


def _settle(future: asyncio.Future, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _client_clock(out: RequestOutput, arrival: float, first_token: float | None) -> None:
    """Latencies as the proxy's client sees them (a decode instance never saw the prefill)."""
    m = out.metrics
    m.arrival_time, m.first_token_time = arrival, first_token
    if out.finished:
        m.finished_time = time.time()


def _cause(exc: BaseException) -> BaseException:
    """The error an instance raised, without Ray's wrapping (a ValueError stays a ValueError with its message)."""
    from ray.exceptions import RayTaskError
    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    if isinstance(cause, (ValueError, QueueFullError, EngineUnavailableError)):
        return cause
    return EngineUnavailableError(f"the request failed on its instance: {type(cause).__name__}: {cause}")


def _failed_instances(exc: BaseException, route: _Route | None) -> list[Instance]:
    """The instances of ``route`` that ``exc`` says died or became unreachable (empty: the request's own error)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, (RayActorError, ActorUnavailableError)):
        exc = exc.cause                               # the prefill's death, seen by the decode call that needed it
    if route is None or not isinstance(exc, (RayActorError, ActorDiedError, ActorUnavailableError)):
        return []
    dead = getattr(exc, "actor_id", None)
    members = [i for i in (route.prefill, route.instance) if i is not None]
    named = [i for i in members if dead is not None and i.actor._actor_id.hex() == dead]
    return named or members
