#!/usr/bin/env python3
"""Train leapdecode's embedded default model (and its draft model) from scratch.

The models are tiny Llama-architecture causal LMs trained on the Python standard library sources, which are on
every machine that has Python, so the whole pipeline runs offline and is reproducible:

  1. corpus:    the stdlib *.py files (tests, site-packages and codec tables excluded), sorted; ~2% of the files,
                chosen by a hash of their path, are held back for validation.
  2. tokenizer: byte-level BPE (``tokenizers``), special tokens <|endoftext|>, <|im_start|>, <|im_end|> and a
                ChatML chat template, saved so ``transformers.AutoTokenizer`` loads it.
  3. model:     ``transformers.LlamaForCausalLM`` as the model definition, trained with a plain PyTorch AdamW loop
                in fp32; saved in bfloat16 as a standard Hugging Face directory.
  4. report:    validation loss/perplexity of the saved (bf16) weights, greedy samples, and a model card.

The shipped models were made with (on a 2-core CPU shared with other jobs; the exact command of each is also in its
README.md and training_metrics.json):
    # target (trains and saves the tokenizer first)
    nice -n 10 python scripts/train_tiny_model.py --out-dir leapdecode/assets/default_model --max-steps 20000 \
        --time-budget-min 75 --batch-size 16 --procs 2 --threads 1
    # draft (reuses the target's tokenizer, so the two share a vocabulary)
    nice -n 10 python scripts/train_tiny_model.py --out-dir leapdecode/assets/draft_model \
        --tokenizer-from leapdecode/assets/default_model --hidden-size 128 --intermediate-size 384 --num-layers 2 \
        --num-heads 4 --num-kv-heads 2 --lr 4e-3 --max-steps 20000 --time-budget-min 30 --threads 1
A quick end-to-end check: add --max-steps 20 --eval-every 10 --out-dir /tmp/tiny (a minute or two on an idle CPU).

The learning-rate schedule runs on progress = max(step / max_steps, trained_seconds / time_budget): a run that
finishes its steps inside the time budget is purely step-based and is reproduced exactly by the same command (same
seed, same data order); if the time budget binds first, the cosine decay is compressed into it and the card says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOT, IM_START, IM_END = SPECIAL_TOKENS

# ChatML.  The model was never trained on chat data: the template exists so the engine's chat path has something
# standard to render, not because the model can hold a conversation.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]

# Directory names anywhere in a path that mark test suites (left out of the corpus).
TEST_DIRS = {"test", "tests", "idle_test", "__pycache__"}
# Top-level stdlib entries left out: installed third-party packages, the build configuration, and codec modules,
# which are mostly generated 256-entry character tables.
EXCLUDED_TOP = {"site-packages", "dist-packages", "lib-dynload", "encodings"}


# ----------------------------------------------------------------------------------------------------------------
# corpus
# ----------------------------------------------------------------------------------------------------------------
def is_validation_file(relpath: str, val_every: int) -> bool:
    """~1/val_every of the files, chosen by a hash of the path: the choice does not depend on which other files
    exist, so the same file is held back on every Python installation."""
    h = int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16)
    return h % val_every == 0


def collect_corpus(stdlib: Path, val_every: int):
    train, val, skipped = [], [], []
    for path in sorted(stdlib.rglob("*.py"), key=lambda p: p.relative_to(stdlib).as_posix()):
        rel = path.relative_to(stdlib).as_posix()
        parts = rel.split("/")
        if parts[0] in EXCLUDED_TOP or parts[0].startswith("config-") or parts[0].startswith("_sysconfigdata"):
            continue
        if any(p in TEST_DIRS for p in parts[:-1]):
            continue
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as exc:
            skipped.append((rel, type(exc).__name__))
            continue
        if not text.strip():
            continue
        item = (rel, text)
        (val if is_validation_file(rel, val_every) else train).append(item)
    return train, val, skipped


def write_corpus_files(out_dir: Path, stdlib: Path, train, val, skipped) -> None:
    with open(out_dir / "corpus_files.txt", "w", encoding="utf-8") as f:
        f.write(f"# Training corpus of this model: Python {platform.python_version()} standard library at {stdlib}\n")
        f.write("# Licence of every file: PSF License Agreement (see LICENSE-PSF.txt)\n")
        f.write("# columns: split<TAB>bytes<TAB>sha256[:16]<TAB>path relative to the stdlib directory\n")
        for split, items in (("train", train), ("val", val)):
            for rel, text in items:
                data = text.encode("utf-8")
                f.write(f"{split}\t{len(data)}\t{hashlib.sha256(data).hexdigest()[:16]}\t{rel}\n")
        for rel, why in skipped:
            f.write(f"skipped\t0\t-\t{rel} ({why})\n")
    lic = stdlib / "LICENSE.txt"
    if lic.is_file():
        shutil.copyfile(lic, out_dir / "LICENSE-PSF.txt")


# ----------------------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------------------
def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


# ----------------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------------
def encode_stream(tokenizer, items) -> np.ndarray:
    """All files as one token stream, each file preceded by <|endoftext|> (the document separator)."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    backend = tokenizer.backend_tokenizer
    encs = backend.encode_batch([text for _, text in items], add_special_tokens=False)
    out = []
    for enc in encs:
        out.append(eot)
        out.extend(enc.ids)
    out.append(eot)
    dtype = np.uint16 if len(tokenizer) < 65536 else np.int32
    return np.asarray(out, dtype=dtype)


def token_byte_lengths(tokenizer) -> np.ndarray:
    """Bytes of text each token stands for (byte-level BPE: one vocab character = one byte; specials count 0)."""
    lens = np.zeros(len(tokenizer), dtype=np.int64)
    special = set(tokenizer.all_special_ids)
    for token, idx in tokenizer.get_vocab().items():
        lens[idx] = 0 if idx in special else len(token)
    return lens


# ----------------------------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------------------------
def build_model(args, vocab_size: int, eot_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    head_dim = args.hidden_size // args.num_heads
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def lr_at(progress: float, step: int, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    min_lr = args.lr * args.min_lr_ratio
    return min_lr + 0.5 * (args.lr - min_lr) * (1.0 + math.cos(math.pi * p))


def stream_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 tokens (each predicts seq_len tokens), as an [N, seq_len + 1] array."""
    n = (len(stream) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return np.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)


@torch.no_grad()
def evaluate(model, windows: np.ndarray, device, batch_size: int, byte_lens: np.ndarray | None = None):
    """Mean next-token NLL (nats) over the windows, the number of predicted tokens, and bits per byte."""
    was_training = model.training
    model.eval()
    total_nll, total_tokens, total_bytes = 0.0, 0, 0
    for start in range(0, len(windows), batch_size):
        chunk = windows[start:start + batch_size]
        x = torch.from_numpy(chunk).to(device)
        logits = model(input_ids=x[:, :-1]).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += x[:, 1:].numel()
        if byte_lens is not None:
            total_bytes += int(byte_lens[chunk[:, 1:]].sum())
    model.train(was_training)
    mean = total_nll / max(total_tokens, 1)
    bpb = total_nll / math.log(2) / total_bytes if total_bytes else float("nan")
    return mean, total_tokens, bpb


def save_model(model, tokenizer, out_dir: Path, generation_eos) -> None:
    model_bf16 = model.to(torch.bfloat16)
    model_bf16.save_pretrained(out_dir, safe_serialization=True)
    model.float()
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # Keys that older transformers releases and other loaders read (transformers 5 writes dtype/rope_parameters).
    cfg["torch_dtype"] = "bfloat16"
    cfg["dtype"] = "bfloat16"
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = None
    cfg_path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    gen = {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": generation_eos,
        "pad_token_id": cfg["pad_token_id"],
        "do_sample": False,
        "max_length": cfg["max_position_embeddings"],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_tokenizer(tokenizer, out_dir)


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes the template to chat_template.jinja and names its own class; older releases (and other
    # loaders) read chat_template, tokenizer_class and additional_special_tokens from tokenizer_config.json.
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = tokenizer.chat_template
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    for key in ("is_local", "local_files_only"):  # where it was loaded from, when it was loaded (--tokenizer-from)
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# model card
# ----------------------------------------------------------------------------------------------------------------
def write_card(out_dir: Path, m: dict) -> None:
    role = m["role"]
    title = "leapdecode default model" if role == "target" else "leapdecode draft model"
    samples = "\n".join(
        f"**Prompt** `{json.dumps(s['prompt'])}` (greedy, {m['sample_new_tokens']} new tokens):\n\n"
        f"```python\n{s['prompt']}{s['completion']}\n```\n"
        for s in m["samples"]
    )
    draft_note = (
        "It shares its tokenizer with `../default_model` and exists to exercise draft-model speculative decoding.\n"
        if role == "draft" else
        "A much smaller draft model with the same tokenizer lives in `../draft_model`.\n"
    )
    stop_note = (
        "The time budget bound before the step count: the cosine schedule was compressed into the budget, so "
        "re-running with `--max-steps {steps}` and no time budget gives the same data order and length but a "
        "slightly different schedule.".format(steps=m["steps"])
        if m["stopped_by"] == "time" else
        "The run finished its step count inside the time budget, so the schedule was purely step-based and the "
        "command below reproduces it (same seed, same data order; float results can differ across machines "
        "and thread counts)."
    )
    card = f"""---
license: other
license_name: psf-2.0
license_link: LICENSE-PSF.txt
library_name: transformers
pipeline_tag: text-generation
tags: [llama, tiny, test-model, python-code]
---

# {title}

A tiny Llama-architecture causal language model ({m['params'] / 1e6:.2f}M parameters) trained from scratch on CPU on
the Python standard library sources. leapdecode ships it inside the package so that `leapdecode generate` and
`LLM()` work offline with no model flag, and so tests and demos have a real checkpoint to run.
{draft_note}
## What it is, and what it is NOT

- It IS a demo and test model: a real `LlamaForCausalLM` (RMSNorm, RoPE, SwiGLU, grouped-query attention, tied
  embeddings) with a real byte-level BPE tokenizer and a chat template, small enough to run in milliseconds on a CPU.
  Its completions look like Python: indentation, `def`/`return`/`self.` and stdlib idioms.
- It is NOT a useful code model and NOT a chat assistant. It has seen only {m['tokens_seen'] / 1e6:.1f}M tokens of
  one kind of text; its code is usually wrong, it does not follow instructions, and it was never trained on chat
  data: the ChatML template (`<|im_start|>`, `<|im_end|>`) exists only so the chat code path can be exercised.
- Greedy decoding soon falls into repetition loops (see the samples); use it for plumbing, not for text.
- Do not use it to judge the quality of anything except the engine's plumbing. Speed numbers on a model this small
  are dominated by overheads.

## Data

The `*.py` files of the Python {m['python_version']} standard library, excluding test suites (`test/`, `tests/`,
`idle_test/`), `site-packages`, `lib-dynload`, the build configuration and the `encodings` codec tables. Files are
sorted by path; a file is held back for validation when `sha1(path) % {m['val_every']} == 0`
({m['n_val_files']} validation files, {m['n_train_files']} training files; every file is listed in
`corpus_files.txt` with its size and hash). Each file is preceded by `<|endoftext|>`.

- training stream: {m['train_stream_tokens']:,} tokens ({m['train_bytes']:,} bytes)
- validation stream: {m['val_stream_tokens']:,} tokens ({m['val_bytes']:,} bytes)

## Licence

The training corpus is the Python standard library, licensed under the PSF License Agreement (copy in
`LICENSE-PSF.txt`). The tokenizer and weights are derived from it and are distributed under the same terms;
copyright in the source text remains with the Python Software Foundation.

## Architecture

| | |
|---|---|
| parameters | {m['params']:,} ({m['params_non_embedding']:,} without the tied embedding) |
| hidden size / intermediate size | {m['hidden_size']} / {m['intermediate_size']} |
| layers | {m['num_layers']} |
| attention heads / KV heads / head dim | {m['num_heads']} / {m['num_kv_heads']} / {m['head_dim']} |
| vocabulary | {m['vocab_size']} (byte-level BPE, specials `<|endoftext|>`=0, `<|im_start|>`=1, `<|im_end|>`=2) |
| positions | RoPE, theta 10000, max_position_embeddings {m['max_position_embeddings']} (trained on windows of {m['seq_len']}) |
| weights | bfloat16 safetensors, tied input/output embeddings |
| eos | `<|endoftext|>` (generation_config also stops on `<|im_end|>`) |

Quality degrades past {m['seq_len']} positions: the model never saw longer windows.

## Training

| | |
|---|---|
| optimizer | AdamW (betas 0.9/0.95, weight decay {m['weight_decay']} on matrices), grad clip 1.0, fp32 |
| schedule | peak lr {m['lr']}, {m['warmup_steps']} warmup steps, cosine to {m['min_lr_ratio']} x peak |
| batch | {m['batch_size']} windows x {m['seq_len']} tokens = {m['batch_size'] * m['seq_len']:,} tokens per step |
| steps | {m['steps']:,} (stopped by: {m['stopped_by']}) |
| tokens seen | {m['tokens_seen']:,} ({m['epochs']:.2f} epochs of the training stream) |
| training time | {m['train_seconds'] / 60:.1f} min of training ({m['wall_seconds'] / 60:.1f} min wall in all) on {m['device_desc']} |
| throughput | {m['tokens_per_second']:.0f} tokens/s |

{stop_note}

## Evaluation (saved bf16 weights, fp32 compute)

| | |
|---|---|
| train loss (last {m['loss_window']} steps, mean) | {m['train_loss_running']:.3f} |
| train loss (held-in windows, eval) | {m['train_loss_eval']:.3f} |
| validation loss | {m['val_loss']:.3f} nats/token |
| validation perplexity | {m['val_ppl']:.2f} |
| validation bits per byte | {m['val_bpb']:.3f} |
| uniform baseline | {math.log(m['vocab_size']):.3f} nats/token (ln {m['vocab_size']}) |

Validation covers {m['val_eval_tokens']:,} predicted tokens of the held-back files.

## Samples

{samples}
## Reproduce

```bash
{m['command']}
```

Python {m['python_version']}, torch {m['torch_version']}, transformers {m['transformers_version']},
tokenizers {m['tokenizers_version']}, seed {m['seed']}. All metrics are also in `training_metrics.json`.
"""
    (out_dir / "README.md").write_text(card, encoding="utf-8")


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="leapdecode/assets/default_model")
    p.add_argument("--role", choices=["target", "draft"], default=None,
                   help="card wording; default: draft when --tokenizer-from is given")
    p.add_argument("--tokenizer-from", default=None, help="reuse the tokenizer of this model dir (for a draft)")
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    p.add_argument("--val-every", type=int, default=40, help="hold back files with sha1(path) %% N == 0")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=6)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="stop (and finish the lr decay) after this many minutes of training")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=16, help="val windows for the periodic (not final) eval")
    p.add_argument("--sample-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--procs", type=int, default=1,
                   help="data-parallel processes (gloo); on a busy shared CPU, 2 processes x 1 thread keep both cores "
                        "busier than 1 process x 2 threads")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile the training step (about 1.5x faster on CPU)")
    args = p.parse_args(argv)
    if args.max_steps is None and args.time_budget_min is None:
        p.error("give --max-steps and/or --time-budget-min")
    if args.batch_size % args.procs:
        p.error("--batch-size must be a multiple of --procs")
    if args.role is None:
        args.role = "draft" if args.tokenizer_from else "target"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "README.md", "training_metrics.json", "chat_template.jinja"):
        (out_dir / stale).unlink(missing_ok=True)

    stdlib = Path(args.stdlib)
    train_items, val_items, skipped = collect_corpus(stdlib, args.val_every)
    print(f"corpus: {len(train_items)} train files, {len(val_items)} val files, {len(skipped)} skipped", flush=True)
    write_corpus_files(out_dir, stdlib, train_items, val_items, skipped)

    from transformers import AutoTokenizer

    if args.tokenizer_from:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_from)
    else:
        t0 = time.time()
        tok = train_tokenizer([text for _, text in train_items], args.vocab_size)
        tokenizer = wrap_tokenizer(tok)
        print(f"tokenizer: vocab {len(tokenizer)} trained in {time.time() - t0:.0f}s", flush=True)
    # Written now, so a draft model can be trained against it while this model trains.
    save_tokenizer(tokenizer, out_dir)

    train_stream = encode_stream(tokenizer, train_items)
    val_stream = encode_stream(tokenizer, val_items)
    train_bytes = sum(len(t.encode("utf-8")) for _, t in train_items)
    val_bytes = sum(len(t.encode("utf-8")) for _, t in val_items)
    print(f"tokens: train {len(train_stream):,} ({train_bytes / len(train_stream):.2f} bytes/token), "
          f"val {len(val_stream):,}", flush=True)
    data = {
        "train_stream": train_stream, "val_stream": val_stream, "train_bytes": train_bytes, "val_bytes": val_bytes,
        "n_train_files": len(train_items), "n_val_files": len(val_items), "t_start": t_start,
    }
    if args.procs == 1:
        train_worker(0, args, data, None)
    else:
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(train_worker, args=(args, data, f"file://{tmp}/rendezvous"), nprocs=args.procs, join=True)


def train_worker(rank: int, args, data: dict, init_method: str | None) -> None:
    """Trains on one process; with --procs > 1, data parallel over gloo (each rank its own slice of the batch, the
    gradients averaged every step). Rank 0 saves, evaluates and writes the card."""
    world = args.procs
    dist = None
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    log = print if rank == 0 else (lambda *a, **k: None)
    from transformers import AutoTokenizer

    out_dir = Path(args.out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    train_stream, val_stream = data["train_stream"], data["val_stream"]
    train_bytes, val_bytes, t_start = data["train_bytes"], data["val_bytes"], data["t_start"]
    byte_lens = token_byte_lengths(tokenizer)

    model = build_model(args, len(tokenizer), eot_id).to(device)
    if dist is not None:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel()
    log(f"model: {n_params:,} parameters ({n_params - n_embed:,} non-embedding)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )

    def loss_fn(x):
        logits = model(input_ids=x[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1))

    def train_step(x):
        loss = loss_fn(x)
        loss.backward()
        return loss.detach()

    step_fn = torch.compile(train_step) if args.compile else train_step

    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)
    local_batch = args.batch_size // world
    n_starts = len(train_stream) - args.seq_len - 1
    train_tensor = torch.from_numpy(train_stream.astype(np.int64))
    offsets = torch.arange(args.seq_len + 1)

    def next_batch():
        starts = torch.randint(0, n_starts, (local_batch,), generator=gen)
        return train_tensor[starts[:, None] + offsets].to(device)

    periodic_val = stream_windows(val_stream, args.seq_len, args.eval_windows)
    budget_s = args.time_budget_min * 60 if args.time_budget_min else None
    step, train_seconds, stopped_by = 0, 0.0, "steps"
    losses = []
    model.train()
    t_loop = time.time()
    while True:
        progress = 0.0
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        if budget_s:
            elapsed = train_seconds
            if dist is not None:  # every rank must take the same decision: rank 0's clock rules
                t = torch.tensor([train_seconds], dtype=torch.float64)
                dist.broadcast(t, 0)
                elapsed = t.item()
            progress = max(progress, elapsed / budget_s)
        if progress >= 1.0:
            stopped_by = "steps" if args.max_steps and step >= args.max_steps else "time"
            break
        lr = lr_at(progress, step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.time()
        x = next_batch()
        loss = step_fn(x)
        if dist is not None:
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1).float()])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            loss = flat[-1]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()
        dt = time.time() - t0
        # The first step includes compilation; it is not counted against the training-time budget.
        if step > 0:
            train_seconds += dt
        losses.append(loss_v)
        step += 1
        if step % 20 == 0 or step == 1:
            tps = args.batch_size * args.seq_len * (step - 1) / train_seconds if train_seconds > 0 else 0.0
            log(f"step {step:5d} loss {sum(losses[-20:]) / len(losses[-20:]):.4f} lr {lr:.2e} "
                  f"progress {progress:.3f} train {train_seconds:7.1f}s {tps:6.0f} tok/s", flush=True)
        if args.eval_every and step % args.eval_every == 0 and rank == 0:
            vl, _, _ = evaluate(model, periodic_val, device, args.batch_size)
            print(f"step {step:5d} val_loss({args.eval_windows} windows) {vl:.4f}", flush=True)
    log(f"trained {step} steps in {train_seconds:.0f}s (loop wall {time.time() - t_loop:.0f}s), "
        f"stopped by {stopped_by}", flush=True)
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return

    # ---- save (bf16) and evaluate the saved artifact ----
    # fp32 weights outside the model dir, so a failure below does not lose the training run.
    import tempfile
    backup = Path(tempfile.gettempdir()) / f"leapdecode_{args.role}_{args.seed}_fp32.pt"
    torch.save(model.state_dict(), backup)
    print(f"fp32 weights backed up to {backup}", flush=True)
    save_model(model, tokenizer, out_dir, [eot_id, im_end_id])
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device)
    saved.eval()
    val_windows = stream_windows(val_stream, args.seq_len)
    val_loss, val_tokens, val_bpb = evaluate(saved, val_windows, device, 16, byte_lens)
    # As many windows from the training stream, at evenly spread fixed positions.
    n_train_windows = min(len(val_windows), 128)
    stride = (len(train_stream) - args.seq_len - 1) // n_train_windows
    train_windows = np.stack([train_stream[i * stride: i * stride + args.seq_len + 1]
                              for i in range(n_train_windows)]).astype(np.int64)
    train_eval_loss, _, _ = evaluate(saved, train_windows, device, 16)
    print(f"saved model: val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f} bpb {val_bpb:.3f} "
          f"({val_tokens:,} tokens); train-window loss {train_eval_loss:.4f}", flush=True)

    samples = []
    tok_out = AutoTokenizer.from_pretrained(out_dir)
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok_out.encode(prompt, add_special_tokens=False)], device=device)
        with torch.no_grad():
            out = saved.generate(ids, max_new_tokens=args.sample_new_tokens, max_length=None, do_sample=False,
                                 pad_token_id=eot_id, eos_token_id=eot_id)
        completion = tok_out.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=False)
        samples.append({"prompt": prompt, "completion": completion})
        print(f"--- {prompt!r}\n{prompt}{completion}", flush=True)

    import tokenizers
    import transformers

    loss_window = min(100, len(losses))
    cmd = " ".join(["python", "scripts/train_tiny_model.py"] + [a if " " not in a else repr(a) for a in sys.argv[1:]])
    device_desc = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"CPU ({os.cpu_count()} cores shared with other jobs; {args.procs} process(es) x {args.threads} "
                      "torch thread(s), nice 10)")
    metrics = {
        "role": args.role,
        "params": n_params,
        "params_non_embedding": n_params - n_embed,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_layers": args.num_layers,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.hidden_size // args.num_heads,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": args.max_position_embeddings,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "min_lr_ratio": args.min_lr_ratio,
        "warmup_steps": args.warmup_steps,
        "weight_decay": args.weight_decay,
        "steps": step,
        "stopped_by": stopped_by,
        "tokens_seen": step * args.batch_size * args.seq_len,
        "epochs": step * args.batch_size * args.seq_len / len(train_stream),
        "train_seconds": train_seconds,
        "wall_seconds": time.time() - t_start,
        "tokens_per_second": (step - 1) * args.batch_size * args.seq_len / max(train_seconds, 1e-9),
        "device_desc": device_desc,
        "loss_window": loss_window,
        "train_loss_running": float(np.mean(losses[-loss_window:])),
        "train_loss_eval": train_eval_loss,
        "val_loss": val_loss,
        "val_ppl": math.exp(val_loss),
        "val_bpb": val_bpb,
        "val_eval_tokens": val_tokens,
        "n_train_files": data["n_train_files"],
        "n_val_files": data["n_val_files"],
        "val_every": args.val_every,
        "train_stream_tokens": len(train_stream),
        "val_stream_tokens": len(val_stream),
        "train_bytes": train_bytes,
        "val_bytes": val_bytes,
        "samples": samples,
        "sample_new_tokens": args.sample_new_tokens,
        "command": cmd,
        "seed": args.seed,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
    }
    (out_dir / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_card(out_dir, metrics)
    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    print(f"wrote {out_dir} ({size / 1e6:.2f} MB) in {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
