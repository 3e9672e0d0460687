"""Bad input is a ValueError naming the problem, raised at submission, and the engine keeps serving others."""
import json
import os
import shutil

import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.config import SpeculativeConfig


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=64)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"),
    (dict(seed="x"), "seed"),
    (dict(structured="json"), "structured"),
    # NaN, infinities and values float32 cannot hold would make a NaN distribution inside the step.
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty=1e-300), "repetition_penalty"),
    (dict(top_p=1e-300), "top_p"),
    (dict(min_p=float("nan")), "min_p"),
    # Integers beyond any real bound would overflow inside the step.
    (dict(top_k=2**63), "top_k"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids"),
    (dict(seed=2**64), "seed"),
    (dict(max_tokens=2**63), "max_tokens"),
    (dict(n=True), "n"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt,message", [
    ("", "empty"),
    ([], "empty"),
    (list(range(2, 80)), "max_model_len"),
    ([1, 2, 10_000], "token ids"),
    ([1.5, 2], "token ids"),
    (None, "prompt"),
])
def test_bad_prompts_fail_while_others_carry_on(llm, prompt, message):
    eng = llm.engine
    rid = f"ok-{message}-{len(prompt or [])}"
    eng.add_request(rid, "hello", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    eng.step()                                                     # the good request is in flight
    with pytest.raises(ValueError, match=message):
        eng.add_request("bad", prompt, SamplingParams())
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == [rid] and len(done[0].outputs[0].token_ids) == 6
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_too_many_logprobs_and_duplicate_ids(llm):
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(["x"], SamplingParams(logprobs=100), use_tqdm=False)
    eng = llm.engine
    eng.add_request("dup", "x", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", "y", SamplingParams(max_tokens=2))
    assert eng.abort("dup") and not eng.abort("dup")
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_batch_submission_is_all_or_nothing(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_bad_model_directories(tmp_path, llama_dir):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(empty))
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(llama_dir, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(gpt2))
    noweights = tmp_path / "noweights"
    shutil.copytree(llama_dir, noweights)
    os.remove(noweights / "model.safetensors")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(noweights))
    with pytest.raises(ValueError, match="rope scaling"):
        cfg = json.loads((noweights / "config.json").read_text())
        cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
        shutil.copy(os.path.join(llama_dir, "model.safetensors"), noweights / "model.safetensors")
        (noweights / "config.json").write_text(json.dumps(cfg))
        LLM(str(noweights))


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_model_len=1), "max_model_len"),
    (dict(dtype="int8"), "dtype"),
    (dict(kv_cache_memory="lots"), "kv_cache_memory"),
    (dict(num_kv_blocks=1, max_model_len=64), "max_model_len"),
    (dict(speculative_config={"method": "magic"}), "method"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": -1}), "num_speculative_tokens"),
])
def test_bad_engine_config(llama_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(llama_dir, **kwargs)


def test_speculative_config_accepts_a_dict():
    cfg = SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 3, "n_max": 5})
    assert cfg.method == "ngram" and cfg.num_speculative_tokens == 3 and cfg.options == {"n_max": 5}
    # options may also come as their own dict, beside loose keys (the loose keys win)
    cfg = SpeculativeConfig.from_any({"method": "auto", "options": {"calibrate": False, "decay": 0.5}, "decay": 0.6})
    assert cfg.method == "auto" and cfg.options == {"calibrate": False, "decay": 0.6}
