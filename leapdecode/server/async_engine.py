"""The bridge between asyncio handlers and the single-threaded engine.

The engine is not thread-safe, so exactly one thread ever touches it: ``AsyncEngine``'s engine thread. Handlers
talk to it only through an inbox of commands ("add these requests", "abort that one", "stop"), and the engine
thread talks back through ``RequestHandle`` objects.

Why a handle keeps only the *latest* output instead of an ever-growing queue: engine outputs are cumulative (the
whole text and token list so far), so a slow client never needs the intermediate ones. A handle therefore holds a
bounded amount of memory however slowly its client reads, and the engine thread never blocks on a client.

Backpressure: requests accepted but not yet scheduled (in the inbox or in the engine's waiting queue) are counted;
past ``max_queued_requests`` a new request is refused at once (the server answers 503 with Retry-After). Running
requests are bounded by the engine's own ``max_num_seqs``, so memory is bounded end to end.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from leapdecode.decoding.beam_search import BeamSearchParams
from leapdecode.native import release_openmp_threads
from leapdecode.outputs import RequestOutput
from leapdecode.sampling_params import SamplingParams
from leapdecode.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# A prompt, or a function run on the engine thread that returns one. The server itself only ever submits token
# ids: tokenization, chat templates and grammar compilation run in preprocess.py's worker pool, so nothing slow
# reaches the engine thread; strings and callables remain for embedders.
PromptLike = str | list[int] | Callable[[], str | list[int]]


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the client should retry later."""


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down or has died; no new work is accepted."""


class RequestHandle:
    """One HTTP request's view of its engine requests (several with a list of prompts).

    The engine thread calls ``_publish``/``_fail``; the event loop iterates the handle. Iterating yields a
    snapshot (one ``RequestOutput | None`` per engine request) each time something changed, and ends once every
    engine request has finished.
    """

    def __init__(self, owner: "AsyncEngine", request_ids: list[str], loop: asyncio.AbstractEventLoop) -> None:
        self.request_ids = request_ids
        self._owner = owner
        self._loop = loop
        self._lock = threading.Lock()
        self._latest: list[RequestOutput | None] = [None] * len(request_ids)
        self._error: BaseException | None = None
        self._wake_pending = False
        self._changed = asyncio.Event()
        self._aborted = False
        self.finished = False
        # Set by a consumer that reads only the final outputs: a cluster backend may then restart a request whose
        # instance died from its prompt even after tokens were published (a streaming client has seen them).
        self.replayable = False

    # -- engine thread side -----------------------------------------------------------------------------------
    def _publish(self, index: int, output: RequestOutput) -> None:
        with self._lock:
            self._latest[index] = output
            self._schedule_wake()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            self._schedule_wake()

    def _schedule_wake(self) -> None:
        """Coalesce wake-ups: at most one callback in flight on the loop, however many steps happen meanwhile."""
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:            # the loop is closed: nobody is listening any more
            self._wake_pending = False

    # -- event loop side --------------------------------------------------------------------------------------
    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        self._changed.set()

    def snapshot(self) -> list[RequestOutput | None]:
        with self._lock:
            return list(self._latest)

    async def __aiter__(self):
        while not self.finished:
            await self._changed.wait()
            self._changed.clear()
            with self._lock:
                snap, error = list(self._latest), self._error
            if error is not None:
                raise error
            if all(o is not None and o.finished for o in snap):
                self.finished = True
            yield snap

    def abort(self) -> None:
        """Stop whatever is still running and free its KV blocks. Idempotent; safe after completion."""
        if self.finished or self._aborted or not self._owner.running:
            return
        self._aborted = True
        self._owner._post(("abort", self))


class AsyncEngine:
    """Owns the engine thread. All methods except the ``_engine_*`` ones are called from the event loop."""

    def __init__(self, llm: Any, max_queued_requests: int = 512, metrics: ServerMetrics | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        if not isinstance(max_queued_requests, int) or max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be a positive integer, got {max_queued_requests!r}")
        self.llm = llm
        self.engine = llm.engine
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics or ServerMetrics()
        self._inbox: deque[tuple] = deque()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()
        self._queued = 0                 # accepted engine requests not yet scheduled (guarded by _lock)
        self._thread: threading.Thread | None = None
        self._accepting = True
        self.dead: BaseException | None = None
        self.on_failure = on_failure     # called (on the engine thread) once the engine has died
        # Engine-thread-only state.
        self._handles: dict[str, tuple[RequestHandle, int]] = {}
        self._unscheduled: set[str] = set()
        self._tokens_seen: dict[str, int] = {}
        self._stats_seen = {"draft_tokens": 0, "accepted_tokens": 0}

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            # The engine thread is to be the only one running the model: the thread starting it (the one that
            # built the model, in `leapdecode serve`) gives back its OpenMP workers first (native.py's why).
            release_openmp_threads()
            self._thread = threading.Thread(target=self._engine_loop, name="leapdecode-engine", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    @property
    def accepting(self) -> bool:
        """False once shutdown began or the engine died (the health check reports 503 then)."""
        return self._accepting and self.dead is None

    @property
    def num_queued(self) -> int:
        with self._lock:
            return self._queued

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Refuse new work, give in-flight requests ``drain_timeout`` seconds to finish, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._handles and time.monotonic() < deadline and self.running:
            await asyncio.sleep(0.05)
        if self._thread is None:
            return
        self._post(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    # -- submission -------------------------------------------------------------------------------------------
    async def submit(self, prompts: Sequence[PromptLike], params: Sequence[SamplingParams],
                     request_ids: Sequence[str]) -> RequestHandle:
        """Add one engine request per prompt, all or nothing. Raises the engine's ValueError for bad input,
        QueueFullError when the wait queue is full, EngineUnavailableError when shutting down or dead."""
        if self.dead is not None or not self._accepting:
            raise EngineUnavailableError("the engine is not accepting requests (shutting down or stopped)")
        self.start()
        k = len(prompts)
        with self._lock:
            # A single request bigger than the whole bound is still let in when nothing else is waiting.
            if self._queued > 0 and self._queued + k > self.max_queued_requests:
                raise QueueFullError(f"{self._queued} requests are already waiting "
                                     f"(max_queued_requests={self.max_queued_requests})")
            self._queued += k
        loop = asyncio.get_running_loop()
        handle = RequestHandle(self, list(request_ids), loop)
        admitted: asyncio.Future = loop.create_future()
        self._post(("add", handle, list(prompts), list(params), admitted, time.time()))
        if self.dead is not None:
            # The engine thread died after the check above; its farewell sweep of the inbox may have missed us.
            raise EngineUnavailableError("the engine is not running")
        try:
            await admitted
        except BaseException:
            handle.abort()              # cancelled while waiting: the add may still happen, so withdraw it
            raise
        return handle

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the engine thread between two steps and return its result (or raise its error): how
        embedders reach the engine itself (a cluster instance exports and imports KV blocks this way)."""
        if self.dead is not None or not self._accepting:
            raise EngineUnavailableError("the engine is not accepting requests (shutting down or stopped)")
        self.start()
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._post(("call", fn, done))
        return await done

    def _post(self, command: tuple) -> None:
        self._inbox.append(command)
        self._wakeup.set()

    # -- the engine thread ------------------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._engine_drain_inbox():
                    break
                if engine.has_unfinished():
                    outputs = engine.step()
                    self._engine_dispatch(outputs)
                    if not outputs:
                        time.sleep(0.001)   # nothing schedulable this step; do not spin a core
                else:
                    self._engine_observe()
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
        except BaseException as exc:       # an engine bug: fail every request loudly, refuse new ones
            logger.exception("engine thread died")
            self.dead = exc
            err = EngineUnavailableError(f"the engine failed: {type(exc).__name__}: {exc}")
            for handle, _ in list(self._handles.values()):
                handle._fail(err)
            self._engine_refuse_inbox(err)
            self._handles.clear()
            if self.on_failure is not None:
                try:
                    self.on_failure(exc)
                except Exception:          # noqa: BLE001 - a failing hook must not hide the engine's failure
                    logger.exception("the engine-failure hook failed")
            return
        self._engine_stop()

    def _engine_drain_inbox(self) -> bool:
        """Run queued commands in arrival order. False once a stop command was seen."""
        while self._inbox:
            command = self._inbox.popleft()
            if command[0] == "add":
                self._engine_add(*command[1:])
            elif command[0] == "abort":
                self._engine_abort(command[1], "abort")
            elif command[0] == "call":
                self._engine_call(*command[1:])
            elif command[0] == "stop":
                return False
        self._engine_observe()
        return True

    def _engine_add(self, handle: RequestHandle, prompts: list[PromptLike], params: list[SamplingParams],
                    admitted: asyncio.Future, arrival: float) -> None:
        added: list[str] = []
        try:
            for request_id, prompt, p in zip(handle.request_ids, prompts, params):
                if callable(prompt):
                    prompt = prompt()
                add = self.engine.add_beam_request if isinstance(p, BeamSearchParams) else self.engine.add_request
                add(request_id, prompt, p, arrival_time=arrival)
                added.append(request_id)
        except Exception as exc:
            for request_id in added:
                self.engine.abort(request_id)
            with self._lock:
                self._queued -= len(handle.request_ids)
            self._resolve(admitted, exc)
            return
        for index, request_id in enumerate(handle.request_ids):
            self._handles[request_id] = (handle, index)
            self._unscheduled.add(request_id)
            self._tokens_seen[request_id] = 0
        self._resolve(admitted, None)

    def _engine_call(self, fn: Callable[[], Any], done: asyncio.Future) -> None:
        try:
            result = fn()
        except Exception as exc:             # the caller's error, not the engine's: hand it back
            self._resolve(done, exc)
            return
        self._resolve(done, None, result)

    def _resolve(self, future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
        try:
            future.get_loop().call_soon_threadsafe(settle)
        except RuntimeError:
            pass

    def _engine_abort(self, handle: RequestHandle, reason: str) -> None:
        for request_id in handle.request_ids:
            if request_id not in self._handles:
                continue
            self.engine.abort(request_id)
            self._engine_forget(request_id)
            self.metrics.finished.labels(finish_reason=reason).inc()

    def _engine_forget(self, request_id: str) -> None:
        self._handles.pop(request_id, None)
        self._tokens_seen.pop(request_id, None)
        self._engine_mark_scheduled(request_id)

    def _engine_mark_scheduled(self, request_id: str) -> None:
        if request_id in self._unscheduled:
            self._unscheduled.discard(request_id)
            with self._lock:
                self._queued -= 1

    def _engine_dispatch(self, outputs: list[RequestOutput]) -> None:
        m = self.metrics
        for out in outputs:
            entry = self._handles.get(out.request_id)
            if entry is None:
                continue
            if out.request_id in self._unscheduled:
                self._engine_mark_scheduled(out.request_id)
                m.prompt_tokens.inc(len(out.prompt_token_ids))
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            m.generation_tokens.inc(max(0, num_tokens - self._tokens_seen.get(out.request_id, 0)))
            self._tokens_seen[out.request_id] = num_tokens
            handle, index = entry
            handle._publish(index, out)
            if out.finished:
                m.observe_finished(out)
                self._engine_forget(out.request_id)
        self._engine_observe()

    def _engine_observe(self) -> None:
        """Refresh the gauges and the speculation counters from the engine (engine thread only)."""
        engine, m = self.engine, self.metrics
        bm = engine.block_manager
        m.kv_blocks_free.set(bm.num_free_blocks)
        m.kv_blocks_used.set(bm.num_blocks - bm.num_free_blocks)
        m.kv_blocks_total.set(bm.num_blocks)
        m.requests_waiting.set(len(self._unscheduled))
        m.requests_running.set(len(self._handles) - len(self._unscheduled))
        for key, counter in (("draft_tokens", m.spec_draft_tokens), ("accepted_tokens", m.spec_accepted_tokens)):
            value = engine.stats.get(key, 0)
            if value > self._stats_seen[key]:
                counter.inc(value - self._stats_seen[key])
            self._stats_seen[key] = value

    def _engine_refuse_inbox(self, err: BaseException) -> None:
        """Settle every waiting add and call with ``err`` (the engine will not run them)."""
        for command in list(self._inbox):
            if command[0] in ("add", "call"):
                self._resolve(command[-1] if command[0] == "call" else command[4], err)
        self._inbox.clear()

    def _engine_stop(self) -> None:
        """Abort everything still in flight (its clients get an error event / 503) and leave the pool empty."""
        err = EngineUnavailableError("the server is shutting down")
        self._engine_refuse_inbox(err)
        for handle, _ in list(self._handles.values()):
            self._engine_abort(handle, "abort")
            handle._fail(err)
        self._engine_observe()
