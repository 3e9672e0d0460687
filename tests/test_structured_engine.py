"""Structured output through the engine: outputs that finish validate, speculation keeps greedy output identical,
invalid drafts never get through, forced tokens save forward passes, bad specs fail at submission."""
import glob
import json
import os

import jsonschema
import pytest

from conftest import assert_pool_free, fail_sampling_of, make_llm
from leapdecode import LLM, SamplingParams
from leapdecode.spec.drafter import Draft

SUITE = os.path.join(os.path.dirname(__file__), "data", "json_schema_test_suite", "tests", "draft2020-12")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return make_llm(llama_dir, max_num_seqs=256)


def suite_schemas(limit):
    schemas = []
    for path in sorted(glob.glob(os.path.join(SUITE, "*.json"))):
        with open(path) as f:
            for group in json.load(f):
                if isinstance(group["schema"], dict) and "$ref" not in json.dumps(group["schema"]):
                    schemas.append((os.path.basename(path), group["description"], group["schema"]))
    return schemas[:limit]


def test_finished_outputs_validate_for_hundreds_of_schemas(llm):
    backend = llm.engine.structured_backend
    accepted, refused = [], []
    for name, desc, schema in suite_schemas(400):
        try:
            backend.compile(rf(schema))
            accepted.append(schema)
        except ValueError as e:
            refused.append((name, desc, str(e)[:80]))
    assert len(accepted) >= 200, refused[:10]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured=rf(s)) for i, s in enumerate(accepted)]
    outs = llm.generate(["{"] * len(accepted), params, use_tqdm=False)
    finished = 0
    for out, schema in zip(outs, accepted):
        o = out.outputs[0]
        assert o.finish_reason in ("stop", "length", "abort")
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schema)
            finished += 1
    assert finished > len(accepted) // 2
    print(f"\nschemas compiled {len(accepted)}, refused {len(refused)}, outputs finished and valid {finished}")
    assert_pool_free(llm)


@pytest.mark.parametrize("kind,spec,check", [
    ("json_object", {"type": "json_object"}, lambda t: isinstance(json.loads(t), dict)),
    ("regex", {"type": "regex", "regex": r"[a-c]{2,4}-[0-9]{3}"},
     lambda t: __import__("re").fullmatch(r"[a-c]{2,4}-[0-9]{3}", t)),
    ("choice", {"type": "choice", "choice": ["sunny", "rainy", "cloudy"]}, lambda t: t in ("sunny", "rainy", "cloudy")),
    ("grammar", {"type": "grammar", "grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,2}/'},
     lambda t: t in ("yes", "no") or t.startswith("maybe ")),
])
def test_each_kind_holds(llm, kind, spec, check):
    outs = llm.generate(["Answer:"] * 6, [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured=spec)
                                          for i in range(6)], use_tqdm=False)
    for out in outs:
        o = out.outputs[0]
        if kind == "json_object" and o.finish_reason == "length":
            continue
        assert o.finish_reason == "stop" and check(o.text), (kind, o.text)


def test_speculation_and_forced_tokens_keep_greedy_identical(llama_dir, llm):
    prompts = ["a", "person:", "{}", "json please"]
    # The fixed output form (compact, schema key order) is what leaves tokens for the grammar to force; a random
    # model under the default (flexible whitespace) form may also spend its 80 tokens on whitespace.
    p = SamplingParams(temperature=0.0, max_tokens=80,
                       structured={**rf(PERSON), "whitespace": "compact", "key_order": "schema"})
    ref = [o.outputs[0] for o in llm.generate(prompts, p, use_tqdm=False)]
    for o in ref:
        jsonschema.validate(json.loads(o.text), PERSON)
    for method in ["suffix", "recycling"]:
        spec_llm = make_llm(llama_dir, speculative_config={"method": method, "num_speculative_tokens": 4,
                                                            "adaptive": False})
        outs = [o.outputs[0] for o in spec_llm.generate(prompts, p, use_tqdm=False)]
        assert [(o.token_ids, o.text) for o in outs] == [(o.token_ids, o.text) for o in ref]
        eng = spec_llm.engine       # the drafter's own tokens (not only the grammar's forced ones) were accepted
        assert eng.stats["accepted_tokens"] > eng.structured.num_forced_tokens, method
        assert_pool_free(spec_llm)
    # jump-forward: the keys and punctuation the schema fixes were drafted and accepted, not decoded one by one
    eng = make_llm(llama_dir).engine
    steps_before = eng.stats["steps"]
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, p)
    while eng.has_unfinished():
        eng.step()
    tokens = sum(len(o.token_ids) for o in ref)
    assert eng.structured.num_forced_tokens >= 4 * 10
    assert eng.stats["accepted_tokens"] >= eng.structured.num_forced_tokens
    assert eng.stats["steps"] - steps_before < max(len(o.token_ids) for o in ref) + 1 < tokens


class GarbageDrafter:
    """Proposes tokens that the grammar would mostly refuse."""

    calls = 0

    def propose(self, requests):
        self.calls += len(requests)
        return [Draft([5, 9, 300, 17][:r.max_draft]) for r in requests]

    def observe(self, *a, **k):
        pass

    def finish(self, *a, **k):
        pass


def test_invalid_drafts_never_get_through(llama_dir):
    drafter = GarbageDrafter()
    llm = make_llm(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
                                                  "drafter": drafter})
    outs = llm.generate(["x"] * 8, [SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured=rf(PERSON))
                                    for i in range(8)], use_tqdm=False)
    for out in outs:
        o = out.outputs[0]
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), PERSON)
        else:
            assert o.finish_reason == "length"
    assert drafter.calls > 0
    assert_pool_free(llm)


@pytest.mark.parametrize("bad,match", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}}}, "example.com"),
    ({"type": "choice", "choice": []}, "choice"),
    ({"type": "regex", "regex": "(unclosed"}, "regex|unclosed|parse|error"),
    ({"type": "nonsense"}, "type"),
])
def test_bad_specs_fail_at_submission_and_engine_keeps_serving(llm, bad, match):
    eng = llm.engine
    good = f"good-{match}"
    eng.add_request(good, "hello", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with pytest.raises(ValueError, match=match):
        eng.add_request(f"bad-{match}", "hello", SamplingParams(max_tokens=8, structured=bad))
    done = []
    while eng.has_unfinished():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == [good] and len(done[0].outputs[0].token_ids) == 8
    assert_pool_free(llm)


def test_structured_rejects_ignore_eos(llm):
    with pytest.raises(ValueError, match="ignore_eos"):
        llm.generate(["x"], SamplingParams(ignore_eos=True, structured={"type": "json_object"}), use_tqdm=False)


def exact_conditional(path, tokenizer_backend, prompt_ids, spec):
    """P(text | output in grammar) by enumerating every token sequence the grammar's matcher permits (the support)
    and weighting it with transformers' probabilities at temperature 1."""
    import torch
    import transformers
    from leapdecode.structured import allocate_token_bitmask, bitmask_to_bool
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    V = model.config.vocab_size
    matcher = tokenizer_backend.matcher(tokenizer_backend.compile(spec))
    eos = tokenizer_backend.eos_token_ids[0]
    mask = allocate_token_bitmask(1, tokenizer_backend.vocab_size)
    out: dict[str, float] = {}

    def walk(prefix, prob):
        matcher.fill_bitmask(mask, 0)
        allowed = bitmask_to_bool(mask[0], V).nonzero().flatten().tolist()
        with torch.no_grad():
            p = model(torch.tensor([prompt_ids + prefix])).logits[0, -1].softmax(-1)
        for t in allowed:
            if t == eos:
                text = tok.decode(prefix, skip_special_tokens=True)
                out[text] = out.get(text, 0.0) + prob * float(p[t])
            elif matcher.accept(t):
                walk(prefix + [t], prob * float(p[t]))
                matcher.rollback(1)

    tok = transformers.AutoTokenizer.from_pretrained(path)
    walk([], 1.0)
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


def test_grammar_aligned_sampling_approaches_the_conditional(llama_dir, llm):
    spec = {"type": "choice", "choice": ["a", "ab", "ba", "bb"]}
    prompt = "x"
    ids = llm.get_tokenizer().encode(prompt)
    exact = exact_conditional(llama_dir, llm.engine.structured_backend, ids, spec)

    def tv(samples):
        emp = {k: samples.count(k) / len(samples) for k in set(samples)}
        return 0.5 * sum(abs(emp.get(k, 0.0) - exact.get(k, 0.0)) for k in set(emp) | set(exact))

    results = {}
    for aligned in (False, True):
        texts = []
        for rnd in range(16):      # rounds, so ASAp learns from finished samples between them
            params = [SamplingParams(temperature=1.0, seed=1000 * rnd + i, max_tokens=8, structured=spec,
                                     grammar_aligned=aligned) for i in range(40)]
            texts += [o.outputs[0].text for o in llm.generate([prompt] * 40, params, use_tqdm=False)]
        assert set(texts) <= set(spec["choice"])
        results[aligned] = tv(texts[-320:])
    print(f"\nexact {exact}; total variation plain {results[False]:.3f}, ASAp {results[True]:.3f}")
    assert results[True] < 0.1 < 0.5 < results[False]      # measured: ASAp 0.012, plain constrained 0.825


def test_grammar_cache_is_bounded_by_its_configured_size(llama_dir):
    """grammar_cache_size bounds the compiled-grammar cache (least recently used out); outputs stay valid."""
    llm = make_llm(llama_dir, grammar_cache_size=2)
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"],
                "additionalProperties": False} for i in range(4)]
    for schema in schemas:
        out = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=24, structured=rf(schema)),
                           use_tqdm=False)[0].outputs[0]
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
    cache = llm.engine.structured.backend._cache
    assert len(cache) == 2 and llm.engine.structured.backend._cache_size == 2
    with pytest.raises(ValueError, match="grammar_cache_size"):
        make_llm(llama_dir, grammar_cache_size=0)


def test_mask_fill_thread_runs_no_pytorch_op(llama_dir):
    """The grammar's rows are filled in a worker thread while the model runs. A PyTorch op there (the rows were
    indexed there once) gives that thread OpenMP workers of its own, and from then on every step of the process
    waited at its barriers in the kernel (~2.6x slower decoding on 2 cores; leapdecode/native.py,
    release_openmp_threads). Every ATen op the worker runs is recorded, views aside (a numpy view of the bitmask is
    how rows are written): there must be none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    llm = make_llm(llama_dir)
    pool = llm.engine.structured._pool
    submit, ops, fills = pool.submit, [], []

    def traced(fn, *args, **kwargs):
        def run():
            fills.append(1)
            with Record() as mode:
                try:
                    return fn(*args, **kwargs)
                finally:
                    ops.extend(mode.ops)
        return submit(run)

    pool.submit = traced
    # compact schema order: the grammar forces keys and punctuation, so steps carry several rows (drafts)
    p = SamplingParams(temperature=0.0, max_tokens=40,
                       structured={**rf(PERSON), "whitespace": "compact", "key_order": "schema"})
    outs = llm.generate(["a", "person:"], p, use_tqdm=False)
    assert all(o.outputs[0].text.startswith("{") for o in outs)
    assert len(fills) > 10 and llm.engine.structured.num_forced_tokens > 0
    assert ops == [], sorted(set(ops))
    assert_pool_free(llm)


def test_grammar_rows_stay_with_their_request_when_a_fault_splits_the_batch(llama_dir, monkeypatch):
    """When sampling the batch raises, each request is sampled alone (the fault stays with its request): the
    structured requests then get their own mask rows, renumbered (verifier._rows_of), and finish exactly as
    without the faulty request beside them."""
    p = SamplingParams(temperature=0.0, max_tokens=80,
                       structured={**rf(PERSON), "whitespace": "compact", "key_order": "schema"})
    prompts = ["a", "person:", "{}"]
    ref = [o.outputs[0].token_ids for o in make_llm(llama_dir).generate(prompts, p, use_tqdm=False)]
    fail_sampling_of(monkeypatch, "bad")
    llm = make_llm(llama_dir)
    eng = llm.engine
    eng.add_request("bad", "x y", SamplingParams(temperature=0.0, max_tokens=8))
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, p)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert done["bad"].finish_reason == "error"
    assert [done[str(i)].token_ids for i in range(len(prompts))] == ref
    for i in range(len(prompts)):
        jsonschema.validate(json.loads(done[str(i)].text), PERSON)
    assert_pool_free(llm)
