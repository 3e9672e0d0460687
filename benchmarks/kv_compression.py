"""KV-cache compression on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32), CPU:
what each quantized-KV format and sparse-decoding budget saves in memory, gains in decode speed, and costs in
quality (issue 16, "Benchmark").

    python benchmarks/kv_compression.py --quick                     # every configuration, small sizes
    python benchmarks/kv_compression.py                             # full sizes (see the README for run times)
    python benchmarks/kv_compression.py --configs auto,int4,sparse-10 --sections memory,ppl

Configurations are the list ``CONFIGS`` below: each is a set of ``LLM(...)`` keyword arguments. One the installed
engine does not accept (an unknown keyword, or a value it refuses) is skipped with a printed note, so the script
runs today ("auto" only) and runs every configuration once the features are merged. "auto" (the engine's
full-precision cache: float32 on CPU) always runs first: it is the reference of every relative column.

Every configuration gets one ``LLM`` with prefix caching off (every request computes its own KV, through the
cache under test) and ``max_num_batched_tokens = --chunk`` (256): a long prompt is prefilled in chunks, and each
chunk's queries attend to the keys and values of the chunks before it as they were stored in the paged cache (a
quantized cache stores them quantized), so everything after the first chunk is computed from the compressed cache.
The script checks this on every configuration by recording each prefill step's attention metadata (chunk i has
``seq_len - query_len = i * chunk`` keys that it did not compute itself: they can only come from the cache), and on
"auto" that chunked and one-shot prompt logprobs agree.

Sections (``--sections``):

memory   bytes of KV per token and the number of blocks in a ``--kv-memory`` pool, from ``llm.kv_cache_info()``
         (for an engine without it: the runner's block size and bytes per block); max concurrent sequences of
         ``--seq-len`` tokens = blocks // blocks per sequence. Compression is relative to "auto" and to a bfloat16
         cache of the same model (2 * layers * kv_heads * head_dim * 2 bytes per token), the issue's yardstick.
speed    batch 1: a prompt of each ``--decode-contexts`` length (Python documentation), then ``--decode-tokens``
         greedy tokens (EOS ignored): decode tokens/s after the first token (wall clock, and per CPU second of
         this process, which a shared machine disturbs less), and the time spent in the attention backend per
         decoded token (its ``plan`` + ``write_kv`` + ``attend`` over all layers, decode steps only: the part
         that KV compression and sparse attention change), timed in a second run of the same decode with every
         step layer by layer (the CPU's one-call decoder layer attends inside C++, out of the probe's sight).
ppl      perplexity of ``--ppl-tokens`` tokens of held-back text (the Python language reference shipped with
         Python as ``pydoc_data.topics``, topics in sorted order) from the engine's prompt logprobs, prefilled in
         chunks as above, and its increase over "auto". Sparse decoding acts on decode steps, so for a sparse
         configuration this column shows what it does to prompt chunks (probably nothing); its quality evidence
         is the greedy and needle columns.
greedy   ``--greedy-prompts`` chat prompts of ``--greedy-context`` tokens (other Python documentation + "Summarize
         the documentation above."), ``--greedy-tokens`` greedy tokens each (EOS ignored, so every row has the
         same length), compared with "auto"'s tokens: the identical prefix (tokens before the first divergence,
         as a fraction) and the fraction of positions with the same token, averaged over prompts.
needle   needle-in-a-haystack retrieval ("Needle in a Haystack", Kamradt 2023; pass-key retrieval, Mohtashami &
         Jaggi 2023, is the same idea with a number hidden in repeated filler): the haystack is licence text
         shipped with Debian (/usr/share/common-licenses: GPL-3, then GPL-2, Apache-2.0, ...), cut to the
         length; a sentence "The secret code of the <colour> door is <4 digits>." is inserted at a line break
         near each of ``--needle-depths`` evenly spaced depths (0% .. 100%), ``--needle-trials`` times with
         different colours and codes (seeded); the question comes after it through the chat template. Accuracy =
         the greedy answer (24 tokens) contains the code. Lengths (``--needle-lengths``) are whole prompt lengths,
         capped at the model's context minus the answer. Measured while designing this benchmark, with the
         full-precision cache: the 135M model answers 5/5 depths at 300, 2k and 4k tokens and 4/5 at 8k (it
         misses the needle at depth 0%); pass-key retrieval with the literature's repeated filler did no better
         at 8k (2/4), so the plain needle task is used at every length. The needle must sit on its own line: cut
         into the middle of a licence sentence, 8k fell to 1/5. For a compressed configuration the cell also
         counts answers naming the same code as "auto"'s, which isolates the compression's effect.

Timings on a shared CPU are noisy: the machine, torch threads and load average (before and after) are printed
with the table; use ``--threads 1`` when other jobs share the machine.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from real_model import REPO, chat_ids, user  # noqa: E402

import torch  # noqa: E402


@dataclass
class Config:
    """One row of the table: ``kwargs`` go to ``LLM(...)``. ``alternatives``: other spellings of the same option,
    tried in order when the first is refused (the feature branches' APIs were not final when this was written)."""
    name: str
    fmt: str                       # the table's "format" column
    budget: str                    # the table's "budget" column (sparse attention), "-" for full attention
    kwargs: dict = field(default_factory=dict)
    alternatives: tuple[dict, ...] = ()


# The configurations, in table order. Edit the keyword arguments here when an API settles.
CONFIGS = [
    Config("auto", "auto", "-", {}),
    Config("fp8", "fp8", "-", {"kv_cache_dtype": "fp8"}),
    Config("fp8-recent64", "fp8, 64 recent", "-", {"kv_cache_dtype": "fp8", "kv_cache_recent_tokens": 64}),
    Config("fp8-recent256", "fp8, 256 recent", "-", {"kv_cache_dtype": "fp8", "kv_cache_recent_tokens": 256}),
    Config("fp8-recent512", "fp8, 512 recent", "-", {"kv_cache_dtype": "fp8", "kv_cache_recent_tokens": 512}),
    Config("int8", "int8", "-", {"kv_cache_dtype": "int8"}),
    Config("int4", "int4", "-", {"kv_cache_dtype": "int4", "kv_cache_salient_ratio": 0.0}),
    Config("int4-saliency", "int4 + saliency", "-", {"kv_cache_dtype": "int4", "kv_cache_salient_ratio": 0.125}),
    Config("int4-recent256", "int4, 256 recent", "-", {"kv_cache_dtype": "int4", "kv_cache_salient_ratio": 0.0,
                                                      "kv_cache_recent_tokens": 256}),
    Config("int4-saliency-recent256", "int4 + saliency, 256 recent", "-",
           {"kv_cache_dtype": "int4", "kv_cache_salient_ratio": 0.125, "kv_cache_recent_tokens": 256}),
    # 64-token blocks: the keys' per-channel grids cost a quarter as much per token (3.5x bf16 with one salient
    # token per block), the 256 recent tokens at full precision pay for the coarser grids
    Config("int4-b64", "int4, 64-token blocks, 1 salient", "-",
           {"kv_cache_dtype": "int4", "block_size": 64, "kv_cache_salient_ratio": 1 / 64}),
    Config("int4-b64-recent256", "int4, 64-token blocks, 1 salient, 256 recent", "-",
           {"kv_cache_dtype": "int4", "block_size": 64, "kv_cache_salient_ratio": 1 / 64,
            "kv_cache_recent_tokens": 256}),
    Config("int4-b64-nosal-recent256", "int4, 64-token blocks, 256 recent", "-",
           {"kv_cache_dtype": "int4", "block_size": 64, "kv_cache_salient_ratio": 0.0,
            "kv_cache_recent_tokens": 256}),
    Config("sparse-10", "auto", "10%", {"sparse_attention": {"budget": 0.10}}),
    Config("sparse-5", "auto", "5%", {"sparse_attention": {"budget": 0.05}}),
    Config("sparse-10-tidal", "auto", "10% tidal", {"sparse_attention": {"budget": 0.10, "selection": "tidal"}}),
    Config("sparse-10-pages", "auto", "10% pages", {"sparse_attention": {"budget": 0.10, "selection": "pages"}}),
    Config("sparse-5-pages", "auto", "5% pages", {"sparse_attention": {"budget": 0.05, "selection": "pages"}}),
    Config("int4+sparse-10", "int4", "10%", {"kv_cache_dtype": "int4", "sparse_attention": {"budget": 0.10}}),
    Config("int8+sparse-10", "int8", "10%", {"kv_cache_dtype": "int8", "sparse_attention": {"budget": 0.10}}),
]
SECTIONS = ("memory", "speed", "ppl", "greedy", "needle")
LICENCES = ("GPL-3", "GPL-2", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3")
COLOURS = ("blue", "red", "green", "yellow", "orange", "purple", "white", "black", "silver", "golden")
NEEDLE_ANSWER_TOKENS = 24           # one token per digit here: the answer sentence takes ~15

FULL = dict(ppl_tokens=8000, decode_contexts="4096,8000", decode_tokens=64, greedy_prompts=3, greedy_context=2048,
            greedy_tokens=256, needle_lengths="2048,4096,8192", needle_depths=5, needle_trials=1)
QUICK = dict(ppl_tokens=1024, decode_contexts="1024", decode_tokens=16, greedy_prompts=2, greedy_context=512,
             greedy_tokens=32, needle_lengths="1024", needle_depths=3, needle_trials=1)


# -- building an LLM for a configuration -------------------------------------------------------------------------
def build_llm(cfg: Config, args):
    """The configuration's LLM, or (None, why) when the installed engine does not offer the option. An unknown
    keyword is found from ``LLM.__init__``'s signature before anything is loaded; a refused value from the
    exception the constructor raises."""
    from leapdecode import LLM
    params = inspect.signature(LLM.__init__).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    why = []
    for kwargs in (cfg.kwargs, *cfg.alternatives):
        unknown = [k for k in kwargs if k not in params and not open_kwargs]
        if unknown:
            why.append(f"LLM() has no {', '.join(unknown)}")
            continue
        try:
            llm = LLM(resolve(args.model), kv_cache_memory=args.kv_memory, max_num_batched_tokens=args.chunk,
                      enable_prefix_caching=False, max_num_seqs=8, device=args.device, seed=args.seed, **kwargs)
        except (TypeError, ValueError, NotImplementedError) as e:
            why.append(f"LLM({_kw(kwargs)}) refused: {type(e).__name__}: {e}")
            continue
        return llm, kwargs
    return None, "; ".join(why)


def _kw(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def resolve(model: str | None) -> str:
    from leapdecode.llm import resolve_model
    return resolve_model(model)


# -- texts ---------------------------------------------------------------------------------------------------------
def python_docs() -> str:
    """The Python language reference as plain text, as shipped with every Python (``pydoc_data.topics``, what
    ``help()`` prints): long, freely licensed (PSF), and used by nothing else in this benchmark but the speed and
    greedy prompts, which take it from other offsets than the perplexity text."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def haystack_text() -> str:
    """Filler for the needle task: the licences in /usr/share/common-licenses, one after another."""
    parts = []
    for name in LICENCES:
        path = os.path.join("/usr/share/common-licenses", name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                parts.append(f.read().strip())
    if not parts:
        raise SystemExit("no licence texts under /usr/share/common-licenses for the needle haystack")
    return "\n\n".join(parts)


@dataclass
class Texts:
    """Token streams cut once for every configuration, so each sees exactly the same prompts."""
    ppl: list[int]
    speed: dict[int, list[int]]          # context length -> prompt ids
    greedy: list[list[int]]
    needle: dict[int, list[tuple[list[int], str, float]]]   # length -> (prompt ids, code, depth)


def make_texts(tok, args, max_len: int) -> Texts:
    """Perplexity text = the first ``--ppl-tokens`` tokens of the documentation; speed and greedy prompts come
    from the text after it (each from its own offset), so no prompt holds the perplexity text."""
    doc = tok.encode(python_docs(), add_special_tokens=False)
    ppl = doc[:min(args.ppl_tokens, max_len - 1)]
    offset = len(ppl)
    speed = {}
    for n in args.decode_contexts:
        n = min(n, max_len - args.decode_tokens - 1)
        if offset + n > len(doc):
            offset = len(ppl)
        speed[n] = doc[offset:offset + n]
        offset += n
    greedy = []
    for _ in range(args.greedy_prompts):
        ids = _doc_prompt(tok, doc, offset, min(args.greedy_context, max_len - args.greedy_tokens - 1))
        greedy.append(ids)
        offset += args.greedy_context
    rng = random.Random(args.seed)
    hay = haystack_text()
    needle = {}
    for n in args.needle_lengths:
        n = min(n, max_len - NEEDLE_ANSWER_TOKENS - 1)
        needle[n] = [needle_prompt(tok, hay, n, d / max(args.needle_depths - 1, 1), rng)
                     for _ in range(args.needle_trials) for d in range(args.needle_depths)]
    return Texts(ppl, speed, greedy, needle)


def _doc_prompt(tok, doc: list[int], start: int, length: int) -> list[int]:
    """A chat prompt of at most ``length`` tokens: an excerpt of the documentation and a request to summarize it."""
    ask = "\n\nSummarize the documentation above."
    return fit(lambda k: chat_ids(tok, user(tok.decode(doc[start:start + k]) + ask)), length)


def fit(make, length: int) -> list[int]:
    """``make(k)`` builds a prompt around k filler tokens; the largest such prompt of at most ``length`` tokens
    (decoding filler ids to text and encoding it again inside a template does not keep the count exactly)."""
    k = length
    ids = make(k)
    while len(ids) > length:
        k -= len(ids) - length
        ids = make(k)
    return ids


def needle_prompt(tok, hay: str, length: int, depth: float, rng: random.Random) -> tuple[list[int], str, float]:
    """One needle-in-a-haystack prompt of ``length`` tokens (within a few): the filler cut to fit, the needle
    sentence inserted at the line break nearest ``depth`` of the way through, the question after it."""
    colour, code = rng.choice(COLOURS), str(rng.randint(1000, 9999))
    needle = f"The secret code of the {colour} door is {code}."
    question = f"\n\nWhat is the secret code of the {colour} door? Answer with the number only."
    hay_ids = tok.encode(hay, add_special_tokens=False)

    def make(k: int) -> list[int]:
        filler = tok.decode(hay_ids[:k])
        at = round(depth * len(filler))
        if 0 < at < len(filler):                 # move to the nearest line break, so no word or sentence is cut
            before, after = filler.rfind("\n", 0, at), filler.find("\n", at)
            at = min((x for x in (before, after) if x > 0), key=lambda x: abs(x - at), default=at)
        return chat_ids(tok, user(filler[:at] + ("\n" if at else "") + needle + "\n" + filler[at:].lstrip("\n")
                                  + question))
    return fit(make, length), code, depth


# -- instruments ---------------------------------------------------------------------------------------------------
class BackendProbe:
    """Wraps the attention backend(s) the model's layers call, to (1) record each step's attention metadata (query
    and key lengths per sequence) and (2) time ``plan`` + ``write_kv`` + ``attend`` in decode steps (every sequence
    has one query token). Instance attributes shadow the class's methods, so the engine is left untouched apart
    from these objects; on CUDA each timed call is synchronized (which slows it: the time is an upper bound)."""

    def __init__(self, llm) -> None:
        runner = getattr(llm.engine, "runner", None)
        layers = getattr(getattr(runner, "model", None), "layers", None) or []
        self.backends = list({id(b): b for b in (getattr(getattr(l, "self_attn", None), "backend", None)
                                                 for l in layers) if b is not None}.values())
        self.cuda = torch.device(getattr(runner, "device", "cpu")).type == "cuda"
        self.steps: list[tuple[list[int], list[int]]] = []
        self.recording = self.timing = False
        self.seconds = self.cpu_seconds = 0.0
        for b in self.backends:
            for name in ("plan", "write_kv", "attend"):
                if hasattr(b, name):
                    setattr(b, name, self._wrap(getattr(b, name), name == "plan"))

    def _wrap(self, fn, is_plan: bool):
        def wrapper(*a, **k):
            meta = next((x for x in (*a, *k.values()) if hasattr(x, "query_lens")), None)
            if is_plan and self.recording and meta is not None:
                self.steps.append((list(meta.query_lens), list(meta.seq_lens_host)))
            if not (self.timing and meta is not None and all(q == 1 for q in meta.query_lens)):
                return fn(*a, **k)
            if self.cuda:
                torch.cuda.synchronize()
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                if is_plan:     # layer by layer (no one-call CPU layer), so every layer's attention goes through attend
                    meta.cpu_step = None
                if self.cuda:
                    torch.cuda.synchronize()
                self.seconds += time.perf_counter() - t
                self.cpu_seconds += time.thread_time() - c
        return wrapper


def check_chunks(steps: list[tuple[list[int], list[int]]], n: int, chunk: int) -> str:
    """Verify from the recorded metadata that a one-sequence prompt of ``n`` tokens was prefilled in chunks of at
    most ``chunk`` whose queries saw every earlier token through the cache; a one-line verdict."""
    done, bad = 0, []
    for qlens, klens in steps:
        if len(qlens) != 1:
            bad.append(f"{len(qlens)} sequences in a step")
            continue
        if klens[0] - qlens[0] != done or qlens[0] > chunk:
            bad.append(f"step with {qlens[0]} queries over {klens[0]} keys after {done} tokens")
        done += qlens[0]
    if done < n - 1 or bad:
        return f"CHUNKING PROBLEM: {len(steps)} steps, {done}/{n} tokens; {'; '.join(bad[:3])}"
    return (f"ok: {len(steps)} prefill steps of <= {chunk} tokens, step i read i x {chunk} earlier keys from the "
            "paged cache")


# -- measurements --------------------------------------------------------------------------------------------------
def kv_memory(llm, args, model_cfg) -> dict:
    """Bytes per token and blocks in the pool: ``kv_cache_info()`` when the engine has it, else the runner's."""
    runner = llm.engine.runner
    if callable(getattr(llm, "kv_cache_info", None)):
        info, source = dict(llm.kv_cache_info()), "kv_cache_info()"
    else:
        info = {"num_blocks": runner.num_blocks, "block_size": runner.block_size,
                "bytes_per_token": runner.kv_bytes_per_block / runner.block_size, "dtype": str(runner.dtype)}
        source = "runner (no kv_cache_info)"
    per_seq = -(-args.seq_len // info["block_size"])
    c = model_cfg
    return {**info, "source": source, "max_seqs": info["num_blocks"] // per_seq,
            "tokens_in_pool": info["num_blocks"] * info["block_size"],
            "bf16_bytes_per_token": 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2}


def decode_speed(llm, probe: BackendProbe, ids: list[int], n: int) -> dict:
    """Batch 1: prefill ``ids``, then ``n`` greedy tokens, twice: the rates after the first token (the prefill's)
    from a run on the engine's own path, the attention backend's time from a second run with every decode step
    layer by layer (on the CPU the one-call decoder layer runs attention inside C++, where it cannot be timed)."""
    from leapdecode import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    runs = []
    for timed in (False, True):
        probe.seconds = probe.cpu_seconds = 0.0
        first, out = None, None
        for out in llm.stream(ids, params):
            if first is None and out.outputs[0].token_ids:
                first = (time.perf_counter(), time.process_time(), len(out.outputs[0].token_ids))
                probe.timing = timed
        runs.append((time.perf_counter() - first[0], time.process_time() - first[1],
                     len(out.outputs[0].token_ids) - first[2]))
        probe.timing = False
    (wall, cpu, tokens), (_, _, timed_tokens) = runs
    found = bool(probe.backends)
    return {"context": len(ids), "tokens": tokens, "tok/s": tokens / wall, "tok/cpu-s": tokens / cpu,
            "backend ms/token": 1000 * probe.seconds / timed_tokens if found else None,
            "backend cpu-ms/token": 1000 * probe.cpu_seconds / timed_tokens if found else None}


def perplexity(llm, ids: list[int]) -> tuple[float, list[float]]:
    """exp(mean negative log-likelihood) of ``ids[1:]`` from the engine's prompt logprobs (ids[0] has none)."""
    from leapdecode import SamplingParams
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [float(entry[t]) for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]
    if len(lps) != len(ids) - 1:
        raise RuntimeError(f"got {len(lps)} prompt logprobs for {len(ids)} prompt tokens")
    return math.exp(-sum(lps) / len(lps)), lps


def greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens per prompt, one prompt at a time (batch 1, as a single long-context user would run)."""
    from leapdecode import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict:
    """Mean over prompts of the identical prefix (fraction of tokens before the first divergence) and of the
    fraction of positions holding the same token."""
    prefix, same = [], []
    for a, b in zip(ours, ref):
        n = max(len(a), len(b))
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(k / n)
        same.append(sum(x == y for x, y in zip(a, b)) / n)
    return {"prefix": sum(prefix) / len(prefix), "overall": sum(same) / len(same),
            "identical": sum(a == b for a, b in zip(ours, ref))}


def needle_accuracy(llm, prompts: list[tuple[list[int], str, float]], batch: int) -> dict:
    """Fraction of prompts whose greedy answer contains the code; ``batch`` prompts at a time (as many as the
    pool holds, so no request is preempted and recomputed)."""
    from leapdecode import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=NEEDLE_ANSWER_TOKENS)
    hits, misses, answers = 0, [], []
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        outs = llm.generate([p for p, _, _ in group], params, use_tqdm=False)
        for (_, code, depth), o in zip(group, outs):
            text = o.outputs[0].text
            answers.append(text)
            hits += code in text
            if code not in text:
                misses.append(f"{depth:.0%}: {text.strip()[:48]!r}")
    return {"accuracy": hits / len(prompts), "hits": hits, "n": len(prompts), "misses": misses, "answers": answers}


def same_answers(ours: list[str], ref: list[str]) -> int:
    """How many answers name the same code as the reference's (the first number in each, else the whole text):
    at lengths where even full precision fails, this still shows whether compression changed the answer."""
    def key(text: str) -> str:
        m = re.search(r"\d+", text)
        return m.group(0) if m else text.strip()
    return sum(key(a) == key(b) for a, b in zip(ours, ref))


def run_config(cfg: Config, args, texts: Texts, ref: dict | None, model_cfg) -> dict:
    """Every selected section for one configuration; ``ref`` holds "auto"'s results (None while running it)."""
    t0 = time.perf_counter()
    llm, used = build_llm(cfg, args)
    if llm is None:
        return {"name": cfg.name, "skipped": used}
    row: dict = {"name": cfg.name, "format": cfg.fmt, "budget": cfg.budget, "kwargs": _kw(used)}
    probe = BackendProbe(llm)
    from leapdecode import SamplingParams
    llm.generate([texts.ppl[:32]], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up
    log = lambda what: print(f"  {cfg.name}: {what} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    mem = kv_memory(llm, args, model_cfg)
    if "memory" in args.sections:
        row["memory"] = mem
    if "speed" in args.sections:
        row["speed"] = [decode_speed(llm, probe, ids, args.decode_tokens) for ids in texts.speed.values()]
        log("speed " + ", ".join(f"{s['tok/s']:.1f} tok/s @{s['context']}" for s in row["speed"]))
    if "ppl" in args.sections:
        probe.steps, probe.recording = [], True
        ppl, lps = perplexity(llm, texts.ppl)
        probe.recording = False
        row["ppl"] = ppl
        row["chunking"] = (check_chunks(probe.steps, len(texts.ppl), args.chunk) if probe.backends else
                           "not checked: no attention backend found on the model's layers")
        if ref is None:
            row["one-shot check"] = one_shot_check(args, texts.ppl, lps)
        log(f"ppl {ppl:.4f}; chunking {row['chunking'][:40]}")
    if "greedy" in args.sections:
        row["greedy_ids"] = greedy(llm, texts.greedy, args.greedy_tokens)
        if ref is not None and "greedy_ids" in ref:
            row["greedy"] = agreement(row["greedy_ids"], ref["greedy_ids"])
        log("greedy")
    if "needle" in args.sections:
        row["needle"] = {}
        for n, prompts in texts.needle.items():
            batch = max(1, min(8, mem["tokens_in_pool"] // (n + NEEDLE_ANSWER_TOKENS + mem["block_size"])))
            row["needle"][n] = a = needle_accuracy(llm, prompts, batch)
            if ref is not None and n in ref.get("needle", {}):
                a["same as auto"] = same_answers(a["answers"], ref["needle"][n]["answers"])
            log(f"needle {n}: {row['needle'][n]['accuracy']:.0%}")
    row["seconds"] = time.perf_counter() - t0
    del llm, probe
    gc.collect()
    return row


def one_shot_check(args, ids: list[int], chunked: list[float]) -> str:
    """On "auto": the first 1024 tokens' prompt logprobs from one unchunked prefill equal the chunked ones (so the
    chunking itself costs nothing and any difference elsewhere is the cache's)."""
    from leapdecode import LLM
    n = min(len(ids), 1024)
    llm = LLM(resolve(args.model), kv_cache_memory=args.kv_memory, max_num_batched_tokens=max(n, 2048),
              enable_prefix_caching=False, max_num_seqs=1, device=args.device)
    _, lps = perplexity(llm, ids[:n])
    del llm
    gc.collect()
    diff = max(abs(a - b) for a, b in zip(lps, chunked))
    return f"max |logprob difference| chunked ({args.chunk}) vs one-shot over {n} tokens: {diff:.2e}"


# -- report --------------------------------------------------------------------------------------------------------
def header(args, model_cfg, path: str, load0: float, load1: float, wall: float) -> str:
    import transformers
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        commit += " (+ uncommitted changes)" if dirty else ""
    except OSError:
        commit = "?"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    c = model_cfg
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = f", {torch.cuda.get_device_name()}" if device == "cuda" else ""
    return (f"model: {os.path.basename(path)} ({c.num_layers} layers, {c.num_kv_heads} KV heads x {c.head_dim}, "
            f"weights float32, context {c.max_position_embeddings})\n"
            f"machine: {cpu}, {os.cpu_count()} CPUs{gpu}; device {device}; torch threads {torch.get_num_threads()}; "
            f"load average {load0:.1f} before, {load1:.1f} after; {wall / 60:.1f} min in all\n"
            f"versions: leapdecode {commit}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()}\n"
            f"sizes: KV pool {args.kv_memory_text}, max seqs at {args.seq_len} tokens; prefill chunk {args.chunk}; "
            f"ppl over {args.ppl_tokens_used} tokens of pydoc_data.topics; decode {args.decode_tokens} tokens at "
            f"batch 1 after {'/'.join(map(str, args.decode_used))}-token prompts; greedy {args.greedy_prompts} "
            f"prompts x {args.greedy_context} tokens, {args.greedy_tokens} new; needle {args.needle_depths} depths x "
            f"{args.needle_trials} trials per length ({'/'.join(map(str, args.needle_used))} tokens)")


def table(rows: list[dict], args) -> str:
    ref = next((r for r in rows if r["name"] == "auto" and "skipped" not in r), {})
    ctx = "/".join(map(short, args.decode_used))
    nl = [short(n) for n in args.needle_used]
    cols = ["config", "format", "budget", "KV dtype (engine)", "bytes/token", "vs auto", "vs bf16",
            f"max seqs ({args.seq_len} tok)", f"decode tok/s @{ctx}", f"tok/CPU-s @{ctx}",
            f"attn {'' if args.cuda else 'CPU-'}ms/token @{ctx} (vs auto)", "ppl", "ppl +%",
            "greedy: prefix / overall", *[f"needle {x}" for x in nl], "wall (s)"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * 4 + "---:|" * (len(cols) - 4)]
    f = lambda x, spec: "-" if x is None else format(x, spec)
    for r in rows:
        if "skipped" in r:
            continue
        m, s = r.get("memory"), r.get("speed")
        bpt = m["bytes_per_token"] if m else None
        ref_bpt = ref.get("memory", {}).get("bytes_per_token")
        ppl, ref_ppl = r.get("ppl"), ref.get("ppl")
        g = r.get("greedy")
        cells = [r["name"], r["format"], r["budget"], m["dtype"] if m else "-", f(bpt, ".0f"),
                 f"{ref_bpt / bpt:.2f}x" if bpt and ref_bpt else "-",
                 f"{m['bf16_bytes_per_token'] / bpt:.2f}x" if bpt else "-", f(m and m["max_seqs"], "d"),
                 " / ".join(f"{x['tok/s']:.1f}" for x in s) if s else "-",
                 " / ".join(f"{x['tok/cpu-s']:.1f}" for x in s) if s else "-",
                 " / ".join(attn_cell(x, y, args.cuda, r is ref) for x, y in zip(s, ref.get("speed", s)))
                 if s else "-",
                 f(ppl, ".4f"), f"{100 * (ppl / ref_ppl - 1):+.3f}" if ppl and ref_ppl else "-",
                 (f"{g['prefix']:.3f} / {g['overall']:.3f}" if g else
                  ("(reference)" if r is ref and "greedy_ids" in r else "-")),
                 *[needle_cell(r.get("needle", {}).get(n)) for n in args.needle_used],
                 f"{r['seconds']:.0f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def short(n: int) -> str:
    """A prompt length for a column title: 4096 -> 4k, 8167 -> 8k, 512 -> 512."""
    return f"{round(n / 1024)}k" if n >= 1024 else str(n)


def attn_cell(x: dict, ref: dict, cuda: bool, is_ref: bool) -> str:
    """Attention-backend time per decoded token (CPU time of the thread on CPU, synchronized wall time on CUDA),
    and how many times faster than "auto" at the same context."""
    key = "backend ms/token" if cuda else "backend cpu-ms/token"
    if x[key] is None or ref[key] is None:
        return "-"
    return f"{x[key]:.1f}" + ("" if is_ref else f" ({ref[key] / x[key]:.2f}x)")


def needle_cell(a: dict | None) -> str:
    """'4/5' (correct answers), then for a compressed configuration how many answers name the same code as
    "auto"'s."""
    if not a:
        return "-"
    return f"{a['hits']}/{a['n']}" + (f" (={a['same as auto']})" if "same as auto" in a else "")


def notes(rows: list[dict]) -> str:
    """Per configuration: the arguments used or why it was skipped, the chunking checks, the pool, the misses."""
    ref = next((r for r in rows if r["name"] == "auto" and r.get("memory")), None)
    lines = []
    for r in rows:
        if "skipped" in r:
            lines.append(f"- {r['name']}: skipped ({r['skipped']})")
            continue
        if r["kwargs"]:
            lines.append(f"- {r['name']}: LLM({r['kwargs']})")
        if "chunking" in r:
            lines.append(f"- {r['name']}: chunked prefill check: {r['chunking']}")
        if "one-shot check" in r:
            lines.append(f"- {r['name']}: {r['one-shot check']}")
        if r.get("memory"):
            m = r["memory"]
            lines.append(f"- {r['name']}: KV from {m['source']}: {m['num_blocks']} blocks of {m['block_size']} "
                         f"tokens ({m['tokens_in_pool']} tokens) in the pool")
            if "kv_cache_dtype" in r["kwargs"] and ref and m["bytes_per_token"] == ref["memory"]["bytes_per_token"]:
                lines.append(f"- {r['name']}: WARNING: as many bytes per token as auto: did kv_cache_dtype take "
                             "effect?")
        for n, a in r.get("needle", {}).items():
            if a["misses"]:
                lines.append(f"- {r['name']}: needle {n} misses (depth: answer): {'; '.join(a['misses'])}")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                    help="comma-separated names from CONFIGS (auto always runs: it is the reference)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {','.join(SECTIONS)}")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run (each size below can "
                    "still be set)")
    ap.add_argument("--model", default=None, help="a .gguf file or HF dir (default: the default model)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    ap.add_argument("--seed", type=int, default=0, help="needle colours and codes")
    ap.add_argument("--kv-memory", default="1GiB", help="KV pool of every LLM; max seqs are counted in it")
    ap.add_argument("--seq-len", type=int, default=4096, help="sequence length for the max-seqs column")
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens: the prefill chunk")
    ap.add_argument("--ppl-tokens", type=int)
    ap.add_argument("--decode-contexts", help="prompt lengths for the speed section, e.g. 4096,8000")
    ap.add_argument("--decode-tokens", type=int)
    ap.add_argument("--greedy-prompts", type=int)
    ap.add_argument("--greedy-context", type=int)
    ap.add_argument("--greedy-tokens", type=int)
    ap.add_argument("--needle-lengths", help="prompt lengths, e.g. 2048,4096,8192 (capped at the context)")
    ap.add_argument("--needle-depths", type=int)
    ap.add_argument("--needle-trials", type=int)
    ap.add_argument("--json", default=None, help="also write every result here")
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.decode_contexts = [int(x) for x in str(args.decode_contexts).split(",") if x]
    args.needle_lengths = [int(x) for x in str(args.needle_lengths).split(",") if x]
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    names = [n for n in args.configs.split(",") if n]
    known = {c.name: c for c in CONFIGS}
    if set(names) - set(known):
        ap.error(f"unknown configs {sorted(set(names) - set(known))}; known: {', '.join(known)}")
    args.config_list = [known["auto"]] + [known[n] for n in names if n != "auto"]
    from leapdecode.config import parse_memory
    args.kv_memory_text, args.kv_memory = args.kv_memory, parse_memory(args.kv_memory)
    args.cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    from transformers import AutoConfig  # noqa: F401  (imported before timing anything: it is slow)
    from leapdecode import LLM
    probe_llm = LLM(resolve(args.model), kv_cache_memory=args.kv_memory, max_num_seqs=1, device=args.device)
    tok, model_cfg, max_len = probe_llm.get_tokenizer(), probe_llm.engine.model_cfg, probe_llm.engine.max_model_len
    del probe_llm
    gc.collect()
    texts = make_texts(tok, args, max_len)
    args.ppl_tokens_used = len(texts.ppl)
    args.decode_used = list(texts.speed)
    args.needle_used = list(texts.needle)
    rows, ref = [], None
    for cfg in args.config_list:
        print(f"{cfg.name} ...", file=sys.stderr, flush=True)
        row = run_config(cfg, args, texts, ref, model_cfg)
        if "skipped" in row:
            print(f"  {cfg.name}: skipped: {row['skipped']}", file=sys.stderr, flush=True)
        elif cfg.name == "auto":
            ref = row
        rows.append(row)
    path = resolve(args.model)
    print("\n" + header(args, model_cfg, path, load0, os.getloadavg()[0], time.perf_counter() - t0) + "\n")
    print(table(rows, args) + "\n")
    print("Decode columns: one value per prompt length. Needle cells: correct answers, and in parentheses how many "
          "name the same code as \"auto\"'s answer.\n")
    print(notes(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "config_list"}, "rows": rows}, f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
