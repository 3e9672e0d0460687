"""Tiny checkpoints built inside the tests: a byte-level BPE tokenizer trained on the fly and random-weight models
of each supported architecture, saved in Hugging Face format by transformers itself (the independent reference)."""
from __future__ import annotations

import os

import pytest
import torch

CORPUS = [
    "Once upon a time there was a little robot who loved to count numbers.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Ünïcödé text: naïve café, 東京, emoji 🎉 and ∑ symbols.",
    '{"name": "leap", "tags": ["fast", "lossless"], "count": 42}',
    "import os\nfor name in os.listdir('.'):\n    print(name)",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(path: str, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


ARCH_CONFIGS = {
    "llama": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "mistral": ("MistralConfig", dict(sliding_window=24)),
}


def build_model(path: str, arch: str, vocab_size: int, seed: int = 0, **overrides) -> str:
    import transformers

    cls_name, extra = ARCH_CONFIGS[arch]
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
              bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False,
              initializer_range=0.25)   # large init: peaked logits, so greedy ties are vanishingly rare
    kw.update(extra)
    kw.update(overrides)
    config = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Factory: tiny_dir(arch) -> a directory with a random checkpoint and the shared test tokenizer."""
    root = tmp_path_factory.mktemp("ckpt")
    tok_dir = str(root / "tokenizer")
    tok = build_tokenizer(tok_dir)
    cache: dict[tuple, str] = {}

    def make(arch: str = "llama", **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = str(root / f"{arch}-{len(cache)}")
            build_model(path, arch, **{"vocab_size": 384, **overrides})
            tok.save_pretrained(path)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(tiny_dir):
    return tiny_dir("llama")


def pytest_configure(config):
    torch.set_num_threads(min(2, os.cpu_count() or 1))


# -- engine helpers shared by the test files ---------------------------------------------------------------------

def make_llm(path, **kw):
    """An LLM on a test checkpoint, in float32 with a short context unless told otherwise."""
    from leapdecode import LLM
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 256)
    return LLM(path, **kw)


def assert_pool_free(llm):
    """Nothing left behind: every KV block free, no sequence queued or running, no step in flight."""
    engine = llm.engine
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.seqs and not engine.requests


def fail_sampling_of(monkeypatch, request_id: str) -> None:
    """Make sampling raise "sampler exploded" for any batch that holds ``request_id`` (the engine then samples
    each request of that step alone, and only that request fails)."""
    from leapdecode.sampling.sampler import SamplingBatch
    process = SamplingBatch.process

    def faulty_process(self, logits):
        if any(r.seq.request_id == request_id for r in self.rows):
            raise RuntimeError("sampler exploded")
        return process(self, logits)
    monkeypatch.setattr(SamplingBatch, "process", faulty_process)


class OracleDrafter:
    """Drafts the continuation of whichever reference output (from a plain run: ``truth`` maps a prompt to its
    references, one per sample) extends the request's committed tokens, corrupted on purpose: every
    ``wrong_every``-th draft position is wrong (rejections, rollbacks), and with ``tree`` the first branch is a
    wrong sibling, so the accepted path is not a prefix of the slots and its KV must be compacted."""

    def __init__(self, truth: dict[tuple, list[list[int]]], wrong_every: int = 4, tree: bool = False,
                 vocab_size: int = 384):
        self.truth, self.wrong_every, self.tree, self.vocab_size = truth, wrong_every, tree, vocab_size
        self.calls = 0

    def propose(self, requests):
        from leapdecode.spec.drafter import Draft
        V = self.vocab_size
        drafts = []
        for r in requests:
            self.calls += 1
            prompt, out = tuple(r.token_ids[:r.num_prompt_tokens]), list(r.token_ids[r.num_prompt_tokens:])
            cont = next((ref[len(out):] for ref in self.truth.get(prompt, []) if ref[:len(out)] == out), [])
            n = r.max_draft - (1 if self.tree else 0)
            chain = [t if (i + self.calls) % self.wrong_every else (t + 1) % V for i, t in enumerate(cont[:n])]
            if self.tree and chain:
                tokens = [(chain[0] + 2) % V] + chain                         # wrong first child, then the chain
                drafts.append(Draft(tokens, [-1, -1] + list(range(1, len(chain))), score=0.9))
            else:
                drafts.append(Draft(chain, None, score=0.9))
        return drafts

    def observe(self, *args, **kwargs):
        pass

    def finish(self, *args, **kwargs):
        pass
