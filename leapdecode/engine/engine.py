"""The engine: requests in, one step at a time, incremental outputs out.

    step():  drafts -> schedule -> one forward -> sample / verify -> commit tokens, stop checks, free finished

Everything is synchronous and single-threaded; the server drives ``step()`` from its own loop thread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from leapdecode.config import EngineConfig, parse_dtype
from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.constraints import Constraints
from leapdecode.engine.detokenizer import Detokenizer
from leapdecode.engine.model_runner import ModelRunner
from leapdecode.engine.scheduler import ScheduledSeq, Scheduler
from leapdecode.engine.sequence import Sequence, SequenceStatus
from leapdecode.model.loader import load_generation_defaults, load_model_config, load_tokenizer
from leapdecode.outputs import CompletionOutput, RequestMetrics, RequestOutput
from leapdecode.sampling.rejection import node_paths, walk
from leapdecode.sampling.sampler import Row, SamplingBatch, compute_logprobs
from leapdecode.sampling_params import SamplingParams

MAX_LOGPROBS = 20
TOPK_FOR_DRAFTERS = 8   # Token Recycling learns the target's top-k successors at every verified position


@dataclass
class Verified:
    """One sequence's result of a step: tokens to append (accepted drafts + the bonus token)."""
    tokens: list[int]
    num_drafted: int
    num_accepted: int
    logprobs: list
    topk: list[list[int]] | None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    detoks: dict[int, Detokenizer] = field(default_factory=dict)
    unforked: list[Sequence] = field(default_factory=list)   # n > 1: siblings waiting for the shared prompt

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.device = cfg.torch_device
        self.model_cfg = load_model_config(cfg.model)
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        self.generation_defaults = load_generation_defaults(cfg.model)
        self.max_model_len = cfg.max_model_len or min(self.model_cfg.max_position_embeddings, 8192)
        self.dtype = parse_dtype(cfg.dtype, self.model_cfg.dtype, self.device)
        self.runner = ModelRunner(cfg, self.model_cfg, self.dtype, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed)
        self.vocab_size = self.model_cfg.vocab_size
        eos = set(self.model_cfg.eos_token_id) | set(self.generation_defaults.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.requests: dict[str, Request] = {}
        self.constraints = Constraints(self.tokenizer, self.eos_token_ids)
        self.speculator = None
        if cfg.speculative_config is not None:
            from leapdecode.spec.speculator import Speculator
            self.speculator = Speculator(cfg.speculative_config, self)
        self.stats = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "draft_tokens": 0, "accepted_tokens": 0}

    @property
    def structured_backend(self):
        """The grammar backend for structured output (built on first use)."""
        return self.constraints.backend

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
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return None, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validate and enqueue; every problem is a ValueError raised here, before anything is scheduled."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens long; max_model_len is {self.max_model_len} "
                             "(the prompt must leave room for at least one generated token)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > MAX_LOGPROBS:
                raise ValueError(f"SamplingParams.{name} must be <= {MAX_LOGPROBS}, got {v}")
        compiled = None
        if params.structured is not None:
            if params.ignore_eos:
                raise ValueError("SamplingParams.ignore_eos cannot be combined with structured output "
                                 "(the grammar ends the output with eos)")
            compiled = self.constraints.compile(params.structured)
        seqs = [Sequence(request_id, i, ids, params, self._generator(params.seed, i)) for i in range(params.n)]
        if compiled is not None:
            for seq in seqs:
                self.constraints.attach(seq, compiled)
        req = Request(request_id, text, ids, params, seqs, RequestMetrics(arrival_time or time.time()))
        for seq in seqs:
            req.detoks[seq.seq_id] = Detokenizer(self.tokenizer, ids, params.stop_strings,
                                                 params.skip_special_tokens, params.include_stop_str_in_output)
        req.unforked = seqs[1:]
        self.requests[request_id] = req
        self.stats["prompt_tokens"] += len(ids)
        self.scheduler.add(seqs[0])

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(self.device).manual_seed(seed if index == 0 else hash((seed, index)) & (2**62 - 1))

    def draft_room(self, seq: Sequence) -> int:
        """Most draft tokens this sequence may verify now: its remaining output budget less the bonus token,
        and no position past max_model_len."""
        remaining = (seq.params.max_tokens or self.max_model_len) - seq.num_output_tokens - 1
        return max(0, min(remaining, self.max_model_len - seq.num_tokens))

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or already done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        for seq in self.scheduler.running:
            if seq in self.constraints and not seq.is_prefill:
                self.constraints.prepare_drafts(seq, self.draft_room(seq))
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.time()
        t0 = time.perf_counter()
        plp = {s.seq.seq_id for s in batch.scheduled
               if s.seq.params.prompt_logprobs is not None and s.start < s.seq.num_prompt_tokens}
        inputs = self.runner.prepare(batch, plp)
        sampling = [(s, r) for s, r in zip(batch.scheduled, inputs.row_ranges) if s.samples]
        first_rows, num_rows = [], 0
        for s, _ in sampling:
            first_rows.append(num_rows)
            num_rows += 1 + len(s.seq.draft_tokens)
        masks = self.constraints.start_fill(
            [(s.seq, r0) for (s, _), r0 in zip(sampling, first_rows) if s.seq in self.constraints], num_rows)
        logits = self.runner.execute(inputs)
        touched: dict[str, Request] = {}
        accepted = self._sample(sampling, first_rows, logits, masks) if sampling else {}
        for s, (lo, hi) in zip(batch.scheduled, inputs.row_ranges):
            seq = s.seq
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if seq.seq_id in plp:
                self._record_prompt_logprobs(seq, s, logits[lo:hi])
            if seq.seq_id in accepted:
                self._commit(req, seq, accepted[seq.seq_id])
            else:
                seq.num_computed_tokens += s.num_new_tokens
                self.block_manager.commit(seq)
        self.stats["steps"] += 1
        if self.speculator is not None:
            self.speculator.observe_step(batch.num_tokens, time.perf_counter() - t0)
        outputs = [self._output(req) for req in touched.values()]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    def _sample(self, sampling: list[tuple[ScheduledSeq, tuple[int, int]]], first_row: list[int],
                logits: torch.Tensor, masks) -> dict[int, "Verified"]:
        """Sample every verified position, then walk each draft (sample-then-match, see sampling/rejection.py).
        A sequence without a draft has one row and this is plain decoding."""
        rows: list[Row] = []
        row_idx: list[int] = []
        for s, (lo, hi) in sampling:
            seq = s.seq
            d = len(seq.draft_tokens)
            rows += [Row(seq, [])] + [Row(seq, path) for path in node_paths(seq.draft_tokens, seq.draft_parents)]
            row_idx += range(hi - 1 - d, hi)
        whole = len(row_idx) == logits.shape[0] and row_idx[-1] == len(row_idx) - 1   # rows are exactly 0..R-1
        raw = logits if whole else logits[torch.tensor(row_idx, device=logits.device)]
        batch = SamplingBatch(rows, self.vocab_size, self.device, self.eos_token_ids)
        probs = batch.process(self.constraints.apply(raw, masks))
        if not batch.all_greedy:
            probs = self.constraints.align(rows, probs, lambda: batch.process(raw), masks)
        sampled_t = batch.sample(probs, self.generator)
        sampled = sampled_t.tolist()
        lps = self.logprobs_for(batch, raw, sampled_t)
        topk = (raw.topk(TOPK_FOR_DRAFTERS, dim=-1).indices.tolist()
                if self.speculator is not None and self.speculator.wants_topk else None)
        result: dict[int, Verified] = {}
        for (s, _), r0 in zip(sampling, first_row):
            seq = s.seq
            d = len(seq.draft_tokens)
            path, bonus = walk(sampled[r0:r0 + d + 1], seq.draft_tokens, seq.draft_parents)
            used = [r0] + [r0 + 1 + i for i in path]
            if path != list(range(len(path))):          # tree: move the accepted branch's KV into place
                self.runner.move_kv(seq.block_table, [seq.num_tokens + i for i in path],
                                    [seq.num_tokens + j for j in range(len(path))])
            result[seq.seq_id] = Verified(
                tokens=[seq.draft_tokens[i] for i in path] + [bonus], num_drafted=d, num_accepted=len(path),
                logprobs=[lps[r] for r in used] if lps else [None] * len(used),
                topk=[topk[r] for r in used] if topk else None)
        return result

    def logprobs_for(self, batch: SamplingBatch, raw: torch.Tensor, tokens: torch.Tensor) -> list | None:
        if batch.max_logprobs is None:
            return None
        chosen, top = compute_logprobs(raw, tokens, batch.max_logprobs)
        return list(zip(chosen, top))

    def _record_prompt_logprobs(self, seq: Sequence, s: ScheduledSeq, rows: torch.Tensor) -> None:
        """Row j predicts the token at position start + j + 1; keep those that are prompt tokens."""
        n = min(s.num_new_tokens, seq.num_prompt_tokens - 1 - s.start)
        if n <= 0:
            return
        targets = torch.tensor(seq.token_ids[s.start + 1:s.start + 1 + n], device=rows.device)
        chosen, top = compute_logprobs(rows[:n], targets, seq.params.prompt_logprobs)
        for t, c, tp in zip(targets.tolist(), chosen, top):
            entry = dict(tp)
            entry[t] = c
            seq.prompt_logprobs.append(entry)

    def _commit(self, req: Request, seq: Sequence, v: Verified) -> None:
        """Append verified tokens one by one, stopping at the first that ends the sequence."""
        seq.num_computed_tokens = seq.num_tokens + v.num_accepted   # KV of the bonus token is not written yet
        seq.set_draft([])
        req.metrics.num_draft_tokens += v.num_drafted
        req.metrics.num_accepted_tokens += v.num_accepted
        self.stats["draft_tokens"] += v.num_drafted
        self.stats["accepted_tokens"] += v.num_accepted
        if req.unforked:
            self._fork(req, seq)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.time()
        req.metrics.num_steps += 1
        detok = req.detoks[seq.seq_id]
        p = seq.params
        for token, lp in zip(v.tokens, v.logprobs):
            seq.token_ids.append(token)
            self.stats["generation_tokens"] += 1
            if lp is not None and seq.logprobs is not None:
                chosen, top = lp
                entry = dict(top[:p.logprobs])
                entry[token] = chosen
                seq.logprobs.append(entry)
                seq.cumulative_logprob += chosen
            grammar_end = self.constraints.accept(seq, token) if seq in self.constraints else None
            if grammar_end == "abort":
                seq.finish_reason, seq.stop_reason = "abort", "no valid continuation under the structured-output grammar"
            elif token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif token in self.eos_token_ids and not p.ignore_eos or grammar_end == "stop":
                seq.finish_reason = "stop"
            else:
                stop = detok.add(token)
                if stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                elif seq.num_output_tokens >= (p.max_tokens or self.max_model_len) \
                        or seq.num_tokens >= self.max_model_len:
                    seq.finish_reason = "length"
            if seq.finish_reason is not None:
                break
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
        self.block_manager.commit(seq)
        if self.speculator is not None and seq.finish_reason is None:
            self.speculator.observe(seq, v.num_drafted, v.num_accepted, v.topk)
        if seq.finish_reason is not None:
            if not isinstance(seq.stop_reason, str):
                detok.flush()
            self._finish(seq)

    def _fork(self, req: Request, parent: Sequence) -> None:
        """n > 1: siblings adopt the parent's full prompt blocks and compute only the prompt's tail."""
        shared = (parent.num_prompt_tokens - 1) // self.cfg.block_size
        for child in req.unforked:
            self.block_manager.share_prefix(parent, child, shared)
            self.scheduler.waiting.appendleft(child)
        req.unforked = []

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.constraints.detach(seq)
        req = self.requests.get(seq.request_id)
        if req is not None and req.finished:
            req.metrics.finished_time = time.time()
        if self.speculator is not None:
            self.speculator.finish(seq)

    def _output(self, req: Request) -> RequestOutput:
        finished = req.finished
        outs = []
        for seq in req.seqs:
            detok = req.detoks[seq.seq_id]
            outs.append(CompletionOutput(
                index=seq.index, text=detok.visible_text(seq.is_finished), token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None))
        if finished and req.metrics.finished_time is None:
            req.metrics.finished_time = time.time()
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
                             req.seqs[0].prompt_logprobs, req.metrics)
