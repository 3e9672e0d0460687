"""A tensor-parallel group behind the executor boundary: one scheduler, N ranks, each running the same plan over its
shard of the model (Megatron-style sharding, see model/parallel_layers.py).

Rank 0 lives in the engine's process: it holds a ``ModelRunner`` over its shard, so the logits it gathers stay on
its device for the verifier, exactly where a single-device runner leaves them. Ranks 1..N-1 are worker processes
started here with torch.multiprocessing's spawn (rank r on ``cuda:base+r``, or all on the CPU). Two channels:

- control: one pipe per worker. Each step rank 0 sends the plan (frozen plain data, pickled once), and every worker
  builds its own inputs from it with the same deterministic ``InputBuffers.build``, applies the plan's KV moves to
  its own pool, and runs the forward;
- data: torch.distributed collectives inside the forward (gloo on CPU, nccl on CUDA): an all-reduce per
  row-parallel layer and for the embedding, the logits' vocabulary slices gathered on rank 0, and the previous
  step's sampled tokens (placeholders) broadcast from rank 0.

The KV pool size is agreed at start-up (the smallest any rank can hold), so one block manager speaks for every rank.

Faults: a worker that dies or raises makes the step that needs it raise ``TensorParallelError`` naming the rank (and
its traceback when it could send one), within the collectives' timeout (``LEAPDECODE_TP_TIMEOUT`` seconds, default
300, for a rank that hangs; a dead rank is noticed at once); the group is then shut down and every later call raises
the same error. ``close()`` (also run by ``Engine.close``/``LLM.close``, when the executor is collected, and at
interpreter exit) stops the workers, terminating any that do not stop in time. Workers exit on their own when the
engine's process dies (their pipe closes, or their collective loses its peer), so none is ever orphaned.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import time
import traceback
import weakref
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leapdecode.attention.kv_cache import KVLayout
from leapdecode.config import EngineConfig
from leapdecode.distributed.parallel_state import ParallelState, destroy_group, ensure_no_group, init_group
from leapdecode.engine.input_batch import ForwardBatch
from leapdecode.engine.model_runner import ForwardOutput, ModelRunner
from leapdecode.engine.step import StepPlan
from leapdecode.model.config import ModelConfig
from leapdecode.model.parallel_layers import check_shardable

TIMEOUT_S = float(os.environ.get("LEAPDECODE_TP_TIMEOUT", "300"))
STOP_WAIT_S = 10.0      # a worker asked to stop gets this long before it is terminated
NO_KV_TRANSFER = ("KV transfer (export_kv/import_kv, for prefill/decode disaggregation) is not supported with "
                  "tensor_parallel_size > 1: each rank holds a shard of the KV heads in its own pool; "
                  "use tensor_parallel_size=1 on both engines")


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed (a worker died, raised or timed out); the engine cannot step any more."""


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection

    def describe(self) -> str:
        code = self.process.exitcode
        return f"tensor-parallel worker rank {self.rank} " + ("is alive" if code is None else f"exited (code {code})")


class _Group:
    """The worker processes of one executor and its membership of the process group; shut down exactly once (by
    ``close``, after a failure, when the executor is collected, or at exit: it holds no reference to the executor)."""

    def __init__(self) -> None:
        self.workers: list[_Worker] = []
        self.joined = False
        self.closed = False

    def shutdown(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            for w in self.workers:
                with contextlib.suppress(OSError, ValueError):
                    w.conn.send(("stop",))
        else:       # a rank may be stuck in a collective: leave the group first so it fails fast
            self._leave()
        deadline = time.monotonic() + (STOP_WAIT_S if graceful else 0.0)
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(2.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
        self._leave()

    def _leave(self) -> None:
        if self.joined:
            self.joined = False
            destroy_group()


class TensorParallelExecutor:
    """The ``Executor`` of a tensor-parallel group (see the module docstring); ``runner`` is rank 0's shard."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, max_model_len: int) -> None:
        n = cfg.tensor_parallel_size
        check_shardable(model_cfg, n)
        devices = _rank_devices(cfg.torch_device, n)
        ensure_no_group()
        self._group = _Group()
        self._finalizer = weakref.finalize(self, self._group.shutdown)
        self._down: str | None = None
        ctx = mp.get_context("spawn")
        store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=TIMEOUT_S))
        try:
            for rank in range(1, n):
                parent, child = ctx.Pipe()
                worker_cfg = replace(cfg, device=str(devices[rank]), speculative_config=None)
                proc = ctx.Process(target=_worker_main, name=f"leapdecode-tp{rank}", daemon=True,
                                   args=(rank, n, store.port, worker_cfg, model_cfg, dtype, max_model_len,
                                         torch.get_num_threads(), child))
                proc.start()
                child.close()
                self._group.workers.append(_Worker(rank, proc, parent))
            for w in self._group.workers:
                self._expect(w, "hello")
            self.tp: ParallelState = init_group(0, n, store, devices[0], TIMEOUT_S)
            self._group.joined = True
            self.runner = ModelRunner(cfg, model_cfg, dtype, max_model_len, self.tp, self._agree_blocks)
        except BaseException:
            self._group.shutdown(graceful=False)
            raise
        self.num_blocks = self.runner.num_blocks
        self.num_window_blocks = self.runner.num_window_blocks
        self.defer_seals = self.runner.defer_seals

    # -- the executor protocol ---------------------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """Rank 0's inputs (each worker builds its own from the plan when the step runs)."""
        return self.runner.prepare(plan)

    def execute(self, plan: StepPlan, batch: ForwardBatch | None = None, last_sampled: torch.Tensor | None = None,
                capture: tuple[int, ...] = (), all_rows: bool = False) -> ForwardOutput:
        capture = tuple(capture)
        return self._on_all_ranks(("execute", plan, capture, all_rows),
                                  lambda: self.runner.execute(plan, batch, last_sampled, capture, all_rows))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states only rank 0 holds (DoLa's early exits): broadcast, then every rank's slice."""
        hidden = hidden.contiguous()

        @torch.inference_mode()
        def rank0() -> torch.Tensor:
            self.tp.broadcast(hidden)
            return self.runner.compute_logits(hidden)
        return self._on_all_ranks(("logits", tuple(hidden.shape), hidden.dtype), rank0)

    def read_kv_blocks(self, blocks: list[int]) -> list[tuple[torch.Tensor, ...]]:
        raise NotImplementedError(NO_KV_TRANSFER)

    def write_kv_blocks(self, blocks: list[int], data: list[tuple[torch.Tensor, ...]]) -> None:
        raise NotImplementedError(NO_KV_TRANSFER)

    def seal_kv_blocks(self, seals: tuple[tuple[int, int], ...]) -> None:
        raise NotImplementedError(NO_KV_TRANSFER)

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        self._group.shutdown()
        self._down = self._down or "the tensor-parallel executor is closed"

    # -- the group ---------------------------------------------------------------------------------------------
    @property
    def kv_cache(self):
        """Rank 0's KV pool (each rank has one of the same shape, over its own KV heads)."""
        return self.runner.kv_cache

    @property
    def kv_layout(self) -> KVLayout:
        """Rank 0's KV format (its share of the KV heads)."""
        return self.runner.kv_layout

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block on one rank: 1/N of the model's when its KV heads split evenly."""
        return self.runner.kv_bytes_per_block

    @property
    def workers(self) -> list[BaseProcess]:
        return [w.process for w in self._group.workers]

    def _on_all_ranks(self, command: tuple, rank0: Callable[[], Any]) -> Any:
        """Send ``command`` to every worker, run rank 0's part; any fault takes the whole group down."""
        if self._down is not None:
            raise TensorParallelError(self._down)
        dead = [w for w in self._group.workers if not w.process.is_alive()]
        if dead:
            self._fail(self._diagnose(dead[0]))
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for w in self._group.workers:
                w.conn.send_bytes(payload)
            return rank0()
        except BaseException as e:         # Ctrl-C too: the ranks are out of step now
            culprit = next((w for w in self._group.workers if self._failed(w)), None)
            if culprit is None:             # rank 0's own fault: its exception is the news
                self._fail(f"rank 0 failed: {type(e).__name__}: {e}", raise_=False)
                raise
            self._fail(self._diagnose(culprit), cause=e)

    def _failed(self, w: _Worker) -> bool:
        """Did this worker die or report an error (waiting a moment: its exit may trail the broken collective)?"""
        if w.conn.poll(0):
            return True
        w.process.join(1.0)
        return not w.process.is_alive()

    def _diagnose(self, w: _Worker) -> str:
        msg = None
        with contextlib.suppress(EOFError, OSError):
            if w.conn.poll(0.5):
                msg = w.conn.recv()
        w.process.join(1.0)
        if msg is not None and msg[0] == "error":
            return f"tensor-parallel worker rank {w.rank} failed:\n{msg[1]}"
        return w.describe()

    def _fail(self, reason: str, cause: BaseException | None = None, raise_: bool = True) -> None:
        self._down = f"the tensor-parallel group is down: {reason}"
        self._group.shutdown(graceful=False)
        if raise_:
            raise TensorParallelError(self._down) from cause

    def _expect(self, w: _Worker, kind: str) -> tuple:
        """The worker's next message, which must be ``kind``; an error, its death or the timeout raise."""
        deadline = time.monotonic() + TIMEOUT_S
        while not w.conn.poll(0.1):
            if not w.process.is_alive() and not w.conn.poll(0):
                raise TensorParallelError(f"{w.describe()} while starting")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel worker rank {w.rank} did not start within {TIMEOUT_S} s")
        try:
            msg = w.conn.recv()
        except EOFError:                        # it died without a word
            w.process.join(1.0)
            raise TensorParallelError(f"{w.describe()} while starting") from None
        if msg[0] == "error":
            raise TensorParallelError(f"tensor-parallel worker rank {w.rank} failed while starting:\n{msg[1]}")
        assert msg[0] == kind, msg
        return msg

    def _agree_blocks(self, own: int) -> int:
        """Every rank's pool gets the fewest blocks any rank can hold (ranks' free memory may differ)."""
        agreed = min([own] + [self._expect(w, "blocks")[1] for w in self._group.workers])
        for w in self._group.workers:
            w.conn.send(("blocks", agreed))
        return agreed


def _rank_devices(device: torch.device, n: int) -> list[torch.device]:
    """Rank r's device: the CPU for all, or ``cuda:base+r`` from the engine's GPU."""
    if device.type != "cuda":
        return [device] * n
    base = torch.cuda.current_device() if device.index is None else device.index
    if base + n > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs from cuda:{base}; "
                         f"{torch.cuda.device_count()} visible")
    return [torch.device("cuda", base + r) for r in range(n)]


# -- the worker process -------------------------------------------------------------------------------------------
def _worker_main(rank: int, size: int, port: int, cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype,
                 max_model_len: int, num_threads: int, conn: Connection) -> None:
    """Rank ``rank``: join the group, load this rank's shard, then run whatever rank 0 sends until "stop"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the engine's to handle; it stops us
    torch.set_num_threads(num_threads)
    try:
        conn.send(("hello",))
        if cfg.torch_device.type == "cuda":
            torch.cuda.set_device(cfg.torch_device)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        tp = init_group(rank, size, store, cfg.torch_device, TIMEOUT_S)
        runner = ModelRunner(cfg, model_cfg, dtype, max_model_len, tp, lambda n: _propose_blocks(conn, n))
        _serve(runner, conn)
    except (EOFError, BrokenPipeError):         # the engine is gone: nobody to report to
        pass
    except BaseException:                       # noqa: BLE001 - reported to rank 0, then this rank exits
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        os._exit(1)
    destroy_group()


def _propose_blocks(conn: Connection, own: int) -> int:
    conn.send(("blocks", own))
    return conn.recv()[1]


def _serve(runner: ModelRunner, conn: Connection) -> None:
    while True:
        command = conn.recv()
        op = command[0]
        if op == "stop":
            return
        if op == "execute":
            _, plan, capture, all_rows = command
            runner.execute(plan, capture=capture, all_rows=all_rows)
        elif op == "logits":
            _, shape, dtype = command
            hidden = runner.tp.broadcast(torch.empty(shape, dtype=dtype, device=runner.device))
            runner.compute_logits(hidden)
        else:
            raise ValueError(f"unknown tensor-parallel command {op!r}")
