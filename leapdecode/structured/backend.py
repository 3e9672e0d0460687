"""The grammar backend: compile a `StructuredSpec` once per (spec, tokenizer) and hand out per-request matchers.

The grammar library sits behind the adapters in adapters.py (llguidance by default, xgrammar available). JSON
schemas are lowered for it (lowering.py) and what the grammar cannot enforce is checked by the guard (guard.py).
Compilation runs on a worker thread under a time limit, and the result (or a deterministic error) is cached
by the spec's canonical text, so a thousand requests with the same schema compile it once. A cache hit costs
only the spec's shape check and a dict lookup: the meta-schema check (jsonschema, the costly part of
validation) runs only on a miss, in the compile thread, and its verdict is cached by schema text too.

Time limit: our own passes over the schema (lowering, the guard's anchors) check a cooperative deadline
(`lowering.deadline`) and stop when it passes; a compilation that times out is never cached, and at most
`compile_workers` compilations run at once: beyond that a new one is refused at once with a ValueError (a 400),
so hostile schemas cannot queue up work or block the compilation of others. See README.md in this folder for
the per-keyword list.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from leapdecode.structured.adapters import LIBRARIES, Library, make_library
from leapdecode.structured.guard import FreeOrder, SchemaGuard, TokenMarks, free_order_sites
from leapdecode.structured.lowering import CompileTimeout, deadline, declared_only, prepared
from leapdecode.structured.matcher import Matcher
from leapdecode.structured.spec import StructuredSpec, check_spec, parse_structured

__all__ = ["CompiledGrammar", "GrammarBackend", "LIBRARIES", "fill_bitmasks"]


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint, immutable and shared by every request with the same spec.

    `dropped` lists what the grammar does NOT enforce (e.g. "uniqueItems", "pattern (look-around)"); when
    non-empty, `guard` checks those with jsonschema during decoding. `guard` is set for every JSON schema
    (a cheap end-of-document check even when nothing was dropped, in case the library errs).
    """

    spec: StructuredSpec
    library: str
    handle: Any = field(repr=False)
    dropped: tuple[str, ...] = ()
    guard: SchemaGuard | None = field(default=None, repr=False)
    compile_s: float = 0.0

    @property
    def exact(self) -> bool:
        """True when the grammar alone enforces the whole spec."""
        return not self.dropped


class GrammarBackend:
    """Compiles specs for one tokenizer and creates matchers. Build one per tokenizer; thread-safe.

    tokenizer:         a `transformers.PreTrainedTokenizerFast` (its eos_token_id is the stop token).
    library:           "llguidance" (default) or "xgrammar".
    compile_timeout_s: a compilation that takes longer is a ValueError; its thread stops at the same deadline
                       (cooperatively, inside our passes) and nothing is cached for it.
    compile_workers:   compilations that may run at once; a cache miss beyond that is a ValueError right away.
    llg_limits:        `llguidance.LLParserLimits` for every grammar (None: the library's defaults).
    guard:             enforce with jsonschema what the grammar cannot (guard.py). Only benchmarks of the raw
                       library turn it off: without it, schemas with dropped keywords can yield invalid JSON.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        library: str = "llguidance",
        compile_timeout_s: float = 10.0,
        cache_size: int = 256,
        compile_workers: int = 4,
        eos_token_ids: list[int] | None = None,
        guard: bool = True,
        llg_limits: Any = None,
    ) -> None:
        self._lib: Library = make_library(library, tokenizer, llg_limits)
        self.library = library
        self.vocab_size: int = self._lib.vocab_size
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        if not eos_token_ids:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_token_ids=")
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.native_eos: int | None = getattr(self._lib, "eos", None)  # the EOS the library itself masks
        self.compile_timeout_s = compile_timeout_s
        self.guard = guard
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compile_workers = compile_workers
        self._slots = threading.BoundedSemaphore(compile_workers)
        self._checked: OrderedDict[str, str | None] = OrderedDict()  # schema text -> meta-schema error or None
        self._closed = False
        self._token_bytes: list[bytes] | None = None
        self._marks: TokenMarks | None = None
        self._executor: Any = None
        self._workers = Workers(compile_workers, name="grammar-compile")
        if guard:  # ~1 s for a 128k vocabulary: paid at startup, not inside the first guarded request's masks
            self.byte_marks().warm()

    # -- compile -------------------------------------------------------------------------------------------
    def compile_async(self, structured: Any) -> Future[CompiledGrammar]:
        """Start (or join) the compilation of `structured`; shape errors, and a full compile pool, raise
        ValueError right here; everything else (meta-schema, library refusals, time limit) lands in the future."""
        spec = parse_structured(structured, check=False)
        with self._lock:
            future = self._cached(spec)
            if future is not None:
                return future
            if self._closed:
                raise ValueError("the grammar backend is shut down")
            if not self._slots.acquire(blocking=False):
                raise ValueError(
                    f"{_describe(spec)}: {self.compile_workers} grammar compilations are already running; "
                    "retry later (the schema was not compiled)"
                )
            future = Future()
            future.set_running_or_notify_cancel()
            self._cache[spec.cache_key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        try:
            self._workers.submit(self._run, spec, future)
        except BaseException:
            self._forget(spec, future)
            self._slots.release()
            raise
        return future

    def _run(self, spec: StructuredSpec, future: Future[CompiledGrammar]) -> None:
        result: CompiledGrammar | None = None
        error: BaseException | None = None
        try:
            with deadline(self.compile_timeout_s):
                result = self._compile_now(spec)
        except CompileTimeout:
            self._forget(spec, future)  # a time-out is not a property of the schema: never cache it
            error = ValueError(self._timeout_message(spec, self.compile_timeout_s))
        except ValueError as e:  # the schema is refused: cached, so a resubmission fails fast
            error = e
        except BaseException as e:  # a bug (ours, or the library's outside its compile call): reported, not cached
            self._forget(spec, future)
            error = ValueError(f"{_describe(spec)}: compilation failed on an internal error (not the schema's "
                               f"fault; please report it): {e!r}")
        finally:
            self._slots.release()  # before the future resolves, so whoever waits on it finds the slot free
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _forget(self, spec: StructuredSpec, future: Future[CompiledGrammar]) -> None:
        with self._lock:
            if self._cache.get(spec.cache_key) is future:
                del self._cache[spec.cache_key]

    def _cached(self, spec: StructuredSpec) -> Future[CompiledGrammar] | None:
        """The cache entry for `spec`, marked as recently used (call with the lock held)."""
        future = self._cache.get(spec.cache_key)
        if future is not None:
            self._cache.move_to_end(spec.cache_key)
        return future

    def compile(self, structured: Any, *, timeout_s: float | None = None) -> CompiledGrammar:
        """Compile (cached) within the time limit. Any problem with the spec is a ValueError naming it."""
        spec = parse_structured(structured, check=False)
        future = self.compile_async(spec)
        limit = self.compile_timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=limit)
        except FutureTimeout:
            if limit >= self.compile_timeout_s:
                self._forget(spec, future)  # the thread stops at its deadline; a retry starts afresh
            raise ValueError(self._timeout_message(spec, limit)) from None

    @staticmethod
    def _timeout_message(spec: StructuredSpec, limit: float) -> str:
        return f"{_describe(spec)}: grammar compilation exceeded the time limit of {limit:g} s"

    def _check(self, spec: StructuredSpec) -> None:
        """The meta-schema check, its verdict cached by schema text (a cache miss of the grammar, e.g. after an
        eviction, or a timed-out compile retried, does not pay it again)."""
        if spec.kind != "json_schema":
            return
        with self._lock:
            known = self._checked.get(spec.text, False)
            if known is not False:
                self._checked.move_to_end(spec.text)
        if known is False:
            try:
                check_spec(spec)
                known = None
            except ValueError as e:
                known = str(e)
            with self._lock:
                self._checked[spec.text] = known
                while len(self._checked) > 4 * self._cache_size:
                    self._checked.popitem(last=False)
        if known is not None:
            raise ValueError(known)

    def _compile_now(self, spec: StructuredSpec) -> CompiledGrammar:
        start = time.perf_counter()
        self._check(spec)
        schema = spec.schema if spec.kind in ("json_object", "json_schema") else None
        if spec.kind == "json_schema":       # (a fresh parse: edited in place)
            schema = prepared(schema, any_order=spec.key_order == "any")
            if spec.strict:                  # objects take only the keys they declare (spec.py)
                schema = declared_only(schema)
        free_order = FreeOrder({}, [])
        if self.guard and spec.kind == "json_schema" and spec.key_order == "any":
            free_order = free_order_sites(schema)  # the guard checks what the relaxed grammar lets through
        try:
            handle, dropped = self._lib.compile(spec, schema, relax=free_order.keys(), expand=free_order.expanded,
                                                unions=free_order.union_ids())
        except CompileTimeout:
            raise
        except ValueError as e:
            raise ValueError(f"{_describe(spec)}: not supported by {self.library}: {_first_line(e)}") from None
        except Exception as e:  # a library bug must not kill the engine: surface it as bad input
            raise ValueError(f"{_describe(spec)}: {self.library} failed to compile it: {e!r}") from None
        guard = None
        if self.guard and spec.kind in ("json_object", "json_schema"):
            try:
                guard = SchemaGuard(schema, dropped=dropped, free_order=free_order)
            except ValueError as e:
                raise ValueError(f"{_describe(spec)}: {e}") from None
        return CompiledGrammar(spec, self.library, handle, dropped, guard, time.perf_counter() - start)

    # -- matchers ------------------------------------------------------------------------------------------
    def matcher(self, compiled: CompiledGrammar) -> Matcher:
        """A fresh per-request matcher at the start of the output."""
        if compiled.library != self.library:
            raise ValueError(f"grammar compiled by {compiled.library}, backend is {self.library}")
        return Matcher(self._lib.new_state(compiled.handle), self, compiled)

    def fill_native(self, jobs: list[tuple[Any, int, list[int]]], bitmask: torch.Tensor) -> None:
        """Fill rows for unguarded llguidance matchers in parallel in native threads (the GIL is released)."""
        if self._executor is None:
            self._executor = self._lib.executor()
        if not bitmask.is_contiguous() or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu":
            raise ValueError("bitmask must be a contiguous CPU int32 tensor")
        row_bytes, rows = bitmask.shape[1] * 4, bitmask.shape[0]
        plain = [(m, row) for m, row, drafts in jobs if not drafts]
        with_drafts = [job for job in jobs if job[2]]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, rows)
        if with_drafts:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(with_drafts, bitmask.data_ptr(), row_bytes, rows)

    def token_bytes(self) -> list[bytes]:
        """Bytes of every token id (built once; used by the guard)."""
        if self._token_bytes is None:
            self._token_bytes = self._lib.token_bytes()
        return self._token_bytes

    def byte_marks(self) -> TokenMarks:
        """Which tokens contain the bytes that can close a JSON value or key (built once; used by the guard)."""
        if self._marks is None:
            self._marks = TokenMarks.build(self.token_bytes())
        return self._marks

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        from leapdecode.structured.bitmask import allocate_token_bitmask

        return allocate_token_bitmask(rows, self.vocab_size)

    def shutdown(self) -> None:
        """Refuse new compilations (running ones stop at their deadline)."""
        self._closed = True


class Workers:
    """Up to `size` daemon threads that run submitted calls, started on demand; each exits after `idle_s` without
    work. Threads are kept between compilations because a thread per compilation cost ~0.3 ms of CPU more
    (llguidance's thread-local state built and torn down each time, the teardown running on after the result was
    out); they hold no reference to the backend while idle, so a dropped backend's threads go too. A forked child
    (which inherits the count but none of the threads) starts its own."""

    def __init__(self, size: int, *, name: str, idle_s: float = 60.0) -> None:
        self.size, self.name, self.idle_s = size, name, idle_s
        self._start()

    def _start(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.threads = 0
        self._pid = os.getpid()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Queue `fn(*args)`; a new thread starts while fewer than `size` run (the caller bounds the work in
        flight to `size`, so a queued call never waits behind a busy thread for long)."""
        if os.getpid() != self._pid:    # a forked child has none of its parent's threads: start afresh
            self._start()
        with self._lock:
            if self.threads < self.size:
                threading.Thread(target=self._loop, name=self.name, daemon=True).start()
                self.threads += 1
            self._jobs.put((fn, args))

    def _loop(self) -> None:
        while True:
            try:
                fn, args = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:        # under the lock: a call queued from now on starts a thread of its own
                    if self._jobs.empty():
                        self.threads -= 1
                        return
                continue
            fn(*args)
            del fn, args


def fill_bitmasks(jobs: list[tuple[Matcher, int, list[int]]], bitmask: torch.Tensor) -> list[int]:
    """Batched fill for one engine step; safe to run in a thread while the forward pass runs.

    Each job is (matcher, first_row, drafts): rows first_row .. first_row + n are filled, where n is how many
    of `drafts` the grammar accepts (the draft positions plus the bonus). Returns n per job, so the caller
    can cut each request's drafts to its valid prefix. The matchers end in the state they started in.
    """
    counts = [0] * len(jobs)
    native: dict[int, tuple[GrammarBackend, list[tuple[Any, int, list[int]]], list[Matcher]]] = {}
    for i, (matcher, row, drafts) in enumerate(jobs):
        job = matcher.native_job(row, drafts)
        if job is None:
            counts[i] = matcher.fill_bitmasks(bitmask, row, drafts)
        else:
            counts[i] = len(job[2])
            entry = native.setdefault(id(matcher.backend), (matcher.backend, [], []))
            entry[1].append(job)
            entry[2].append(matcher)
    for backend, native_jobs, matchers in native.values():
        backend.fill_native(native_jobs, bitmask)
        for (_, row, drafts), matcher in zip(native_jobs, matchers):
            matcher.finish_native(bitmask, row, drafts)
    return counts


def _describe(spec: StructuredSpec) -> str:
    if spec.kind == "json_schema":
        return f"json_schema {spec.name!r}"
    return f"{spec.kind} spec"


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text if len(text) < 500 else text[:500] + "..."
