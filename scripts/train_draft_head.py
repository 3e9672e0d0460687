"""Train an EAGLE-style draft head (leapdecode/spec/eagle.py), or with ``--head kangaroo`` a Kangaroo adapter
(leapdecode/spec/kangaroo.py), on the target's own generations (self-distillation).

Three stages, each bounded in wall time so the whole run fits a CPU hour for SmolLM2-135M-Instruct:

1. **data**: chat prompts, each through the target's chat template: MT-Bench turn 1 and turn 2 (turn 2 after the
   target's own answer to turn 1), GSM8K questions, HumanEval functions ("Complete this Python function"), and
   user questions sampled from the target itself (Magpie: the chat template up to the user's text, sampled at
   T=1). Only the *training split* is used (``split_of``: a fixed, documented rule; the held-out split is what
   benchmarks/eagle_acceptance.py evaluates on). Answers come from ``LLM.generate`` (greedy, batched), in rounds of
   ``--batch`` prompts (``--seqs`` decoded at once) until ``--gen-minutes`` run out; then teacher-forced forwards
   over packs of sequences record the target's final-norm hidden state at every position
   (``ModelRunner.execute(capture=(L,), all_rows=True)``).
2. **train**: the head (one decoder layer, fc 2d -> d, the target's frozen embedding and LM head over a draft
   vocabulary of the most frequent training tokens) with EAGLE's loss: smooth-L1 on the next feature + 0.1 x
   cross-entropy against the target's distribution, unrolled ``--unroll`` steps on the head's own predictions
   (``distill_loss``: it then learns from what it reads when it drafts); AdamW, linear decay over
   ``--train-minutes``.
3. **save**: an HF-style directory (config.json + model.safetensors, bf16) with the data and training figures in
   ``config.json["training"]``.

``--head kangaroo --exit-layer N``: the data stage also records the residual stream after the target's first N
layers (what the adapter reads), and training fits the adapter's draft-vocabulary distribution to the target's
(cross-entropy at answer positions, the same schedule); the default output is leapdecode/assets/kangaroo-smollm2-135m.
The shipped adapter: ``--head kangaroo --exit-layer 6 --gen-minutes 7 --ref-minutes 2``, then ``--stage train
--train-minutes 14 --lr 3e-3`` (benchmarks/README.md, "Kangaroo").

    .venv/bin/python scripts/train_draft_head.py --out leapdecode/assets/eagle-smollm2-135m
    .venv/bin/python scripts/train_draft_head.py --stage data --work /tmp/eagle      # data only, then
    .venv/bin/python scripts/train_draft_head.py --stage train --work /tmp/eagle --out DIR

On a GPU pass ``--device cuda``: generation, recording and training all run there.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
BENCH = os.path.join(os.path.dirname(REPO), "shared", "bench")

TASKS = ("chat", "math", "code")


# -- prompts and the train / held-out split (shared with benchmarks/eagle_acceptance.py) ------------------------

def read_jsonl(*parts: str) -> list[dict]:
    with open(os.path.join(BENCH, *parts)) as f:
        return [json.loads(line) for line in f if line.strip()]


def split_of(index: int) -> str:
    """The fixed split of every dataset here, by the item's index in its file: the first 16 items and every 5th
    one are held out (the benchmarks' first-k prompts are therefore never trained on); the rest may be trained on."""
    return "heldout" if index < 16 or index % 5 == 0 else "train"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def code_prompt(item: dict) -> str:
    return "Complete this Python function:\n```python\n" + item["prompt"] + "```"


def chat_ids(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def items(split: str) -> dict[str, list[tuple[str, object]]]:
    """(kind, payload) per task for ``split``: MT-Bench items (two turns), GSM8K questions, HumanEval prompts."""
    mt = [("mt", q) for i, q in enumerate(read_jsonl("mt_bench", "question.jsonl")) if split_of(i) == split]
    gsm = [("user", q["question"]) for i, q in enumerate(read_jsonl("gsm8k", "test.jsonl")) if split_of(i) == split]
    he = [("user", code_prompt(q)) for i, q in enumerate(read_jsonl("humaneval", "HumanEval.jsonl"))
          if split_of(i) == split]
    return {"chat": mt, "math": gsm, "code": he}


# -- stage 1: data --------------------------------------------------------------------------------------------------

def magpie_queries(llm, n: int, max_tokens: int = 64) -> list[str]:
    """User questions sampled from the target itself: its chat template cut where the user's text begins."""
    from leapdecode import SamplingParams
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(user("\x00"), tokenize=False, add_generation_prompt=False)
    prefix = tok.encode(text[:text.index("\x00")], add_special_tokens=False)
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=1000 + i) for i in range(n)]
    outs = llm.generate([prefix] * n, params, use_tqdm=False)
    qs = []
    for o in outs:
        c = o.outputs[0]
        q = c.text.strip()
        if c.finish_reason == "stop" and len(q.split()) >= 4 and q not in qs:
            qs.append(q)
    return qs


def record_features(llm, seqs: list[list[int]], max_tokens: int = 4096) -> list[torch.Tensor]:
    """The target's final-norm hidden state at every position of each sequence in ``seqs``."""
    L = llm.engine.model_cfg.num_layers
    return [states[L] for states in record_states(llm, seqs, (L,), max_tokens)]


def record_states(llm, seqs: list[list[int]], layers: tuple[int, ...],
                  max_tokens: int = 4096) -> list[dict[int, torch.Tensor]]:
    """The target's hidden states ``layers`` (``ModelRunner.execute(capture=...)`` numbering: i = after i layers,
    the last one after the final norm) at every position of each sequence in ``seqs``: teacher-forced forwards over
    packs of at most ``max_tokens`` tokens (no logits beyond one row per sequence)."""
    from leapdecode.engine.sequence import Sequence
    from leapdecode.engine.step import ScheduledSeq, lay_out
    from leapdecode.sampling_params import SamplingParams
    eng = llm.engine
    out: list[dict[int, torch.Tensor]] = []
    i = 0
    while i < len(seqs):
        pack, n = [], 0
        while i < len(seqs) and (not pack or n + len(seqs[i]) <= max_tokens):
            seq = Sequence(f"record-{i}", 0, list(seqs[i]), SamplingParams())
            if not eng.block_manager.allocate(seq, len(seqs[i])):
                if not pack:
                    raise RuntimeError(f"no KV room to record a sequence of {len(seqs[i])} tokens")
                break
            pack.append(seq)
            n += len(seqs[i])
            i += 1
        try:
            chunks = [ScheduledSeq(s.seq_id, 0, tuple(s.token_ids), tuple(s.block_table)) for s in pack]
            res = eng.runner.execute(lay_out(0, eng.cfg.block_size, chunks), capture=layers, all_rows=True)
            sizes = [len(s.token_ids) for s in pack]
            per_layer = {j: res.hidden_states[j].float().cpu().split(sizes) for j in layers}
            out += [{j: per_layer[j][b] for j in layers} for b in range(len(pack))]
        finally:
            for s in pack:
                eng.block_manager.free_seq(s)
    return out


def recorded(llm, seqs: list[list[int]], args) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(final features, the early states a Kangaroo adapter reads or None) of each sequence, as ``--head`` needs."""
    L, early = llm.engine.model_cfg.num_layers, early_layer(args)
    layers = (L,) if early is None else (L, early)
    return [(st[L], st.get(early)) for st in record_states(llm, seqs, layers)]


def generate_rounds(llm, queue: list[tuple[str, list[int], dict]], max_tokens: int, batch: int, deadline: float,
                    log) -> list[dict]:
    """Greedy answers for ``queue`` (task, prompt ids, meta) in batches until ``deadline``; an MT-Bench turn 1
    adds its turn 2 (after the target's own answer) to the queue."""
    from leapdecode import SamplingParams
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    done: list[dict] = []
    t0 = time.time()
    while queue and time.time() < deadline:
        chunk, queue[:] = queue[:batch], queue[batch:]
        outs = llm.generate([p for _, p, _ in chunk], params, use_tqdm=False)
        for (task, prompt, meta), o in zip(chunk, outs):
            answer = list(o.outputs[0].token_ids)
            done.append({"task": task, "ids": prompt + answer, "prompt_len": len(prompt), **meta})
            if meta.get("turn") == 1:
                q = meta["q"]
                msgs = user(q["turns"][0]) + [{"role": "assistant", "content": o.outputs[0].text}] + user(q["turns"][1])
                queue.insert(min(len(queue), batch), (task, chat_ids(tok, msgs), {"turn": 2}))
        n = sum(len(d["ids"]) - d["prompt_len"] for d in done)
        log(f"  generated {len(done)} answers, {n} tokens, {n / (time.time() - t0):.1f} tok/s")
    for d in done:
        d.pop("q", None)
    return done


def stage_data(args, log) -> None:
    from leapdecode import LLM
    t_start = time.time()
    llm = LLM(args.model, max_model_len=args.max_model_len, enable_prefix_caching=False, device=args.device,
              max_num_seqs=args.seqs or args.batch)
    tok = llm.get_tokenizer()
    per_task = items("train")
    rng = random.Random(0)
    for v in per_task.values():
        rng.shuffle(v)
    magpie = magpie_queries(llm, args.magpie) if args.magpie else []
    log(f"magpie: {len(magpie)} self-generated user questions in {time.time() - t_start:.0f} s")
    streams = {
        "chat": [("chat", chat_ids(tok, user(q["turns"][0])), {"turn": 1, "q": q}) for _, q in per_task["chat"]],
        "magpie": [("chat", chat_ids(tok, user(q)), {"source": "magpie"}) for q in magpie],
        "math": [("math", chat_ids(tok, user(q)), {}) for _, q in per_task["math"]],
        "code": [("code", chat_ids(tok, user(q)), {}) for _, q in per_task["code"]],
    }
    queue: list = []
    while any(streams.values()):            # round robin: every batch mixes the task types
        for s in streams.values():
            if s:
                queue.append(s.pop(0))
    queue = [q for q in queue if len(q[1]) + args.max_tokens <= args.max_model_len]
    deadline = t_start + args.gen_minutes * 60
    done = generate_rounds(llm, queue, args.max_tokens, args.batch, deadline, log)
    t_gen = time.time() - t_start
    t1 = time.time()
    for d, (f, e) in zip(done, recorded(llm, [d["ids"] for d in done], args)):
        d["feats"] = f.to(torch.bfloat16)
        if e is not None:
            d["early"] = e.to(torch.bfloat16)
        d["ids"] = torch.tensor(d["ids"], dtype=torch.int32)
    t_rec = time.time() - t1
    stats = {"sequences": len(done), "tokens": sum(len(d["ids"]) for d in done),
             "answer_tokens": sum(len(d["ids"]) - d["prompt_len"] for d in done),
             "per_task": dict(Counter(d["task"] for d in done)), "magpie_questions": len(magpie),
             "generate_seconds": round(t_gen, 1), "record_seconds": round(t_rec, 1), "model": llm.engine.cfg.model,
             "early_layer": early_layer(args)}
    os.makedirs(args.work, exist_ok=True)
    torch.save({"seqs": done, "stats": stats}, os.path.join(args.work, "data.pt"))
    log(f"data: {json.dumps(stats)}")


def reference_conversations(tok) -> list[tuple[str, list[int], int]]:
    """Training-split prompts with the *datasets'* reference answers as the assistant turn: (task, ids, prompt
    length). Not the target's own text, but the head learns the target's features and distribution on it all the
    same (EAGLE-1 trained on fixed ShareGPT answers); teacher forcing costs one forward, far less than generating."""
    import re
    out = []
    refs = {r["question_id"]: r["choices"][0]["turns"] for r in read_jsonl("mt_bench", "reference_answer_gpt-4.jsonl")}
    for i, q in enumerate(read_jsonl("mt_bench", "question.jsonl")):
        if split_of(i) == "train" and q["question_id"] in refs:
            out.append(("chat", user(q["turns"][0]), refs[q["question_id"]][0]))
    for i, q in enumerate(read_jsonl("gsm8k", "test.jsonl")):
        if split_of(i) == "train":
            answer = re.sub(r"<<[^>]*>>", "", q["answer"]).replace("#### ", "The answer is ")
            out.append(("math", user(q["question"]), answer))
    for i, q in enumerate(read_jsonl("humaneval", "HumanEval.jsonl")):
        if split_of(i) == "train":
            out.append(("code", user(code_prompt(q)), "```python\n" + q["prompt"] + q["canonical_solution"] + "```"))
    convs = []
    for task, msgs, answer in out:
        prompt = chat_ids(tok, msgs)
        full = tok.encode(tok.apply_chat_template(msgs + [{"role": "assistant", "content": answer}], tokenize=False),
                          add_special_tokens=False)
        if full[:len(prompt)] == prompt:
            convs.append((task, full, len(prompt)))
    return convs


def stage_refdata(args, log) -> None:
    """Teacher-forced reference answers until ``--ref-minutes`` run out (round robin over the tasks)."""
    from leapdecode import LLM
    t0 = time.time()
    llm = LLM(args.model, max_model_len=args.max_model_len, enable_prefix_caching=False, device=args.device)
    convs = [c for c in reference_conversations(llm.get_tokenizer()) if len(c[1]) <= args.max_model_len]
    rng = random.Random(1)
    by_task = {t: [c for c in convs if c[0] == t] for t in TASKS}
    for v in by_task.values():
        rng.shuffle(v)
    order = []
    while any(by_task.values()):
        for v in by_task.values():
            if v:
                order.append(v.pop(0))
    done = []
    for at in range(0, len(order), 16):
        if time.time() - t0 > args.ref_minutes * 60:
            break
        part = order[at:at + 16]
        for (task, ids, plen), (f, e) in zip(part, recorded(llm, [c[1] for c in part], args)):
            done.append({"task": task, "ids": torch.tensor(ids, dtype=torch.int32), "prompt_len": plen,
                         "source": "reference", "feats": f.to(torch.bfloat16),
                         **({"early": e.to(torch.bfloat16)} if e is not None else {})})
    stats = {"sequences": len(done), "tokens": sum(len(d["ids"]) for d in done),
             "answer_tokens": sum(len(d["ids"]) - d["prompt_len"] for d in done),
             "per_task": dict(Counter(d["task"] for d in done)), "seconds": round(time.time() - t0, 1)}
    os.makedirs(args.work, exist_ok=True)
    torch.save({"seqs": done, "stats": stats}, os.path.join(args.work, "data_ref.pt"))
    log(f"reference data: {json.dumps(stats)}")


# -- stage 2: training ----------------------------------------------------------------------------------------------

def load_target_parts(model_path: str, device: str):
    """The target's ModelConfig and its embedding / LM head weights (float32), without starting an engine."""
    from leapdecode import LLM
    llm = LLM(model_path, max_model_len=64, num_kv_blocks=8, device=device)
    model = llm.engine.runner.model
    lm = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return llm.engine.model_cfg, model.embed_tokens.weight.detach().float(), lm.detach().float(), llm.engine.cfg.model


def batches(seqs: list[dict], max_tokens: int, rng: random.Random) -> list[list[dict]]:
    """Length-sorted buckets of at most ``max_tokens`` padded tokens, in random order."""
    order = sorted(seqs, key=lambda d: len(d["ids"]))
    out, cur = [], []
    for d in order:
        if cur and (len(cur) + 1) * len(d["ids"]) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(d)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(group: list[dict], device: str):
    T = max(len(d["ids"]) for d in group)
    d_model = group[0]["feats"].shape[1]
    feats = torch.zeros(len(group), T, d_model)
    toks = torch.zeros(len(group), T, dtype=torch.long)
    valid = torch.zeros(len(group), T, dtype=torch.bool)
    cls_from = torch.zeros(len(group), dtype=torch.long)
    for b, d in enumerate(group):
        cls_from[b] = max(d.get("prompt_len", 1) - 1, 0)
        n = len(d["ids"])
        feats[b, :n] = d["feats"].float()
        toks[b, :n] = d["ids"].long()
        valid[b, :n] = True
    return feats.to(device), toks.to(device), valid.to(device), cls_from.to(device)


def load_data(args) -> tuple[list[dict], dict]:
    """The recorded sequences (generated, then reference answers if recorded) and their figures."""
    data = torch.load(os.path.join(args.work, "data.pt"), weights_only=False)
    seqs, stats = data["seqs"], {"generated": data["stats"]}
    ref = os.path.join(args.work, "data_ref.pt")
    if os.path.isfile(ref):
        extra = torch.load(ref, weights_only=False)
        seqs += extra["seqs"]
        stats["reference_answers"] = extra["stats"]
    return seqs, stats


def draft_vocabulary(seqs: list[dict], vocab_n: int, vocab_size: int) -> tuple[list[int], float]:
    """The ``vocab_n`` most frequent tokens of the training data (padded with the lowest ids never seen), and the
    share of training tokens they cover."""
    counts = Counter()
    for d in seqs:
        counts.update(d["ids"][1:].tolist())
    top = [t for t, _ in counts.most_common(vocab_n)]
    if len(top) < vocab_n:                  # pad with the lowest ids never seen (any fixed rule would do)
        seen = set(top)
        top += [t for t in range(vocab_size) if t not in seen][:vocab_n - len(top)]
    return top, sum(counts[t] for t in top) / max(sum(counts.values()), 1)


def early_layer(args) -> int | None:
    """The layer whose residual stream the data records besides the final features (a Kangaroo adapter's)."""
    return args.exit_layer if args.head == "kangaroo" else None


def train_loop(module: torch.nn.Module, seqs: list[dict], args, log, loss_of) -> tuple[int, int, list, dict, float]:
    """AdamW (betas 0.9 / 0.95) over ``module``'s trainable parameters, epochs of length-bucketed batches of at most
    ``--batch-tokens``, ``--warmup`` steps of linear warm-up then linear decay until ``--train-minutes`` run out,
    gradients clipped at 0.5; ``loss_of(group) -> (loss, figures, tokens)``, whose figures are logged per epoch
    (token-weighted). Returns (steps, epochs, the epochs' figures, the first step's, seconds)."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(args.seed)
    budget = args.train_minutes * 60
    t0, step, epoch, hist = time.time(), 0, 0, []
    first = None
    while time.time() - t0 < budget:
        epoch += 1
        agg = Counter()
        ntok = 0
        for group in batches(seqs, args.batch_tokens, rng):
            elapsed = time.time() - t0
            if elapsed >= budget:
                break
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * max(0.02, 1 - elapsed / budget)
            for g in opt.param_groups:
                g["lr"] = lr
            loss, parts, n = loss_of(group)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            step += 1
            ntok += n
            for k, v in parts.items():
                agg[k] += v * n
            if first is None:
                first = parts
        if ntok:
            row = {"epoch": epoch, "step": step, "seconds": round(time.time() - t0, 1),
                   **{k: round(v / ntok, 4) for k, v in agg.items()}}
            hist.append(row)
            log(f"  {json.dumps(row)}")
    return step, epoch, hist, first, time.time() - t0


def stage_train(args, log) -> None:
    from leapdecode.spec.eagle import EagleConfig, EagleHead, distill_loss
    seqs, stats = load_data(args)
    mc, embed, lm, model_name = load_target_parts(args.model or stats["generated"]["model"], args.device)
    vocab_n = min(args.draft_vocab, mc.vocab_size) if args.draft_vocab else mc.vocab_size
    top, covered = draft_vocabulary(seqs, vocab_n, mc.vocab_size)
    cfg = EagleConfig.for_target(mc, draft_vocab_size=vocab_n if vocab_n < mc.vocab_size else None,
                                 target={"model": os.path.basename(str(model_name)), "num_layers": mc.num_layers})
    torch.manual_seed(args.seed)
    if args.init:      # go on from a trained head: its weights predict features, whatever the draft vocabulary
        head = EagleHead.from_pretrained(args.init, device=args.device)
        if head.cfg.draft_vocab_size != cfg.draft_vocab_size:
            raise ValueError(f"--init {args.init} has a draft vocabulary of {head.cfg.draft_vocab_size}, "
                             f"--draft-vocab asks for {cfg.draft_vocab_size}")
        head.cfg.target = cfg.target
        stats["init"] = os.path.basename(os.path.normpath(args.init))
    else:
        head = EagleHead(cfg)
    head.draft_vocab, head._vocab_list = torch.tensor(sorted(top)), None
    head = head.to(args.device)
    head.bind(embed.to(args.device), lm.to(args.device))
    feat_scale = torch.cat([d["feats"][:64].float() for d in seqs[:50]]).abs().mean().item()
    noise = args.noise * feat_scale
    log(f"head: {head.num_parameters() / 1e6:.2f}M parameters, draft vocab {vocab_n} tokens covering "
        f"{100 * covered:.1f}% of training tokens; feature mean |x| {feat_scale:.3f}, input noise +-{noise:.3f}")
    def loss_of(group: list[dict]) -> tuple[torch.Tensor, dict, int]:
        feats, toks, valid, cls_from = collate(group, args.device)
        loss, parts = distill_loss(head, feats, toks, valid, noise=noise, w_cls=args.w_cls,
                                   cls_from=cls_from if args.answer_ce_only else None, unroll=args.unroll)
        return loss, parts, int(valid.sum())

    step, epoch, hist, first, t_train = train_loop(head, seqs, args, log, loss_of)
    head.cfg.training = {"data": stats, "train_seconds": round(t_train, 1), "steps": step, "epochs": epoch,
                         "lr": args.lr, "w_cls": args.w_cls, "unroll": args.unroll,
                         "answer_ce_only": bool(args.answer_ce_only),
                         "batch_tokens": args.batch_tokens, "noise": round(noise, 4),
                         "draft_vocab_coverage": round(covered, 4), "first_step": first, "history": hist,
                         "device": args.device, "threads": torch.get_num_threads(),
                         "split_rule": "index < 16 or index % 5 == 0 held out (scripts/train_draft_head.py)"}
    head.save_pretrained(args.out)
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    log(f"saved {args.out} ({size / 1e6:.1f} MB) after {t_train:.0f} s of training, {step} steps")


def stage_train_kangaroo(args, log) -> None:
    """A Kangaroo adapter (spec/kangaroo.py) on the recorded early states: the cross-entropy of its draft-vocabulary
    distribution against the target's own (the LM head on the recorded final features, restricted to the draft
    vocabulary) at every answer position, from the plain early exit (its start) on; AdamW, linear decay."""
    from leapdecode import LLM
    from leapdecode.spec.kangaroo import AdapterConfig, KangarooAdapter
    seqs, stats = load_data(args)
    if any("early" not in d for d in seqs):
        raise SystemExit(f"{args.work} holds no early states: record the data with --head kangaroo")
    exit_layer = stats["generated"].get("early_layer")
    llm = LLM(args.model or stats["generated"]["model"], max_model_len=64, num_kv_blocks=8, device=args.device)
    model, mc = llm.engine.runner.model, llm.engine.model_cfg
    vocab_n = min(args.draft_vocab, mc.vocab_size) if args.draft_vocab else mc.vocab_size
    top, covered = draft_vocabulary(seqs, vocab_n, mc.vocab_size)
    cfg = AdapterConfig.for_target(mc, exit_layer, draft_vocab_size=vocab_n if vocab_n < mc.vocab_size else None,
                                   target={"model": os.path.basename(str(llm.engine.cfg.model)),
                                           "num_layers": mc.num_layers})
    torch.manual_seed(args.seed)
    adapter = KangarooAdapter(cfg)
    adapter.draft_vocab, adapter._vocab_list = torch.tensor(sorted(top)), None
    adapter = adapter.to(args.device).bind_target(model, init_norm=True)
    lm = adapter.lm_weight.float()
    log(f"adapter: {adapter.num_parameters() / 1e6:.2f}M parameters, exit after layer {exit_layer} of "
        f"{mc.num_layers}, draft vocab {vocab_n} tokens covering {100 * covered:.1f}% of training tokens")
    def loss_of(group: list[dict]) -> tuple[torch.Tensor, dict, int]:
        T = max(len(d["ids"]) for d in group)
        early = torch.zeros(len(group), T, mc.hidden_size)
        final = torch.zeros(len(group), T, mc.hidden_size)
        weight = torch.zeros(len(group), T)
        for b, d in enumerate(group):
            n = len(d["ids"])
            early[b, :n], final[b, :n] = d["early"].float(), d["feats"].float()
            weight[b, max(d.get("prompt_len", 1) - 1, 0):n - 1] = 1.0     # answer positions (next token known)
        early, final, weight = early.to(args.device), final.to(args.device), weight.to(args.device)
        with torch.no_grad():
            target = torch.softmax(F.linear(final, lm), -1)
        positions = torch.arange(T, device=args.device).expand(len(group), T)
        logp = torch.log_softmax(adapter.logits(adapter(early, positions)), -1)
        n = float(weight.sum())
        loss = (-(target * logp).sum(-1) * weight).sum() / max(n, 1.0)
        agree = ((logp.argmax(-1) == target.argmax(-1)).float() * weight).sum().item() / max(n, 1.0)
        return loss, {"loss": loss.item(), "top1_agree": agree}, int(n)

    step, epoch, hist, _, t_train = train_loop(adapter, seqs, args, log, loss_of)
    adapter.cfg.training = {"data": stats, "train_seconds": round(t_train, 1), "steps": step,
                            "epochs": epoch, "lr": args.lr, "batch_tokens": args.batch_tokens,
                            "draft_vocab_coverage": round(covered, 4), "history": hist, "device": args.device,
                            "threads": torch.get_num_threads(),
                            "split_rule": "index < 16 or index % 5 == 0 held out (scripts/train_draft_head.py)"}
    adapter.save_pretrained(args.out)
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    log(f"saved {args.out} ({size / 1e6:.1f} MB) after {step} steps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: leapdecode's default model)")
    ap.add_argument("--stage", choices=("all", "data", "refdata", "train"), default="all")
    ap.add_argument("--ref-minutes", type=float, default=0.0,
                    help="also teacher-force the datasets' reference answers (training split) for this long")
    ap.add_argument("--work", default="/tmp/leapdecode-eagle", help="where the recorded data goes")
    ap.add_argument("--head", choices=("eagle", "kangaroo"), default="eagle",
                    help="an EAGLE head, or a Kangaroo adapter over the target's first --exit-layer layers")
    ap.add_argument("--exit-layer", type=int, default=6, help="--head kangaroo: the layers the draft runs")
    ap.add_argument("--out", default=None, help="default: leapdecode/assets/{eagle,kangaroo}-smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen-minutes", type=float, default=17.0)
    ap.add_argument("--train-minutes", type=float, default=24.0)
    ap.add_argument("--batch", type=int, default=32, help="prompts per generate() call")
    ap.add_argument("--seqs", type=int, default=0,
                    help="sequences decoded at once (continuous batching refills the batch within a call; "
                         "0: --batch)")
    ap.add_argument("--max-tokens", type=int, default=192, help="answer length cap")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--magpie", type=int, default=48, help="self-generated user questions to sample")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="0: the whole vocabulary")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--noise", type=float, default=0.1, help="input noise, as a fraction of the mean |feature|")
    ap.add_argument("--w-cls", type=float, default=0.1, help="weight of the cross-entropy (EAGLE: 0.1)")
    ap.add_argument("--answer-ce-only", type=int, default=1,
                    help="cross-entropy on answer positions only (the regression covers every position)")
    ap.add_argument("--unroll", type=int, default=3,
                    help="train on the head's own predictions this many steps deep (1: EAGLE-1's loss alone)")
    ap.add_argument("--init", default=None, help="start from this trained head's weights")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.out is None:
        args.out = os.path.join(REPO, "leapdecode", "assets", f"{args.head}-smollm2-135m")
    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    if args.stage in ("all", "data"):
        stage_data(args, log)
    if args.stage == "refdata" or (args.stage == "all" and args.ref_minutes > 0):
        stage_refdata(args, log)
    if args.stage in ("all", "train"):
        (stage_train_kangaroo if args.head == "kangaroo" else stage_train)(args, log)


if __name__ == "__main__":
    main()
