"""Draft-model speculation (SpS): a small model with the target's tokenizer proposes a chain with its distributions.

    speculative_config={"method": "draft_model", "model": DIR_or_GGUF, "num_speculative_tokens": k}

**The seam.** Model drafters are built by the registry with a handle to the target's runner
(``make_drafter(method, runner=...)``, from ``Speculator``): they read its device, dtype, block size, attention
backend choice and, for layer skipping, its model and KV cache. They still implement the plain ``Drafter``
protocol: ``propose`` gets one ``DraftRequest`` per decoding sequence (committed tokens, the request's sampling
parameters and sample index, a snapshot of the target's block table), ``finish`` frees a sequence's state. They
never touch engine state; the engine's scheduler reserves the target's KV room for the verified draft as for every
drafter.

**The draft model** is loaded with leapdecode's own loader and model code on the target's device and dtype, with
its own paged KV pool (its own ``KVCache``) and a simple per-sequence list of block ids (sequences keyed by
seq_id). Its KV holds the committed tokens it has seen plus the draft tokens it wrote last step; each ``propose``
first works out how much of that is still valid (the committed tokens are append-only, so it is the committed
length it last saw plus the drafted tokens that were accepted), then runs, **batched over every drafting
sequence**:

1. one *catch-up* forward feeding each sequence the committed tokens its KV lacks (the whole prompt the first time,
   then usually the bonus token, or the last accepted draft token and the bonus) -> q_1; a catch-up longer than
   ``CATCH_UP_TOKENS`` is fed in slices first, like the target's chunked prefill;
2. k - 1 single-token forwards, one per draft position for the whole batch -> q_2..q_k.

On a GPU where the target replays CUDA graphs, the draft model has its own (engine/cuda_graphs.py, captured when
the drafter is built): one-token forwards and catch-ups of at most k + 1 tokens (the steady state) replay a graph;
longer catch-ups (prompts) run eagerly. Eagerly, each forward of a small draft model is a few hundred launches and
its Triton kernels compile again as contexts cross the decode kernel's split sizes (seen on an H200: 1.7 ms a
forward for a 2-layer model whose graph replays in a small fraction of that, and 0.5 s compiles in mid-run).

Rollback is implicit: positions past the valid length are simply overwritten later. A preempted target sequence
keeps its tokens, so its draft state stays valid; ``finish`` frees its blocks. When the draft pool is full, the
state of sequences not drafting now is dropped (they catch up again later), and a sequence that still does not fit
gets no draft.

**Distributions.** Each draft position's logits are processed exactly as the target's sampler processes the
request's (``SamplingBatch``: penalties over the history, temperature, top-k, top-p, min-p) and the token is drawn
from that q by the target's inverse-CDF sampler (a seeded request's uniform is keyed by (seed, sample index,
position) under the draft salt, so seeded requests are reproducible whenever they get the same draft lengths). The
draft carries q, and verification uses min(1, p/q) with the residual (sampling/rejection.py), exact for every
setting. Greedy requests draft the argmax and carry no q: verification is argmax-matching, bit-for-bit plain
decoding. The draft's score (the controller's prior on first-token acceptance) is q_1 of its first token.

The tokenizers of draft and target must be the same (same vocabulary, token for token): otherwise ``ValueError``.
A draft model with a smaller embedding table is padded with -inf logits to the target's vocabulary; rows past it
are dropped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from leapdecode.engine.input_batch import InputBuffers
from leapdecode.engine.step import ScheduledSeq, lay_out
from leapdecode.model import cpu_layer
from leapdecode.sampling.rejection import DRAFT_SALT
from leapdecode.sampling.sampler import (Row, SamplingBatch, argmax_rows, inverse_cdf_sample, keyed_uniforms,
                                         seeded_uniform)
from leapdecode.spec.calibration import ChainCalibration
from leapdecode.spec.drafter import Draft, DraftRequest, depth_pays


CATCH_UP_TOKENS = 2048   # most tokens one catch-up forward of the draft model computes


class _Ctx:
    """The committed state of one request as the sampler's ``Row`` reads it (a ``Sequence`` look-alike)."""
    __slots__ = ("token_ids", "num_prompt_tokens", "params", "index", "num_placeholders", "seq_id", "token_seconds",
                 "verify_seconds")

    def __init__(self, req: DraftRequest) -> None:
        self.token_ids, self.num_prompt_tokens = req.token_ids, req.num_prompt_tokens
        self.params, self.index, self.num_placeholders = req.params, req.sample_index, 0
        self.seq_id, self.token_seconds, self.verify_seconds = req.seq_id, req.token_seconds, req.verify_seconds

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return list(self.token_ids[self.num_prompt_tokens:])


class DraftSampler:
    """Processes draft logits like the target's sampler and draws the draft tokens (shared by model drafters)."""

    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.generator = torch.Generator(device).manual_seed(seed ^ 0x7F4A7C15)

    def draw(self, logits: torch.Tensor, ctxs: list[_Ctx], histories: list[list[int]]
             ) -> tuple[list[int], torch.Tensor | None, list[float], list[bool]]:
        """logits [B, V] (target vocabulary) -> (tokens, q [B, V] or None when all greedy, confidence (max of q,
        or of softmax(logits) for greedy rows), the prob of each drawn token, greedy per row)."""
        rows = [Row(c, h) for c, h in zip(ctxs, histories)]
        batch = SamplingBatch(rows, self.vocab_size, self.device, set())
        processed = batch.process(logits)
        greedy = [c.params is None or c.params.greedy for c in ctxs]
        if batch.all_greedy:
            tokens_t = argmax_rows(processed)
            conf = logits.softmax(-1).gather(1, tokens_t[:, None]).squeeze(1)
            return tokens_t.tolist(), None, conf.tolist(), greedy
        q = processed
        seeded = [(i, seeded_uniform(c.params.seed ^ DRAFT_SALT, c.index, len(c.token_ids) + len(h)))
                  for i, (c, h) in enumerate(zip(ctxs, histories))
                  if c.params is not None and c.params.seed is not None]
        u = keyed_uniforms(len(rows), seeded, self.generator, self.device)
        tokens_t = inverse_cdf_sample(q, u)
        # a greedy row's q is one-hot: its confidence comes from the raw distribution instead
        conf_src = torch.where(torch.tensor(greedy, device=self.device)[:, None], logits.softmax(-1), q)
        conf = conf_src.gather(1, tokens_t[:, None]).squeeze(1)
        return tokens_t.tolist(), q, conf.tolist(), greedy


class RowCost:
    """Seconds of one draft position for one row: a draft forward's time over its rows, per number of rows (a
    running mean over the forwards with as many rows), for the stopping rule of :func:`draft_chains`."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def per_row(self, rows: int) -> float | None:
        t = self._seconds.get(rows)
        return None if t is None else t / rows


def draft_chains(sampler: DraftSampler, logits: torch.Tensor, ctxs: list[_Ctx], limits: list[int],
                 threshold: float, step: Callable[[list[int], int, list[int]], torch.Tensor],
                 calibration: ChainCalibration | None = None, cost: RowCost | None = None) -> list[Draft]:
    """Draft one chain per row, autoregressively and batched: draw from ``logits`` (one row per context), keep
    going for the rows under their length limit whose drawn token had confidence >= ``threshold``, and ask
    ``step(active rows, depth, their last tokens)`` for those rows' next logits. Each draft carries its q rows
    when every token of it was sampled (not greedy) and its first token's confidence as its score.

    ``confidence``: with ``calibration`` (:class:`ChainCalibration`), each token valued by how often tokens drafted
    with such a probability were accepted, multiplied along the chain; without it, while every token is greedy,
    the running product of the tokens' own confidences (a sampled token is accepted with probability min(1, p/q),
    which its q does not say).

    **Stopping** (SpecDec++'s rule, priced on this machine): with ``calibration`` and ``cost``, a row whose request
    says what an accepted token saves (``DraftRequest.token_seconds``, from the controller) stops once its chain's
    calibrated path probability times that no longer covers verifying one more token (``verify_seconds``) plus a
    draft position's cost to a row (``cost``, timed here): ``drafter.depth_pays``. The next token is worth at most
    the path's probability, and its drafting time is spent whether or not the controller keeps it. An int8
    self-draft position costs ~0.6 of a target step at batch 1 on the CPU, so a fourth token that is 45% likely
    lost time."""
    B = len(ctxs)
    tokens: list[list[int]] = [[] for _ in range(B)]
    qs: list[list[torch.Tensor]] = [[] for _ in range(B)]
    paths: list[list[float] | None] = [[] for _ in range(B)]     # cumulative confidences while all greedy
    probs: list[list[float]] = [[] for _ in range(B)]            # each token's own confidence
    sampled: list[list[bool]] = [[] for _ in range(B)]
    path = [1.0] * B                                             # calibrated path probability
    score = [0.0] * B
    active = list(range(B))
    depth = 0
    t_step = None
    while active:
        toks, q, conf, greedy = sampler.draw(logits, [ctxs[b] for b in active], [tokens[b] for b in active])
        if t_step is not None and cost is not None:   # the forward and the draw (which waits for it on a GPU)
            cost.observe(len(active), time.perf_counter() - t_step)
        per_row = cost.per_row(len(active)) if cost is not None and calibration is not None else None
        depth += 1
        nxt = []
        for a, b in enumerate(active):
            tokens[b].append(toks[a])
            probs[b].append(conf[a])
            sampled[b].append(not greedy[a])
            if q is not None and not greedy[a]:
                qs[b].append(q[a])
            if depth == 1:
                score[b] = conf[a]
            if paths[b] is not None and greedy[a]:
                paths[b].append((paths[b][-1] if paths[b] else 1.0) * conf[a])
            elif paths[b] is not None:
                paths[b] = None
            if calibration is not None:
                path[b] *= calibration.estimate(conf[a], not greedy[a])
            worth = ctxs[b].token_seconds if per_row is not None else 0.0
            pays = not worth or depth_pays(path[b], worth, ctxs[b].verify_seconds, per_row)
            if depth < limits[b] and conf[a] >= threshold and pays:
                nxt.append(b)
        active = nxt
        if active:
            t_step = time.perf_counter()
            logits = step(active, depth, [tokens[b][-1] for b in active])
    if calibration is not None:
        paths = [calibration.confidences(ctxs[b].seq_id, ctxs[b].token_ids, tokens[b], probs[b], sampled[b])
                 for b in range(B)]
    return [Draft(tokens[b], None, score=score[b],
                  probs=torch.stack(qs[b]) if qs[b] and len(qs[b]) == len(tokens[b]) else None,
                  confidence=paths[b] or None) for b in range(B)]


def run_layers(model, input_ids: torch.Tensor, meta, layers: Sequence[int] | None = None,
               final_norm: bool = True) -> torch.Tensor:
    """The model over a flat batch, through ``layers`` (all when None) in order, then the final norm (unless
    ``final_norm`` is False: the residual stream after the last of ``layers``)."""
    if layers is None and final_norm:
        return model(input_ids, meta)
    x = model.embed_tokens(input_ids)
    order = range(len(model.layers)) if layers is None else layers
    # the CPU's small steps: the layers in one C++ call where each qualifies (model/cpu_layer.py); ``model.layers``,
    # not the forward's own list: an int8 copy of the target (layer_skip) holds its copies there
    stack = cpu_layer.stack_of(model, list(model.layers)) if meta.cpu_step is not None else None
    out = stack(x, meta, order) if stack is not None else None
    if out is not None:
        x = out
    else:
        for i in order:
            x = model.layers[i](x, meta)
    return model.norm(x) if final_norm else x


def check_same_tokenizer(target: str, draft: str) -> None:
    """ValueError unless the two checkpoints' tokenizers have the same vocabulary, token for token."""
    from leapdecode.model.loader import load_tokenizer
    a, b = load_tokenizer(target).get_vocab(), load_tokenizer(draft).get_vocab()
    if a != b:
        only_a = len(set(a.items()) - set(b.items()))
        raise ValueError(f"speculative_config.model {draft!r} does not share the target's tokenizer "
                         f"({len(a)} vs {len(b)} tokens, {only_a} of the target's differ): a draft model must use "
                         "the same vocabulary")


@dataclass
class _SeqState:
    blocks: list[int] = field(default_factory=list)
    seen: int = 0                       # committed tokens at the last propose (their KV is valid, but the last's)
    drafted: list[int] = field(default_factory=list)   # draft tokens whose KV was written after them
    last_used: int = 0


class DraftModelDrafter:
    """See the module docstring. ``model``: a Hugging Face directory or GGUF file with the target's tokenizer;
    ``threshold``: stop a draft early when the draft's probability of its own token falls below it (0: never);
    ``num_blocks``: the draft KV pool (default: the target's pool plus room for every sequence's draft)."""

    def __init__(self, runner: Any, model: str | None = None, num_speculative_tokens: int = 4,
                 threshold: float = 0.0, num_blocks: int | None = None, check_tokenizer: bool = True,
                 int8: bool | None = None, cuda_graphs: bool | None = None) -> None:
        """``cuda_graphs``: capture the draft's graphs (None: where the target has its own)."""
        from leapdecode.attention.backend import get_backend
        from leapdecode.model import int8_linear
        from leapdecode.attention.kv_cache import KVCache
        from leapdecode.model.loader import load_model, load_model_config
        from leapdecode.model.packed_linear import pack_model
        if not model or not isinstance(model, str):
            raise ValueError('speculative_config for "draft_model" needs "model": a model directory or GGUF file')
        cfg = runner.cfg
        if check_tokenizer:
            check_same_tokenizer(cfg.tokenizer or cfg.model, model)
        self.device, self.dtype = runner.device, runner.dtype
        self.block_size = runner.block_size
        self.vocab_size = runner.model_cfg.vocab_size
        self.k = max(1, int(num_speculative_tokens))
        self.threshold = float(threshold)
        self.calibration = ChainCalibration()     # what the drafts' confidences are worth (spec/calibration.py)
        self.row_cost = RowCost()                 # what a draft position costs a row (the stopping rule)
        self.model_cfg = load_model_config(model)
        self.max_len = runner.max_model_len + self.k + 1
        self.backend = get_backend(cfg.attention_backend, self.device)
        self.model = load_model(model, self.model_cfg, self.backend, self.dtype, self.device, self.max_len)
        # int8 weights for the draft's matmuls where they measure faster (the draft model is this drafter's own)
        self.lm_int8 = None
        if int8_linear.choose(int8, self.dtype, self.device, self.model.layers[0].mlp.gate_up_proj.weight,
                              "draft_model") is not None:
            int8_linear.quantize_linears(self.model, int8_linear.linear_names(self.model.layers),
                                         prefix="layers")
            self.lm_int8 = int8_linear.Int8Linear(self.model.output_head.weight)
        else:                            # float: packed like the target's where that pays (model/packed_linear.py)
            pack_model(self.model, cfg.cpu_packed_linears)
        c = self.model_cfg
        per_seq = -(-(self.k + 1) // self.block_size) + 1
        self.num_blocks = num_blocks or (runner.num_blocks + cfg.max_num_seqs * per_seq)
        self.kv_cache = KVCache(c.num_layers, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim,
                                self.dtype, self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = self.kv_cache.layer(i)
        self.buffers = InputBuffers(self.device, capacity=1 << 12)
        self.graphs = None
        if cuda_graphs or (cuda_graphs is None and getattr(runner, "graphs", None) is not None):
            self.graphs = self.cuda_graphs(min(cfg.max_graph_batch, cfg.max_num_seqs))
        self.sampler = DraftSampler(self.vocab_size, self.device, cfg.seed)
        self.free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self.states: dict[int, _SeqState] = {}
        self._calls = 0
        self.stats = {"forwards": 0, "catch_up_tokens": 0, "drafted": 0, "seconds": 0.0}

    def cuda_graphs(self, max_batch: int, capture_graphs: bool = True):
        """The draft model's CUDA graphs, captured now: one-token forwards and catch-ups of up to k + 1 tokens, for
        up to ``max_batch`` sequences. ``capture_graphs=False``: the same buffers run eagerly (CPU tests)."""
        from leapdecode.engine.cuda_graphs import CudaGraphs
        if not hasattr(self.backend, "plan_graph") or (capture_graphs and self.device.type != "cuda"):
            raise ValueError("draft_model: cuda_graphs need a CUDA device and the triton attention backend")
        graphs = CudaGraphs(self.model, self.backend, self.device, self.block_size, self.max_len,
                            self.model_cfg.sliding_window, max_batch, (1, self.k + 1), capture_graphs)
        graphs.capture()
        return graphs

    # -- KV bookkeeping ------------------------------------------------------------------------------------------
    def _reserve(self, st: _SeqState, num_positions: int, keep: set[int]) -> bool:
        need = -(-num_positions // self.block_size) - len(st.blocks)
        if need > len(self.free):
            for sid in sorted((s for s in self.states if s not in keep), key=lambda s: self.states[s].last_used):
                self._drop(sid)
                if need <= len(self.free):
                    break
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            st.blocks.append(self.free.pop())
        return True

    def _drop(self, seq_id: int) -> None:
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.free += st.blocks

    def _valid(self, st: _SeqState, tokens: Sequence[int]) -> int:
        """Positions of the draft KV that still hold the committed tokens."""
        n = st.seen
        for t in st.drafted:
            if n >= len(tokens) or tokens[n] != t:
                break
            n += 1
        return min(n, len(tokens) - 1)

    # -- the forward -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, chunks: list[tuple[int, Sequence[int], Sequence[int]]]) -> torch.Tensor:
        """chunks: (start position, tokens, block ids) per sequence -> the draft's logits after each chunk's last
        token, [len(chunks), target vocab] float32. One batched forward."""
        plan = lay_out(0, self.block_size, [ScheduledSeq(i, start, tuple(toks), tuple(blocks), samples=True)
                                            for i, (start, toks, blocks) in enumerate(chunks)])
        batch = self.buffers.build(plan, self.model_cfg.sliding_window)
        graph = self.graphs.bucket(plan, batch) if self.graphs is not None else None
        if graph is not None:            # a copy: the graph's output is overwritten by the next replay
            logits = self.graphs.replay(graph, batch).clone()
        else:
            self.backend.plan(batch.meta)
            hidden = self.model(batch.input_ids, batch.meta)[batch.logits_indices]
            logits = self.model.compute_logits(hidden) if self.lm_int8 is None else self.lm_int8(hidden)
        self.stats["forwards"] += 1
        return _fit_vocab(logits, self.vocab_size)

    def _catch_up(self, chunks: list[tuple[int, Sequence[int], Sequence[int]]]):
        """Feed long catch-ups (a new sequence's prompt) in slices of ``CATCH_UP_TOKENS`` per forward, as the
        target's chunked prefill does, so no forward holds more than that many tokens; returns the chunks' last
        slices (the ones whose logits are needed)."""
        while sum(len(t) for _, t, _ in chunks) > CATCH_UP_TOKENS and any(len(t) > 1 for _, t, _ in chunks):
            budget, head, rest = CATCH_UP_TOKENS, [], []
            for start, toks, blocks in chunks:
                n = min(len(toks) - 1, budget)            # keep each chunk's last token for the sampling forward
                if n > 0:
                    head.append((start, toks[:n], blocks))
                    budget -= n
                rest.append((start + max(n, 0), toks[max(n, 0):], blocks))
            if not head:
                break
            self.forward(head)
            chunks = rest
        return chunks

    # -- the protocol ------------------------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        t0 = time.perf_counter()
        self._calls += 1
        out = [Draft() for _ in requests]
        live = [i for i, r in enumerate(requests) if r.max_draft > 0 and len(r.token_ids) >= 1]
        keep = {requests[i].seq_id for i in live}
        chunks, ctxs, idx = [], [], []
        for i in live:
            r = requests[i]
            st = self.states.get(r.seq_id)
            if st is None:
                st = self.states[r.seq_id] = _SeqState()
            st.last_used = self._calls
            n = len(r.token_ids)
            valid = self._valid(st, r.token_ids)
            depth = min(r.max_draft, self.k)
            if n + depth > self.max_len or not self._reserve(st, n + depth - 1, keep):
                st.seen, st.drafted = valid, []
                continue
            st.seen, st.drafted = n, []
            chunks.append((valid, r.token_ids[valid:n], st.blocks))
            ctxs.append(_Ctx(r))
            idx.append(i)
            self.stats["catch_up_tokens"] += n - valid
        if chunks:
            self._draft(requests, chunks, ctxs, idx, out)
        self.stats["seconds"] += time.perf_counter() - t0
        return out

    def _draft(self, requests, chunks, ctxs, idx, out) -> None:
        chunks = self._catch_up(chunks)

        def step(active: list[int], depth: int, last: list[int]) -> torch.Tensor:
            nxt = []
            for b, token in zip(active, last):
                r = requests[idx[b]]
                st = self.states[r.seq_id]
                st.drafted.append(token)                            # its KV is written by this forward
                nxt.append((len(r.token_ids) + depth - 1, (token,), st.blocks))
            return self.forward(nxt)

        limits = [min(requests[i].max_draft, self.k) for i in idx]
        for b, draft in enumerate(draft_chains(self.sampler, self.forward(chunks), ctxs, limits, self.threshold,
                                               step, self.calibration, self.row_cost)):
            out[idx[b]] = draft
            self.stats["drafted"] += len(draft.tokens)

    def observe(self, seq_id: int, token_ids: Sequence[int], num_accepted: int, topk=None) -> None:
        """Judge the sequence's last draft (its KV catches up with the committed tokens in :meth:`propose`)."""
        self.calibration.observe(seq_id, token_ids)

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._drop(seq_id)
        self.calibration.finish(seq_id, token_ids)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits over the target's vocabulary: cut extra rows, pad missing ones with -inf."""
    V = logits.shape[-1]
    if V == vocab_size:
        return logits
    if V > vocab_size:
        return logits[:, :vocab_size]
    pad = logits.new_full((logits.shape[0], vocab_size - V), float("-inf"))
    return torch.cat([logits, pad], 1)
