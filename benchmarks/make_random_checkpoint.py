"""Write a random-weight Hugging Face checkpoint at a real model's shapes, for benchmarks.

    python benchmarks/make_random_checkpoint.py qwen2.5-0.5b                 # -> /tmp/leapdecode-ckpt/qwen2.5-0.5b
    python benchmarks/make_random_checkpoint.py llama-3.2-1b --out DIR --dtype float32

The directory holds what a downloaded model holds: config.json, model.safetensors (sharded with an index past
--max-shard-size), generation_config.json and the real tokenizer files of that family, copied from
/work/shared/models (llama3-tokenizer for the Llama shapes, qwen2.5-tokenizer for Qwen). The weights are random
(transformers' own initialisation, std = initializer_range), so the text is gibberish but every matmul has the
real model's size: good for throughput, useless for quality. Built and saved by transformers itself
(config class + AutoModelForCausalLM.from_config + save_pretrained), so the files are what the loader of any
HF-compatible engine expects.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

TOKENIZERS_ROOT = os.environ.get("LEAPDECODE_SHARED_MODELS", "/work/shared/models")

_LLAMA3_ROPE_1B = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA3_ROPE_8B = {**_LLAMA3_ROPE_1B, "factor": 8.0}

# name -> (config class, tokenizer folder, config kwargs, generation_config.json)
SHAPES: dict[str, tuple[str, str, dict, dict]] = {
    "tiny": ("LlamaConfig", "llama3-tokenizer", dict(
        vocab_size=128256, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={**_LLAMA3_ROPE_1B, "original_max_position_embeddings": 1024},
        bos_token_id=128000, eos_token_id=128001),
        dict(bos_token_id=128000, eos_token_id=128001, do_sample=True, temperature=0.6, top_p=0.9)),
    "llama-3.2-1b": ("LlamaConfig", "llama3-tokenizer", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE_1B, bos_token_id=128000, eos_token_id=128001),
        dict(bos_token_id=128000, eos_token_id=128001, do_sample=True, temperature=0.6, top_p=0.9)),
    "qwen2.5-0.5b": ("Qwen2Config", "qwen2.5-tokenizer", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
        sliding_window=32768, max_window_layers=24, bos_token_id=151643, eos_token_id=151643),
        # Qwen2ForCausalLM always has q/k/v biases (attention_bias is not a Qwen2 config field)
        dict(bos_token_id=151643, eos_token_id=151643, do_sample=False, max_new_tokens=2048)),
    "smollm2-135m": ("LlamaConfig", "smollm2-tokenizer", dict(   # the default model's shape (SmolLM2-135M-Instruct)
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        bos_token_id=1, eos_token_id=2),
        dict(bos_token_id=1, eos_token_id=2, do_sample=False)),
    "llama-3.1-8b": ("LlamaConfig", "llama3-tokenizer", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters=_LLAMA3_ROPE_8B, bos_token_id=128000, eos_token_id=128001),
        dict(bos_token_id=128000, eos_token_id=[128001, 128008, 128009], do_sample=True, temperature=0.6,
             top_p=0.9)),
}


def default_out(shape: str) -> str:
    return os.path.join("/tmp/leapdecode-ckpt", shape)


def _check_out(out: str) -> None:
    """Refuse to write checkpoints into the git repository (they are GBs of random numbers)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_abs = os.path.abspath(out)
    if out_abs == repo or out_abs.startswith(repo + os.sep):
        raise SystemExit(f"refusing to write a checkpoint inside the repository ({out_abs}); pick a path outside it")


def copy_tokenizer(folder: str, out: str) -> list[str]:
    src = os.path.join(TOKENIZERS_ROOT, folder)
    if not os.path.isdir(src):
        raise SystemExit(f"tokenizer folder {src} not found (set LEAPDECODE_SHARED_MODELS to the models root)")
    copied = []
    for name in sorted(os.listdir(src)):
        if name == "SOURCE.md":
            shutil.copyfile(os.path.join(src, name), os.path.join(out, "TOKENIZER_SOURCE.md"))
            continue
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
            copied.append(name)
    return copied


def make_checkpoint(shape: str, out: str | None = None, dtype: str = "bfloat16", seed: int = 0,
                    max_shard_size: str = "2GB", layers: int | None = None, force: bool = False) -> str:
    """Build the random model of ``shape`` and save it to ``out``; returns the directory."""
    import torch
    import transformers

    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    out = out or default_out(shape)
    _check_out(out)
    cls_name, tok_folder, kw, gen = SHAPES[shape]
    kw = dict(kw)
    if layers is not None:
        kw["num_hidden_layers"] = layers
    config = getattr(transformers, cls_name)(**kw)
    config.architectures = [cls_name.replace("Config", "ForCausalLM")]
    if os.path.isfile(os.path.join(out, "config.json")) and not force:
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            old = json.load(f)
        if all(old.get(k) == v for k, v in config.to_diff_dict().items() if k != "transformers_version") \
                and old.get("dtype", old.get("torch_dtype")) == dtype:
            print(f"{out} already holds a {shape} checkpoint in {dtype}; --force to rebuild", file=sys.stderr)
            return out
    os.makedirs(out, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    n_params = sum(p.numel() for p in model.parameters())
    t1 = time.perf_counter()
    model.generation_config = transformers.GenerationConfig(**gen)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    copied = copy_tokenizer(tok_folder, out)
    with open(os.path.join(out, "RANDOM_WEIGHTS.md"), "w", encoding="utf-8") as f:
        f.write(f"# Random weights ({shape})\n\nWritten by leapdecode benchmarks/make_random_checkpoint.py: "
                f"{cls_name}, {n_params / 1e6:.1f}M parameters, {dtype}, seed {seed}, transformers "
                f"{transformers.__version__}. The weights are random: the shapes are real, the text is not.\n"
                f"Tokenizer: {tok_folder} (see TOKENIZER_SOURCE.md).\n")
    print(f"{shape}: {n_params / 1e6:.1f}M params ({dtype}) built in {t1 - t0:.1f}s, saved in "
          f"{time.perf_counter() - t1:.1f}s to {out}; tokenizer files: {', '.join(copied)}", file=sys.stderr)
    del model
    return out


def hf_config(shape: str):
    """The transformers config of ``shape`` (architectures set)."""
    import transformers
    cls_name, _, kw, _ = SHAPES[shape]
    config = getattr(transformers, cls_name)(**kw)
    config.architectures = [cls_name.replace("Config", "ForCausalLM")]
    return config


def make_config_dir(shape: str, out: str, dtype: str = "bfloat16") -> str:
    """A weightless model directory (config, generation config, real tokenizer) for engines that draw random
    weights themselves (leapdecode's ``load_format="dummy"``, transformers' ``from_config``): no gigabytes
    written or read, so a GPU suite can build 8B shapes in seconds."""
    import transformers
    _check_out(out)
    os.makedirs(out, exist_ok=True)
    config = hf_config(shape)
    config.dtype = dtype
    config.save_pretrained(out)
    transformers.GenerationConfig(**SHAPES[shape][3]).save_pretrained(out)
    if os.path.isdir(os.path.join(TOKENIZERS_ROOT, SHAPES[shape][1])):
        copy_tokenizer(SHAPES[shape][1], out)
    else:
        stand_in_tokenizer(out)
    return out


def stand_in_tokenizer(out: str) -> None:
    """Where the family's real tokenizer files are not on the machine (a bare GPU box): a small byte-level BPE
    trained here on a few sentences. Random weights emit ids beyond its vocabulary, which decode to nothing; no
    number the suites measure depends on the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["random weights at a real model's shapes"] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", help="output directory (default /tmp/leapdecode-ckpt/<shape>); never inside the repo")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="dtype of the saved weights (default bfloat16: half the disk; engines may load as fp32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-size", default="2GB", help="shard the safetensors past this size (with an index)")
    ap.add_argument("--layers", type=int, help="override the number of layers (a shallower model, same widths)")
    ap.add_argument("--force", action="store_true", help="rebuild even if OUT already holds this checkpoint")
    args = ap.parse_args(argv)
    print(make_checkpoint(args.shape, args.out, args.dtype, args.seed, args.max_shard_size, args.layers, args.force))


if __name__ == "__main__":
    main()
