"""No single request can hurt the server: every hostile or malformed input is a 4xx in OpenAI's shape while other
streams carry on and /health stays 200; a request that fails inside the engine fails alone; slow preparation
(tokenization, chat templates) never runs on the engine thread. Real uvicorn server on 127.0.0.1, tiny model."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from leapdecode.server import build_app
from test_server import MODEL, assert_pool_free, metric, one_torch_thread, serve, tiny_llm, wait_idle  # noqa: F401

CONTEXT = 512


@pytest.fixture(scope="module")
def hsrv(llama_dir):
    app = build_app(tiny_llm(llama_dir, max_model_len=CONTEXT), served_model_name=MODEL)
    with serve(app) as (url, _):
        yield url, app


def _cmpl(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def _chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


HOSTILE = [
    # (path, raw JSON body, status, param)
    ("/v1/completions", json.dumps(_cmpl(top_k=2**63)), 400, "top_k"),
    ("/v1/completions", json.dumps(_cmpl(top_k=10**6)), 400, "top_k"),            # beyond the vocabulary
    ("/v1/completions", json.dumps(_cmpl(stop_token_ids=[99999999], min_tokens=2)), 400, "stop_token_ids"),
    ("/v1/completions", json.dumps(_cmpl(stop_token_ids=[2**70])), 400, "stop_token_ids"),
    ("/v1/completions", json.dumps(_cmpl(logit_bias={"99999": 1})), 400, "logit_bias"),
    ("/v1/completions", json.dumps(_cmpl(logit_bias={"abc": 1})), 400, "logit_bias"),
    ("/v1/completions", json.dumps(_cmpl(logit_bias={"5": 101})), 400, "logit_bias"),
    ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800"}', 400, "prompt"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', 400, "model"),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "stop": ["\\udfff"]}', 400, "stop[0]"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
     "messages[0].content"),
    ("/v1/completions", json.dumps(_cmpl(max_tokens="16")), 400, "max_tokens"),       # strict types
    ("/v1/completions", json.dumps(_cmpl(temperature="0.5")), 400, "temperature"),
    ("/v1/completions", json.dumps(_cmpl(stream="true")), 400, "stream"),
    ("/v1/completions", json.dumps(_cmpl(n=True)), 400, "n"),
    ("/v1/completions", json.dumps(_cmpl(n=2.0)), 400, "n"),
    ("/v1/completions", json.dumps(_cmpl(max_tokens=2**63)), 400, "max_tokens"),
    ("/v1/completions", json.dumps(_cmpl(min_tokens=2**40)), 400, "min_tokens"),
    ("/v1/completions", json.dumps(_cmpl(min_tokens=CONTEXT, max_tokens=None)), 400, "min_tokens"),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "temperature": 1e999}', 400, "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "top_p": -Infinity}', 400, "top_p"),
    ("/v1/completions", json.dumps(_cmpl(top_p=1e-300)), 400, "top_p"),                # 0 in float32: NaN
    ("/v1/completions", json.dumps(_cmpl(repetition_penalty=1e-300)), 400, "repetition_penalty"),
    ("/v1/completions", json.dumps(_cmpl(prompt=[5, -1])), 400, "prompt"),
    ("/v1/completions", json.dumps(_cmpl(prompt=[5, 10**6])), 400, "prompt"),
    ("/v1/completions", json.dumps(_cmpl(prompt=[[5], []])), 400, "prompt"),
    ("/v1/completions", json.dumps(_cmpl(prompt=[5] * CONTEXT)), 400, "prompt"),        # no room to generate
    ("/v1/completions", json.dumps(_cmpl(prompt="x" * 15_000_000)), 400, "prompt"),     # refused unread
    ("/v1/completions", json.dumps(_cmpl(prompt_logprobs=21)), 400, "prompt_logprobs"),
    ("/v1/completions", json.dumps(_cmpl(guided_regex="a", guided_choice=["b"])), 400, "guided_choice"),
    ("/v1/completions", json.dumps(_cmpl(guided_json="{not json")), 400, "guided_json"),
    ("/v1/completions", json.dumps(_cmpl(guided_regex="(unclosed")), 400, "guided_regex"),
    ("/v1/completions", json.dumps(_cmpl(best_of=1, n=2)), 400, "best_of"),
    ("/v1/completions", json.dumps(_cmpl(suffix="!")), 400, "suffix"),
    ("/v1/completions", json.dumps(_cmpl(use_beam_search=True, stream=True)), 400, "stream"),
    ("/v1/completions", json.dumps(_cmpl(use_beam_search=True, logprobs=2)), 400, "logprobs"),
    ("/v1/completions", json.dumps(_cmpl(use_beam_search=True, n=100)), 400, "n"),
    ("/v1/chat/completions", json.dumps(_chat(use_beam_search=True, response_format={"type": "json_object"})), 400,
     "response_format"),
    ("/v1/chat/completions", json.dumps(_chat(continue_final_message=True)), 400, "continue_final_message"),
    ("/v1/chat/completions", json.dumps(_chat(chat_template_kwargs={"tools": []})), 400, "chat_template_kwargs"),
    ("/v1/chat/completions", json.dumps(_chat(tool_choice="required")), 400, "tool_choice"),
    ("/v1/chat/completions", json.dumps(_chat(messages=[{"role": "user", "content": "x" * 3_000_000}])), 400,
     "messages"),
    ("/v1/chat/completions", json.dumps(_chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
        tool_choice={"type": "function", "function": {"name": "f"}})), 400, "tools"),
    ("/v1/chat/completions", json.dumps(_chat(tools=[{"type": "function", "function": {"name": "bad name!"}}])), 400,
     "tools[0].function.name"),
    ("/v1/chat/completions", json.dumps(_chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                              tool_choice="required", guided_regex="a")), 400, "tool_choice"),
    ("/tokenize", '{"prompt": "\\ud800"}', 400, "prompt"),
    ("/detokenize", '{"tokens": [-1]}', 400, "tokens[0]"),
    ("/detokenize", json.dumps({"tokens": [10**6]}), 400, "tokens"),
]


def test_hostile_inputs_are_4xx_while_others_stream(hsrv):
    """Every hostile input is a 400 in OpenAI's shape naming its field; a stream running meanwhile completes
    normally, /health stays 200, and the engine is still there afterwards (not a single 5xx)."""
    url, app = hsrv
    stream_result: dict = {}

    def background_stream():
        with httpx.Client(base_url=url, timeout=120) as http:
            body = _cmpl(prompt="Once upon a time", max_tokens=60, min_tokens=60, temperature=0, stream=True)
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        stream_result["lines"] = lines

    t = threading.Thread(target=background_stream)
    t.start()
    with httpx.Client(base_url=url, timeout=60) as http:
        for path, raw, status, param in HOSTILE:
            r = http.post(path, content=raw.encode("utf-8", "surrogatepass"),
                          headers={"content-type": "application/json"})
            assert r.status_code == status, (raw[:200], r.text[:500])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
            assert err["param"] == param, (raw[:200], err)
            assert http.get("/health").status_code == 200
        t.join(120)
        lines = stream_result["lines"]
        assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert http.get("/health").json() == {"status": "ok"}
        assert http.post("/v1/completions", json=_cmpl()).status_code == 200
        text = http.get("/metrics").text
        assert metric(text, "leapdecode_request_failures_total", '{cause="invalid_value"}') >= 10
        assert metric(text, "leapdecode_request_failures_total", '{cause="unsupported_parameter"}') >= 1
    wait_idle(app)
    assert_pool_free(app)


def test_prompt_token_ids_and_default_max_tokens(hsrv):
    """129+ token ids are one prompt; a prompt of max_model_len - 1 tokens is served (max_tokens shrinks to what
    fits), and chat's default max_tokens is what fits in the context."""
    url, app = hsrv
    with httpx.Client(base_url=url, timeout=60) as http:
        for length in (129, 200):
            r = http.post("/v1/completions", json=_cmpl(prompt=[7] * length, max_tokens=3))
            assert r.status_code == 200, r.text
            body = r.json()
            assert len(body["choices"]) == 1 and body["usage"]["prompt_tokens"] == length
        r = http.post("/v1/completions", json=_cmpl(prompt=[7] * (CONTEXT - 1), max_tokens=16))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = http.post("/v1/completions", json=_cmpl(prompt=[[7] * 130, [8] * 3], max_tokens=2))
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        r = http.post("/v1/chat/completions", json={"model": MODEL, "ignore_eos": True, "temperature": 0,
                                                    "messages": [{"role": "user", "content": "hi " * 50}]})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] == CONTEXT
        # max_tokens far beyond the context is not an error: it stops at the context.
        r = http.post("/v1/completions", json=_cmpl(prompt=[7] * (CONTEXT - 3), max_tokens=2**31 - 1,
                                                     ignore_eos=True))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    wait_idle(app)
    assert_pool_free(app)


def test_request_failing_in_the_engine_fails_alone(llama_dir):
    """A request that the engine ends with finish reason "error" (a fault in its own step: the engine's
    per-request isolation) is a 500 `request_failed` (non-streaming) or an error event then [DONE] (streaming);
    a concurrent stream completes, /health stays 200 and the failure is counted."""
    llm = tiny_llm(llama_dir, max_model_len=CONTEXT)
    engine = llm.engine
    original = engine.step
    poison = [3, 3, 3, 3, 3]

    def step():
        outputs = original()
        for out in outputs:
            if out.prompt_token_ids == poison and not out.finished:
                engine.abort(out.request_id)
                out.finished = True
                for c in out.outputs:
                    c.finish_reason, c.stop_reason = "error", "RuntimeError: injected fault"
        return outputs

    engine.step = step
    app = build_app(llm, served_model_name=MODEL)
    with serve(app) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        result: dict = {}

        def other():
            with httpx.Client(base_url=url, timeout=60) as h:
                result["r"] = h.post("/v1/completions", json=_cmpl(prompt="Once", max_tokens=40, min_tokens=40))

        t = threading.Thread(target=other)
        t.start()
        r = http.post("/v1/completions", json=_cmpl(prompt=poison, max_tokens=20))
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
        assert "injected fault" in r.json()["error"]["message"]
        with http.stream("POST", "/v1/completions", json=_cmpl(prompt=poison, max_tokens=20, stream=True)) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "request_failed"
        t.join(60)
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 40
        assert http.get("/health").status_code == 200
        text = http.get("/metrics").text
        assert metric(text, "leapdecode_request_failures_total", '{cause="request_failed"}') == 2
        wait_idle(app)
        assert_pool_free(app)


def hold(prep, method: str, matches):
    """Make ``prep.<method>`` wait (as slow work would) on the calls ``matches`` picks, until released. Returns
    (entered: set once such a call started, release)."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(prep, method)

    def held(*args):
        if matches(*args):
            entered.set()
            assert release.wait(60)
        return real(*args)

    setattr(prep, method, held)
    return entered, release


def test_slow_tokenization_never_stalls_other_streams(llama_dir):
    """Preparation runs in the worker pool, not on the engine thread: while one request's tokenization is held
    (as a huge prompt's would be), another stream runs to its end; the held request then completes. Past the
    preparation deadline a request is a 400 of its own."""
    app = build_app(tiny_llm(llama_dir, max_model_len=CONTEXT), served_model_name=MODEL, prep_timeout=60)
    entered, release = hold(app.state.server.prep, "encode", lambda text, _: text.startswith("HOLD"))
    with serve(app) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        held: dict = {}

        def post_held():
            with httpx.Client(base_url=url, timeout=60) as h:
                held["r"] = h.post("/v1/completions", json=_cmpl(prompt="HOLD this prompt", max_tokens=3))

        t = threading.Thread(target=post_held)
        t.start()
        assert entered.wait(30)
        n_chunks = 0
        body = _cmpl(prompt="Once upon a time", max_tokens=30, min_tokens=30, stream=True)
        with http.stream("POST", "/v1/completions", json=body) as s:
            for line in s.iter_lines():
                n_chunks += line.startswith("data: {")
        assert n_chunks >= 2 and not release.is_set() and "r" not in held   # done while the other is held
        assert http.get("/health").status_code == 200
        release.set()
        t.join(60)
        assert held["r"].status_code == 200
        # The deadline: a preparation that outlives it is refused on its own.
        app.state.server.prep.timeout_s = 0.3
        release.clear()
        r = http.post("/v1/completions", json=_cmpl(prompt="HOLD again"))
        assert r.status_code == 400 and r.json()["error"]["code"] == "preprocessing_timeout"
        release.set()
        assert http.post("/v1/completions", json=_cmpl()).status_code == 200
        wait_idle(app)
        assert_pool_free(app)


def test_slow_grammar_compile_never_stalls_other_streams(llama_dir):
    """Grammar compilation runs in the worker pool: while one request's schema is being compiled (held here, as
    a huge or pathological schema would be), another stream runs to its end and /health answers."""
    app = build_app(tiny_llm(llama_dir, max_model_len=CONTEXT), served_model_name=MODEL)
    entered, release = hold(app.state.server.prep, "compile", lambda structured: "held" in json.dumps(structured))
    schema = {"type": "object", "properties": {"held": {"enum": [1, 2]}}, "required": ["held"],
              "additionalProperties": False}
    with serve(app) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        held: dict = {}

        def post_held():
            with httpx.Client(base_url=url, timeout=60) as h:
                held["r"] = h.post("/v1/chat/completions", json=_chat(guided_json=schema, max_tokens=80))

        t = threading.Thread(target=post_held)
        t.start()
        assert entered.wait(30)
        body = _cmpl(prompt="Once upon a time", max_tokens=30, min_tokens=30, stream=True)
        with http.stream("POST", "/v1/completions", json=body) as s:
            n_chunks = sum(line.startswith("data: {") for line in s.iter_lines())
        assert n_chunks >= 2 and not release.is_set() and "r" not in held
        assert http.get("/health").status_code == 200
        release.set()
        t.join(60)
        assert held["r"].status_code == 200
        assert json.loads(held["r"].json()["choices"][0]["message"]["content"])["held"] in (1, 2)
        wait_idle(app)
        assert_pool_free(app)


def test_preparation_queue_is_bounded(llama_dir):
    """Requests being prepared count against max_queued_requests like those waiting for the engine: past it, a
    503 with Retry-After at once."""
    app = build_app(tiny_llm(llama_dir, max_model_len=CONTEXT), served_model_name=MODEL, max_queued_requests=1)
    entered, release = hold(app.state.server.prep, "encode", lambda text, _: text.startswith("HOLD"))
    with serve(app) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        held: dict = {}
        t = threading.Thread(target=lambda: held.update(r=httpx.post(url + "/v1/completions", timeout=60,
                                                                     json=_cmpl(prompt="HOLD"))))
        t.start()
        assert entered.wait(30)
        r = http.post("/v1/completions", json=_cmpl())
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
        release.set()
        t.join(60)
        assert held["r"].status_code == 200
        assert http.post("/v1/completions", json=_cmpl()).status_code == 200


def test_engine_thread_never_tokenizes(hsrv):
    """The engine receives token ids only: its tokenizer's encode is never called by a served request."""
    url, app = hsrv
    engine = app.state.async_engine.engine
    calls = []
    real = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.post("/v1/completions", json=_cmpl(prompt=["a", "b"])).status_code == 200
            assert http.post("/v1/chat/completions", json=_chat()).status_code == 200
            assert http.post("/v1/chat/completions", json=_chat(guided_choice=["yes", "no"])).status_code == 200
    finally:
        del engine.tokenizer.encode
    assert calls == []


def test_request_id_ping_version_metrics(hsrv):
    import sys

    from leapdecode.server.app import GIL_SWITCH_INTERVAL_S
    url, _ = hsrv
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)      # while a server runs
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/v1/completions", json=_cmpl(), headers={"X-Request-Id": "abc-123"})
        assert r.headers["x-request-id"] == "abc-123"
        r = http.post("/v1/completions", json=_cmpl(top_k=2**63), headers={"X-Request-Id": "bad-1"})
        assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"
        assert len(http.get("/health").headers["x-request-id"]) == 32       # generated when not sent
        assert http.get("/ping").status_code == 200
        assert http.get("/version").json()["version"]
        text = http.get("/metrics").text
        assert metric(text, "leapdecode_cache_capacity", '{cache="token_text"}') > 0
        assert metric(text, "leapdecode_cache_entries", '{cache="token_text"}') >= 0


# -- vLLM's extras, each checked against its documented meaning ---------------------------------------------------
@pytest.fixture(scope="module")
def offline_ctx(llama_dir):
    return tiny_llm(llama_dir, max_model_len=CONTEXT)


def test_guided_decoding_fields(hsrv):
    import re

    import jsonschema
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    with httpx.Client(base_url=hsrv[0], timeout=60) as http:
        for seed in range(3):
            base = {"max_tokens": 40, "seed": seed, "temperature": 1.0}
            r = http.post("/v1/completions", json=_cmpl(guided_choice=["yes", "no"], **base)).json()
            assert r["choices"][0]["text"] in ("yes", "no")
            r = http.post("/v1/completions", json=_cmpl(guided_regex="[ab]{3}-[0-9]", **base)).json()
            assert re.fullmatch("[ab]{3}-[0-9]", r["choices"][0]["text"])
            for guided in (schema, json.dumps(schema)):
                r = http.post("/v1/chat/completions", json=_chat(guided_json=guided, **base)).json()
                jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)
            r = http.post("/v1/completions", json=_cmpl(structured_outputs={"choice": ["up", "down"]}, **base))
            assert r.json()["choices"][0]["text"] in ("up", "down")
            r = http.post("/v1/completions", json=_cmpl(structured_outputs={"json": schema}, **base)).json()
            jsonschema.validate(json.loads(r["choices"][0]["text"]), schema)
            grammar = 'start: "yes" | "no" | "maybe"'
            r = http.post("/v1/completions", json=_cmpl(guided_grammar=grammar, **base)).json()
            assert r["choices"][0]["text"] in ("yes", "no", "maybe")
            r = http.post("/v1/completions", json=_cmpl(structured_outputs={"regex": "[0-9]{2}"}, **base)).json()
            assert re.fullmatch("[0-9]{2}", r["choices"][0]["text"])


def test_prompt_logprobs_and_echo_with_logprobs(hsrv, offline_ctx):
    from leapdecode import SamplingParams
    prompt = "def add(a, b):"
    ref = offline_ctx.generate(prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))[0]
    with httpx.Client(base_url=hsrv[0], timeout=60) as http:
        body = http.post("/v1/completions", json=_cmpl(prompt=prompt, max_tokens=3, temperature=0,
                                                       prompt_logprobs=2)).json()
        plp = body["choices"][0]["prompt_logprobs"]
        assert len(plp) == body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids) and plp[0] is None
        for pos, (entry, want) in enumerate(zip(plp[1:], ref.prompt_logprobs[1:]), start=1):
            token = str(ref.prompt_token_ids[pos])
            assert token in entry and entry[token]["logprob"] == pytest.approx(want[int(token)], abs=1e-4)
            assert all(v["rank"] >= 1 and isinstance(v["decoded_token"], str) for v in entry.values())
        chat = http.post("/v1/chat/completions", json=_chat(prompt_logprobs=1)).json()
        assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
        # echo + logprobs: the prompt's tokens first (the first without a logprob), then the generated ones.
        body = http.post("/v1/completions", json=_cmpl(prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                                       logprobs=1)).json()
        choice, u = body["choices"][0], body["usage"]
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        assert len(lp["tokens"]) == u["prompt_tokens"] + u["completion_tokens"]
        assert lp["token_logprobs"][0] is None and all(v is not None for v in lp["token_logprobs"][1:])
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == sorted(lp["text_offset"])
        # The same, streamed: the first event carries the prompt and its logprobs.
        body = _cmpl(prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True)
        with http.stream("POST", "/v1/completions", json=body) as s:
            events = [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]
        streamed = {k: sum((e["logprobs"][k] for e in events if e["logprobs"]), []) for k in lp}
        assert "".join(e["text"] for e in events) == choice["text"]
        assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
        assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-5)


def test_best_of_returns_the_most_likely_samples(hsrv, offline_ctx):
    from leapdecode import SamplingParams
    ref = offline_ctx.generate("Once upon", SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11,
                                                           logprobs=0))[0]
    best = max(ref.outputs, key=lambda c: c.cumulative_logprob)
    with httpx.Client(base_url=hsrv[0], timeout=60) as http:
        body = http.post("/v1/completions", json=_cmpl(prompt="Once upon", n=1, best_of=4, max_tokens=6,
                                                       temperature=1.0, seed=11)).json()
        assert [c["text"] for c in body["choices"]] == [best.text] and body["choices"][0]["logprobs"] is None
        body = http.post("/v1/completions", json=_cmpl(prompt="Once upon", n=2, best_of=4, max_tokens=6,
                                                       temperature=1.0, seed=11)).json()
        ranked = sorted(ref.outputs, key=lambda c: -c.cumulative_logprob)
        assert [c["text"] for c in body["choices"]] == [c.text for c in ranked[:2]]
        assert [c["index"] for c in body["choices"]] == [0, 1]
        r = http.post("/v1/completions", json=_cmpl(n=1, best_of=2, stream=True))
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_prompt_shaping_fields(hsrv):
    with httpx.Client(base_url=hsrv[0], timeout=60) as http:
        ids = http.post("/tokenize", json={"prompt": "hello world " * 10}).json()
        assert ids["count"] == len(ids["tokens"]) > 5 and ids["max_model_len"] == CONTEXT
        strs = http.post("/tokenize", json={"prompt": "hello", "return_token_strs": True}).json()["token_strs"]
        assert len(strs) == len(http.post("/tokenize", json={"prompt": "hello"}).json()["tokens"])
        assert http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "hello world " * 10
        # truncate_prompt_tokens keeps the last k tokens.
        r = http.post("/v1/completions", json=_cmpl(prompt="hello world " * 10, truncate_prompt_tokens=5,
                                                     echo=True)).json()
        assert r["usage"]["prompt_tokens"] == 5
        tail = http.post("/detokenize", json={"tokens": ids["tokens"][-5:]}).json()["prompt"]
        assert r["choices"][0]["text"].startswith(tail)
        # continue_final_message: the last assistant message is left open for the model to continue.
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
        ids = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False,
                                           "continue_final_message": True}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text.endswith("The answer is")
        r = http.post("/v1/chat/completions", json=_chat(messages=msgs, add_generation_prompt=False,
                                                         continue_final_message=True, priority=5))
        assert r.status_code == 200, r.text
        # add_special_tokens on chat: off by default (the template has its own), as vLLM.
        plain = http.post("/tokenize", json={"messages": msgs[:1]}).json()["tokens"]
        assert http.post("/v1/chat/completions", json=_chat(messages=msgs[:1])).json()["usage"][
            "prompt_tokens"] == len(plain)


def test_shutdown_past_the_drain_time_ends_requests_properly(llama_dir):
    """Past uvicorn's graceful-shutdown time, a stream still running ends with an error event and [DONE], and a
    non-streaming request gets a 503 in OpenAI's shape (not a cut connection or a plain-text 500)."""
    import socket

    import uvicorn
    app = build_app(tiny_llm(llama_dir, max_model_len=CONTEXT), served_model_name=MODEL)
    engine = app.state.async_engine.engine
    original = engine.step

    def slow_step():                      # slow enough that nothing finishes within the graceful time
        time.sleep(0.05)
        return original()

    engine.step = slow_step
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    plain: dict = {}

    def post_plain():
        with httpx.Client(base_url=url, timeout=60) as h:
            plain["r"] = h.post("/v1/completions", json=_cmpl(max_tokens=200, ignore_eos=True))

    t = threading.Thread(target=post_plain)
    t.start()
    lines = []
    body = _cmpl(prompt="Once", max_tokens=200, ignore_eos=True, stream=True)
    with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
        it = r.iter_lines()
        lines.append(next(line for line in it if line.startswith("data: ")))
        server.should_exit = True
        lines += [line for line in it if line.startswith("data: ")]
    t.join(60)
    thread.join(30)
    sock.close()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "engine_unavailable"
    r = plain["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert_pool_free(app)
