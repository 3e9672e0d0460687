"""The engine: requests in, one step at a time, incremental outputs out.

    step():  propose drafts -> Scheduler.schedule -> StepPlan -> Executor.execute -> logits
             -> Verifier.verify -> StepResult -> Scheduler.update -> outputs

The engine orchestrates and owns the per-request things that are not scheduling: detokenizers, metrics, the
grammar driver and the speculator. It never edits a sequence: the scheduler does (see engine/scheduler.py).

With ``async_scheduling`` the step is overlapped (as in mini-sglang's overlap loop and vLLM's async scheduling):
step N+1 is planned and its inputs prepared while step N runs on the executor's worker thread, and step N's
tokens are committed (detokenized, stop-checked) while step N+1 runs. A sequence whose token is still in flight
has a placeholder that the next forward reads on the device. This is done only where it is safe, when no request
needs host-side tokens, state or hidden states before the next step (no drafts, no grammar, no penalties or
min_tokens, no Mirostat, contrastive search or DoLa); otherwise the engine drains and runs the plain synchronous
step. Either way the tokens are identical. A speculating engine overlaps too while its guard has the drafter off
(spec/guard.py): a vetoed speculator then costs what plain decoding costs.
"""
from __future__ import annotations

import atexit
import gc
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from leapdecode.config import EngineConfig, parse_dtype
from leapdecode.decoding.beam_search import BeamSearch, BeamSearchParams
from leapdecode.engine.beams import BeamRequests, beam_sampling_params
from leapdecode.decoding.contrastive import ContrastiveSearch
from leapdecode.engine.block_manager import BlockManager, chain_keys
from leapdecode.errors import InvalidParameter
from leapdecode.engine.detokenizer import Detokenizer
from leapdecode.engine.executor import Executor, build_executor
from leapdecode.engine.kv_transfer import KVTransfer, transfer_layout
from leapdecode.engine.scheduler import Scheduler
from leapdecode.engine.sequence import Sequence
from leapdecode.engine.step import ScheduledSeq, StepPlan, StepResult, lay_out
from leapdecode.engine.stop import StopChecker
from leapdecode.engine.structured_output import StructuredOutput
from leapdecode.model.loader import load_generation_defaults, load_model_config, load_tokenizer
from leapdecode.native import release_openmp_threads
from leapdecode.outputs import CompletionOutput, RequestMetrics, RequestOutput
from leapdecode.sampling.dola import LayerContrast
from leapdecode.sampling.verifier import Verifier
from leapdecode.sampling_params import SamplingParams
from leapdecode.spec.tree import EMPTY, DraftTree

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20
TOPK_FOR_DRAFTERS = 8   # Token Recycling learns the target's top-k successors at every verified position


def _decode_seqs(plan: StepPlan) -> int | None:
    """The plan's sequences if each computes one known token (a decode, with or without a draft), else None: the
    steps the speculation guard compares and the controller prices as decode-only."""
    return len(plan.seqs) if all(s.num_committed == 1 for s in plan.seqs) else None


def resolve_max_model_len(cfg: EngineConfig, model_cfg) -> int:
    """The context length served: the one configured, else the checkpoint's (capped at 8192)."""
    return cfg.max_model_len or min(model_cfg.max_position_embeddings, 8192)


def eos_token_ids(model_cfg, generation_defaults, tokenizer) -> set[int]:
    """Every token that ends a sequence: the config's, the generation config's and the tokenizer's."""
    eos = set(model_cfg.eos_token_id) | set(generation_defaults.eos_token_id)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    detoks: dict[int, Detokenizer] = field(default_factory=dict)
    overlap_safe: bool = True       # needs no host-side token before its next step (see the module docstring)
    draftable: bool = True          # its sequences may take speculative drafts
    beam: BeamSearch | None = None  # a beam search request: its seqs are the live beams
    stream: bool = True             # an output after every step that changed it; False: only the final one

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class _InFlight:
    """A step launched on the worker thread, not yet committed."""
    plan: StepPlan
    future: Future                  # -> (StepResult, sampled tokens tensor)
    started: float


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.device = cfg.torch_device
        self.model_cfg = load_model_config(cfg.model)
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        self.generation_defaults = load_generation_defaults(cfg.model)
        self.max_model_len = resolve_max_model_len(cfg, self.model_cfg)
        self.dtype = parse_dtype(cfg.dtype, self.model_cfg.dtype, self.device)
        self.runner: Executor = build_executor(cfg, self.model_cfg, self.dtype, self.max_model_len)
        self.vocab_size = self.model_cfg.vocab_size
        self.eos_token_ids = eos = eos_token_ids(self.model_cfg, self.generation_defaults, self.tokenizer)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                          self.runner.num_window_blocks, cfg.kv_cache_recent_tokens,
                                          self.runner.defer_seals)
        self.structured = StructuredOutput(self.tokenizer, eos, cfg.grammar_cache_size)
        self.requests: dict[str, Request] = {}
        # the stop checker's hooks close over what they read, not over the engine: no reference cycle, so an
        # engine nobody holds is freed (its GPU memory with it) by reference counting alone
        self.stops = StopChecker(eos, self.max_model_len, grammar=_grammar_hook(self.structured),
                                 text=_stop_string_hook(self.requests))
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_batched_tokens, cfg.max_num_seqs, self.stops)
        self.beams = BeamRequests(self.scheduler)
        self.seqs: dict[int, Sequence] = {}          # every unfinished sequence, by id
        self.speculator = None
        if cfg.speculative_config is not None:
            from leapdecode.spec.controller import StepTimeModel
            from leapdecode.spec.speculator import Speculator
            probe = self._probe_step_time() if cfg.speculative_config.adaptive else StepTimeModel()
            self.speculator = Speculator(cfg.speculative_config, self.vocab_size, probe, runner=self.runner)
        self._capture = tuple(getattr(self.speculator.drafter, "capture_layers", ())) if self.speculator else ()
        self.contrastive = ContrastiveSearch(self.vocab_size, eos, self.model_cfg.num_layers,
                                             cfg.max_num_batched_tokens, self.runner.num_blocks * cfg.block_size,
                                             self.max_model_len)
        self.dola = LayerContrast(self.runner.compute_logits, self.model_cfg.num_layers,
                                  self.model_cfg.tie_word_embeddings)
        self.verifier = Verifier(self.vocab_size, self.device, eos, cfg.seed, self.structured,
                                 TOPK_FOR_DRAFTERS if self.speculator and self.speculator.wants_topk else 0)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="leapdecode-step") if cfg.async_scheduling else None
        if self._worker is not None:    # the worker runs the forward passes: the loading thread's OpenMP workers go
            release_openmp_threads()    # (two pools throttle every step: leapdecode/native.py)
        self._inflight: _InFlight | None = None
        self._stepping_thread: int | None = None     # the thread of the last step (see `_check_thread`)
        self._warned_threads = False
        self._ended_outside_a_step: list[str] = []   # requests a fault ended before their step: output them once
        self._unscheduled: set[str] = set()           # requests not yet in any plan (first_scheduled_time)
        self.stats = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "draft_tokens": 0,
                      "accepted_tokens": 0, "overlapped_steps": 0}
        _freeze_startup_objects()

    def close(self) -> None:
        """Release the executor (its worker processes under tensor parallelism, its weights, KV pool and graphs)
        and the drafter's model; the engine cannot step afterwards. Its frozen start-up objects go back to the
        garbage collector, so what is left of it is collected too."""
        self.runner.close()
        self.speculator = None
        if self._worker is not None:
            self._worker.shutdown(wait=False)
        gc.unfreeze()

    @property
    def structured_backend(self):
        """The grammar backend for structured output (built on first use)."""
        return self.structured.backend

    # -- requests ----------------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids")
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameter(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param="prompt")
        return None, ids

    def _admit(self, request_id: str, prompt: str | list[int], params, kind: type) -> tuple[str | None, list[int]]:
        """The checks every request passes: a fresh id, parameters of the right kind, a prompt that fits."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, kind):
            raise ValueError(f"params must be a {kind.__name__}")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise InvalidParameter(f"prompt is {len(ids)} tokens long; max_model_len is {self.max_model_len} "
                                   "(the prompt must leave room for at least one generated token)", param="prompt")
        return text, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, stream: bool = True) -> None:
        """Validate and enqueue; every problem is a ValueError raised here, before anything is scheduled.
        ``stream=False``: :meth:`step` returns this request's output once, when it finishes (``LLM.generate``;
        vLLM's FINAL_ONLY), and its text is decoded then unless stop strings need it sooner: at batch 64 building
        an output per request per step was a tenth of the host's step."""
        text, ids = self._admit(request_id, prompt, params, SamplingParams)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > MAX_LOGPROBS:
                raise InvalidParameter(f"SamplingParams.{name} must be <= {MAX_LOGPROBS}, got {v}", param=name)
        if params.top_k > self.vocab_size:
            raise InvalidParameter(f"SamplingParams.top_k must be <= the vocabulary size {self.vocab_size} "
                                   f"(or -1 for off), got {params.top_k}", param="top_k")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameter(f"SamplingParams.stop_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}",
                                   param="stop_token_ids")
        bad = [t for t in params.logit_bias or {} if not t < self.vocab_size]
        if bad:
            raise InvalidParameter(f"SamplingParams.logit_bias keys must be token ids in [0, {self.vocab_size}), "
                                   f"got {bad[:5]}", param="logit_bias")
        compiled = None
        if params.structured is not None:
            if params.ignore_eos:
                raise ValueError("SamplingParams.ignore_eos cannot be combined with structured output "
                                 "(the grammar ends the output with eos)")
            compiled = self.structured.compile(params.structured)
        self.contrastive.check(params, len(ids))
        if params.dola_layers is not None:
            self.dola.layers(params.dola_layers)        # InvalidParameter unless the model has those layers
        seqs = [Sequence(request_id, i, ids, params) for i in range(params.n)]
        if compiled is not None:
            for seq in seqs:
                self.structured.attach(seq, compiled)
        req = Request(request_id, text, ids, params, seqs, RequestMetrics(arrival_time or time.time()),
                      overlap_safe=(compiled is None and not params.has_penalties and params.min_tokens == 0
                                    and not params.mirostat      # the next batch reads Mirostat's mu
                                    and not params.contrastive and params.dola_layers is None), stream=stream)
        for seq in seqs:
            self.contrastive.add(seq)
            req.detoks[seq.seq_id] = Detokenizer(self.tokenizer, ids, params.stop_strings,
                                                 params.skip_special_tokens, params.include_stop_str_in_output,
                                                 deferred=not stream)
            self.seqs[seq.seq_id] = seq
        self.requests[request_id] = req
        self._unscheduled.add(request_id)
        self.stats["prompt_tokens"] += len(ids)
        self.scheduler.add(seqs[0], seqs[1:])

    def add_beam_request(self, request_id: str, prompt: str | list[int], params: BeamSearchParams,
                         arrival_time: float | None = None) -> None:
        """Enqueue a beam search (engine/beams.py); its output, when the search ends, has one completion per
        hypothesis, best first. Every problem is a ValueError raised here."""
        text, ids = self._admit(request_id, prompt, params, BeamSearchParams)
        bad = [t for t in params.stop_token_ids if not t < self.vocab_size]
        if bad:
            raise InvalidParameter(f"BeamSearchParams.stop_token_ids must be in [0, {self.vocab_size}), got "
                                   f"{bad[:5]}", param="stop_token_ids")
        bs = self.cfg.block_size
        max_new = min(params.max_tokens, self.max_model_len - len(ids))
        worst = -(-len(ids) // bs) + params.beam_width * (-(-max_new // bs) + 1)
        if worst > self.block_manager.num_blocks:
            raise InvalidParameter(f"beam_width={params.beam_width} beams of up to {max_new} tokens after a "
                                   f"{len(ids)}-token prompt may need {worst} KV blocks; the cache has "
                                   f"{self.block_manager.num_blocks}", param="beam_width")
        if self.block_manager.windowed and params.beam_width > self.block_manager.num_window_blocks:
            raise InvalidParameter(f"beam_width={params.beam_width} beams need as many open blocks; the int8/int4 "
                                   f"KV cache's full-precision window holds {self.block_manager.num_window_blocks} "
                                   "(raise max_num_seqs or kv_cache_memory)", param="beam_width")
        search = BeamSearch(params, self.eos_token_ids, max_new)
        seq = Sequence(request_id, 0, ids, beam_sampling_params(search))
        search.start(seq.seq_id)
        self.beams.add(request_id, search)
        req = Request(request_id, text, ids, seq.params, [seq], RequestMetrics(arrival_time or time.time()),
                      overlap_safe=False, draftable=False, beam=search)
        self.seqs[seq.seq_id] = seq
        self.requests[request_id] = req
        self._unscheduled.add(request_id)
        self.stats["prompt_tokens"] += len(ids)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or already done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.beams.remove(request_id)
        self._unscheduled.discard(request_id)
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self._finished(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- KV transfer (prefill/decode disaggregation, engine/kv_transfer.py) ---------------------------------------
    def export_kv(self, token_ids: list[int]) -> KVTransfer:
        """The KV of the longest prefix of ``token_ids`` this engine's prefix cache holds (full blocks, chain order;
        may be empty), copied to the CPU. Between steps, on the engine's thread."""
        _, ids = self.tokenize(token_ids)
        self._apply_late_seals()
        blocks = self.block_manager.cached_blocks(ids)
        data = self.runner.read_kv_blocks(blocks)
        return KVTransfer(transfer_layout(self.runner.kv_layout), tuple(ids[:len(blocks) * self.cfg.block_size]),
                          tuple(data))

    def _apply_late_seals(self) -> None:
        """Quantize finished sequences' recent blocks now rather than in the next step (they are keyed already):
        before an export reads them or an import overwrites free blocks."""
        if self.block_manager.late_seals:
            if self._inflight is not None:
                wait([self._inflight.future])
            self.runner.seal_kv_blocks(self.block_manager.take_late_seals())

    def import_kv(self, transfer: KVTransfer) -> int:
        """Install another engine's exported blocks as prefix-cached free blocks, so the next request with that
        prefix adopts them like a prefix-cache hit. Blocks cached here already are kept, not overwritten. Returns
        how many tokens of the transfer's prefix are now cached here (fewer when the pool has no room; 0 with
        prefix caching off). ValueError, with nothing changed, if the transfer's layout is not this engine's."""
        transfer.check(transfer_layout(self.runner.kv_layout))
        if self._inflight is not None:      # it may still write KV into blocks its predecessor's update freed
            wait([self._inflight.future])   # (its result is committed by the next step, as always)
        self._apply_late_seals()            # (a block waiting for its seal may be the one install hands out)
        slots = self.block_manager.install(chain_keys(transfer.token_ids, self.cfg.block_size))
        fresh = [(block, transfer.blocks[i]) for i, block in enumerate(slots) if block >= 0]
        try:
            self.runner.write_kv_blocks([b for b, _ in fresh], [data for _, data in fresh])
        except BaseException:
            self.block_manager.discard([b for b, _ in fresh])     # keyed, but their KV never arrived
            raise
        return len(slots) * self.cfg.block_size

    # -- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._stepping_thread != threading.get_ident():
            self._check_thread()
        if self._worker is None:
            return self._step_sync()
        if self._overlap_safe():
            return self._step_overlapped()
        # a synchronous step runs on the worker's thread as well: one thread runs the model (architecture.md,
        # "Rules of the house"; the step in flight, submitted before, has finished when this one starts)
        return self._worker.submit(self._step_sync).result()

    def _check_thread(self) -> None:
        """Say once when the engine is stepped from another thread than before: on a CPU each thread that runs
        PyTorch work keeps an OpenMP pool of its own, and two pools made every step ~2.6x slower
        (leapdecode/native.py, release_openmp_threads)."""
        if (self._stepping_thread is not None and not self._warned_threads and self.device.type == "cpu"
                and torch.get_num_threads() > 1):
            self._warned_threads = True
            log.warning("the engine is stepped from another thread than before: on a CPU each thread that runs the "
                        "model keeps OpenMP workers of its own, and two pools make every step several times "
                        "slower; step it from one thread (leapdecode.native.release_openmp_threads frees a "
                        "thread's workers)")
        self._stepping_thread = threading.get_ident()

    def _step_sync(self) -> list[RequestOutput]:
        outputs = self._drain()
        # the step's time, as the speculation controller sees it, starts before drafting and scheduling: what a
        # draft costs the host beyond the drafter's own time (the speculator charges that apart) is part of it
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self._propose())
        outputs += self._outputs_of_ended()
        if not plan:
            return outputs
        masks = self.structured.start_fill(plan)
        batch = self.verifier.batch(plan, self.seqs)
        contrastive = self.contrastive.capture(plan)
        dola = self.dola.capture(plan, self.seqs)       # hidden states DoLa rows contrast with; () without any
        all_rows = bool(self._capture or contrastive)
        fwd = self.runner.execute(plan, capture=tuple(dict.fromkeys(self._capture + contrastive + dola)),
                                  all_rows=all_rows)
        premature = self.dola.premature(plan, self.seqs, fwd, all_rows) if dola else None
        draft_probs = self.speculator.take_probs() if self.speculator is not None else None
        result, _ = self.verifier.verify(plan, fwd.logits, batch, masks, self.seqs, draft_probs, premature,
                                         want_topk=self.speculator is not None and self.speculator.learns_topk())
        result = self.contrastive.choose(plan, result, fwd.logits, fwd.hidden_states, self.seqs)
        if self.beams:
            result = self._decide_beams(plan, result)
        if self._capture:                       # a drafter that reads the target's hidden states (EAGLE)
            try:
                self.speculator.drafter.observe_hidden(plan, result, fwd.hidden_states)
            except Exception:                   # noqa: BLE001 - it only costs the drafter its features
                log.exception("drafter failed to take the step's hidden states")
        return outputs + self._commit(plan, result, t0)

    def _decide_beams(self, plan: StepPlan, result: StepResult) -> StepResult:
        """Beam search requests choose their beams (forks and prunes happen here, before the update)."""
        out = self.beams.decide(plan, result, self.seqs)
        for seq in out.forks:
            self.seqs[seq.seq_id] = seq
            self.requests[seq.request_id].seqs.append(seq)
        for seq in out.pruned:
            self._finished(seq)
        for request_id in out.done:
            self._ended_outside_a_step.append(request_id)
        for req in {s.request_id: self.requests[s.request_id] for s in out.forks + out.pruned}.values():
            req.seqs = [s for s in req.seqs if not s.is_finished] or req.seqs[-1:]   # keep one to report from
        return out.result

    def _propose(self) -> dict:
        """Draft proposals for this step: contrastive search's candidates for its sequences, the drafter's for the
        others, then the grammar's (forced tokens, or cut drafts)."""
        prefilling = [s for s in self.scheduler.running if s.is_prefill] if self.speculator is not None else []
        if self.speculator is not None:         # index long prompts chunk by chunk, not in their first draft
            self.speculator.prepare([s for s in prefilling if s.num_computed_tokens
                                     and self.requests[s.request_id].draftable], len(self.scheduler.running))
        decoding = [s for s in self.scheduler.decoding() if self.requests[s.request_id].draftable]
        if not decoding:
            return {}
        drafts = self.contrastive.drafts(decoding)
        if self.speculator is not None:
            others = [s for s in decoding if s.seq_id not in self.contrastive]
            prefill, batch = self._prefill_work(len(decoding), prefilling)
            try:
                if others and not self.speculator.drafter_off(len(others), prefill):
                    drafts.update(self.speculator.propose(others, [self.scheduler.draft_room(s) for s in others],
                                                          prefill, batch))
            except Exception:                   # noqa: BLE001 - a drafter fault costs this step its drafts, no more
                log.exception("drafter failed; this step runs without drafts")
        for seq in decoding:
            if seq in self.structured:
                try:
                    drafts[seq.seq_id] = self.structured.draft(seq, drafts.get(seq.seq_id, EMPTY),
                                                               self.scheduler.draft_room(seq))
                except Exception as e:          # noqa: BLE001 - the grammar failed for this request alone
                    self.scheduler.finish(seq, "error", f"{type(e).__name__}: {e}")
                    self._finished(seq)
                    self._ended_outside_a_step.append(seq.request_id)
                    drafts.pop(seq.seq_id, None)
        return drafts

    def _prefill_work(self, num_decoding: int, prefilling: list[Sequence]) -> tuple[int, int]:
        """(prompt tokens this step will compute beside the decodes, sequences that will then decode together),
        for the speculation controller: the scheduler serves decodes and their drafts first, then running prompts,
        then waiting ones (Scheduler.schedule), so waiting prompts it can admit count too. (Counting only the
        running ones, a step that waiting prompts fill to the budget looked like a few decodes beside a short
        chunk.)"""
        sch = self.scheduler
        pending = sum(s.num_tokens - s.num_computed_tokens for s in prefilling)
        admit = sch.max_num_seqs - len(sch.running)
        for seq in sch.waiting:
            if admit <= 0 or seq.num_placeholders:
                break
            pending += seq.num_tokens - seq.num_computed_tokens
            admit -= 1
        return min(pending, max(sch.max_num_batched_tokens - num_decoding, 0)), sch.max_num_seqs - admit

    def _outputs_of_ended(self) -> list[RequestOutput]:
        outputs = []
        for request_id in dict.fromkeys(self._ended_outside_a_step):
            req = self.requests.get(request_id)
            if req is not None:
                outputs.append(self._output(req))
                if req.finished:
                    self.requests.pop(request_id)
        self._ended_outside_a_step = []
        return outputs

    def _overlap_safe(self) -> bool:
        """No request needs host-side tokens before the next step, and no drafter will be asked (none, or the
        guard has it off: spec/guard.py) nor reads hidden states (EAGLE's features come from every step)."""
        return ((self.speculator is None
                 or (self.speculator.off(len(self.scheduler.running)) and not self._capture))
                and all(r.overlap_safe for r in self.requests.values()))

    def _step_overlapped(self) -> list[RequestOutput]:
        """Launch step N+1 on the worker, then commit step N while N+1 runs."""
        entered = time.perf_counter()
        prev = self._inflight
        plan = self.scheduler.schedule()
        self._inflight = None
        if plan:
            if self.speculator is not None:
                self.speculator.overlapped_step(_decode_seqs(plan))
            batch = self.runner.prepare(plan)
            sampling = self.verifier.batch(plan, self.seqs)
            fut = self._worker.submit(self._device_step, plan, batch, sampling, prev.future if prev else None)
            self._inflight = _InFlight(plan, fut, time.perf_counter())
            self.stats["overlapped_steps"] += 1
        if prev is None:
            return []
        result, _ = prev.future.result()
        # in the steady state this call launched one step and committed one: its time is a step's, at the rate
        # plain decoding really runs (the caller's time between calls left out)
        return self._commit(prev.plan, result, entered, overlapped=True)

    def _device_step(self, plan: StepPlan, batch, sampling, prev: Future | None):
        """Worker thread: forward (reading the previous step's samples for placeholders) and sampling."""
        last = prev.result()[1] if prev is not None else None
        logits = self.runner.execute(plan, batch, last_sampled=last).logits
        return self.verifier.verify(plan, logits, sampling, None, self.seqs, want_topk=False)   # (drafter off)

    def _drain(self) -> list[RequestOutput]:
        """Commit the step in flight, if any (before a synchronous step)."""
        if self._inflight is None:
            return []
        prev, self._inflight = self._inflight, None
        result, _ = prev.future.result()
        return self._commit(prev.plan, result, prev.started, overlapped=True)   # (launch to commit: about a step)

    def _commit(self, plan: StepPlan, result: StepResult, started: float, overlapped: bool = False
                ) -> list[RequestOutput]:
        """Hand the result to the scheduler, then do the per-request bookkeeping it does not own. ``started``: when
        the step's time began (see :meth:`step` and :meth:`_step_overlapped`)."""
        now = time.time()
        generated = self.stats["generation_tokens"]
        drafted = {c.seq_id: len(c.draft) for c in plan.seqs if c.draft and c.seq_id not in self.contrastive}
        if self._unscheduled:
            for c in plan.seqs:
                seq = self.seqs.get(c.seq_id)
                req = self.requests.get(seq.request_id) if seq is not None else None
                if req is not None and req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
                    self._unscheduled.discard(req.request_id)
        upd = self.scheduler.update(plan, result, self.seqs)
        touched: dict[str, Request] = {}
        for seq in upd.touched:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            touched[req.request_id] = req
            r = result.seqs.get(seq.seq_id)
            if r is None:
                continue
            k, accepted = drafted.get(seq.seq_id, 0), len(r.accepted)
            m = req.metrics
            m.num_draft_tokens += k
            m.num_accepted_tokens += accepted
            m.num_steps += 1
            if m.first_token_time is None:
                m.first_token_time = now
            self.stats["draft_tokens"] += k
            self.stats["accepted_tokens"] += accepted
            self.stats["generation_tokens"] += len(r.tokens)
            if self.speculator is not None and req.draftable:
                self.speculator.observe(seq, k, accepted, r.topk)
        for seq in upd.finished:
            self._finished(seq)
        self.stats["steps"] += 1
        if self.speculator is not None and overlapped:     # (the runner's last step is the next one by now)
            self.speculator.observe_overlapped(_decode_seqs(plan), time.perf_counter() - started,
                                               self.stats["generation_tokens"] - generated)
        elif self.speculator is not None:
            self.speculator.observe_step(plan.num_tokens, time.perf_counter() - started,
                                         getattr(self.runner, "last_graph", None),
                                         self.stats["generation_tokens"] - generated, _decode_seqs(plan))
        outputs = [self._output(req) for req in touched.values()
                   if req.finished or (req.beam is None and req.stream)]
        if self._ended_outside_a_step:          # beam searches that ended in this step
            self._ended_outside_a_step = [r for r in self._ended_outside_a_step if r not in touched]
            outputs += self._outputs_of_ended()
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    # -- what finishing means outside the scheduler --------------------------------------------------------------
    def _finished(self, seq: Sequence) -> None:
        self.seqs.pop(seq.seq_id, None)
        req = self.requests.get(seq.request_id)
        if req is not None and not isinstance(seq.stop_reason, str) and seq.seq_id in req.detoks:
            req.detoks[seq.seq_id].flush()
        self.structured.detach(seq)
        self.contrastive.finish(seq.seq_id)
        if req is not None and req.finished:
            req.metrics.finished_time = time.time()
        if self.speculator is not None:
            self.speculator.finish(seq)

    def _output(self, req: Request) -> RequestOutput:
        if req.beam is not None:
            return self._beam_output(req)
        outs = []
        for seq in req.seqs:
            detok = req.detoks[seq.seq_id]
            outs.append(CompletionOutput(
                index=seq.index, text=detok.visible_text(seq.is_finished), token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None))
        finished = req.finished
        if finished and req.metrics.finished_time is None:
            req.metrics.finished_time = time.time()
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
                             req.seqs[0].prompt_logprobs, req.metrics)

    def _beam_output(self, req: Request) -> RequestOutput:
        """A beam search's hypotheses, best first, as completions (an error, if a beam failed, as the only one)."""
        outs = []
        for i, h in enumerate(req.beam.results(req.prompt_token_ids)):
            text = self.tokenizer.decode(h.output_token_ids, skip_special_tokens=req.beam.params.skip_special_tokens)
            outs.append(CompletionOutput(i, text, h.output_token_ids, h.finish_reason, h.stop_reason,
                                         cumulative_logprob=h.cum_logprob))
        failed = [s for s in req.seqs if s.finish_reason == "error"]
        if not outs and req.finished:
            reason = failed[0].stop_reason if failed else "the search ended without a hypothesis"
            outs.append(CompletionOutput(0, "", [], "error", reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished, None, req.metrics)

    # -- start-up ----------------------------------------------------------------------------------------------
    def _probe_step_time(self):
        """Time forwards of a few sizes on scratch blocks before any request exists, to seed the
        speculation controller's step-time model."""
        from leapdecode.spec.controller import StepTimeModel
        model = StepTimeModel()
        bs = self.cfg.block_size
        n_big = min(64, self.cfg.max_num_batched_tokens, self.max_model_len - 1)   # small sizes: the jump at n=2
        blocks = tuple(range(-(-n_big // bs)))          # the pool is empty: any blocks are scratch
        sizes = sorted({n for n in (1, 2, 4, 8, 16, n_big) if n <= n_big})
        # an untimed pass first: the first forward of each size pays one-off costs (allocations, oneDNN kernels
        # made per shape); timed, the first step's 0.5 s made every size look as costly as 64 tokens, so extra
        # tokens looked free and the controller speculated where it lost. Each forward is shaped as a verification
        # (a token and a chain of n - 1 draft tokens, logits for every row), the steps the curve prices: a prefill
        # chunk's rows skip the LM head (on the CPU, 64 rows cost 58 ms as a chunk, 67 ms verified)
        for timed in (False, True, True):
            for n in sizes:
                draft = DraftTree.of((0,) * (n - 1)) if n > 1 else EMPTY
                plan = lay_out(-1, bs, [ScheduledSeq(-1, 0, (0,) * n, blocks, draft, samples=True)])
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                self.runner.execute(plan).logits.cpu()
                if timed and getattr(self.runner, "last_graph", None) is None:   # graph steps: timed below
                    model.observe(n, time.perf_counter() - t0)
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None:          # every CUDA graph bucket's replay: what its steps cost before the host's share
            for bucket, seconds in graphs.replay_seconds().items():
                model.graphs.set_prior(bucket, seconds)
        return model


def _grammar_hook(structured: StructuredOutput):
    """The stop checker's grammar hook: the grammar's verdict on a sequence's new token."""
    def verdict(seq: Sequence, token: int) -> str | None:
        return structured.accept(seq, token) if seq in structured else None
    return verdict


def _stop_string_hook(requests: dict):
    """The stop checker's text hook: the token through its request's detokenizer (a stop string, or None)."""
    def stop_string(seq: Sequence, token: int) -> str | None:
        req = requests.get(seq.request_id)
        detok = req.detoks.get(seq.seq_id) if req is not None else None
        return detok.add(token) if detok is not None else None
    return stop_string


def _freeze_startup_objects() -> None:
    """Move everything alive after start-up (modules, weights' wrappers, tokenizer) out of the garbage collector's
    reach, so a full collection inside a decode step scans only what requests allocate; unfrozen again at exit so
    extension modules are torn down normally."""
    gc.collect()
    gc.freeze()
    if not getattr(_freeze_startup_objects, "registered", False):
        atexit.register(gc.unfreeze)
        _freeze_startup_objects.registered = True
