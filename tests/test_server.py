"""The OpenAI-compatible server against real clients: a real uvicorn server on 127.0.0.1, the official ``openai``
client, httpx for raw HTTP, and schemathesis fuzzing the app's own OpenAPI schema.

Every server here serves the tiny random-weight Llama from conftest.py, so outputs are gibberish: correctness is
"the same as the offline LLM API for the same greedy request", never "meaningful text".
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from leapdecode import LLM, SamplingParams
from leapdecode.server import build_app

MODEL = "tiny"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The engine thread, the event loop and the clients share two cores; one intra-op thread for the tiny
    model avoids OpenMP oversubscription, which makes small matmuls many times slower on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def serve(app):
    """Run ``app`` under uvicorn in a thread on a free port; stop it (graceful shutdown) on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def tiny_llm(path: str, **kw) -> LLM:
    kw.setdefault("max_model_len", MAX_MODEL_LEN)
    kw.setdefault("num_kv_blocks", 512)
    return LLM(path, **kw)


def wait_idle(app, timeout: float = 20.0) -> None:
    """Wait until the engine thread has nothing in flight (aborts are processed asynchronously)."""
    ae = app.state.async_engine
    deadline = time.time() + timeout
    while (ae.num_in_flight or ae.num_queued or ae._inbox) and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.05)
    assert not ae.num_in_flight, "requests still in flight"


def assert_pool_free(app) -> None:
    bm = app.state.async_engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def offline(llama_dir):
    return tiny_llm(llama_dir)


@pytest.fixture(scope="module")
def srv(llama_dir):
    app = build_app(tiny_llm(llama_dir), served_model_name=MODEL)
    with serve(app) as (url, _):
        yield url, app


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


GREEDY = dict(temperature=0.0)


# -- correctness against the offline API -----------------------------------------------------------------------
def test_models_health_metrics(srv, client):
    url, _ = srv
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    text = httpx.get(url + "/metrics").text
    assert "leapdecode_kv_cache_blocks_free" in text and "leapdecode_time_to_first_token_seconds" in text


@pytest.mark.parametrize("stream", [False, True])
def test_completion_matches_offline(srv, client, offline, stream):
    prompt = "Once upon a time"
    ref = offline.generate(prompt, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)[0]
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        text = "".join(c.text for ch in chunks for c in ch.choices)
        finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        usage = chunks[-1].usage
        assert not chunks[-1].choices and all(ch.usage is None for ch in chunks[:-1])
    else:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY)
        text, finish, usage = r.choices[0].text, [r.choices[0].finish_reason], r.usage
    out = ref.outputs[0]
    assert text == out.text
    assert finish == [out.finish_reason]
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage.completion_tokens == len(out.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_offline(srv, client, offline, stream):
    messages = [{"role": "system", "content": "You count."}, {"role": "user", "content": "The quick brown fox"}]
    ref = offline.chat(messages, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)[0]
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                                     stream=True, stream_options={"include_usage": True}, **GREEDY))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
        finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        usage = chunks[-1].usage
    else:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, **GREEDY)
        assert r.choices[0].message.role == "assistant"
        text, finish, usage = r.choices[0].message.content, [r.choices[0].finish_reason], r.usage
    out = ref.outputs[0]
    assert text == out.text
    assert finish == [out.finish_reason]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), len(out.token_ids))


def test_n_seed_and_stop(srv, client, offline):
    r = client.completions.create(model=MODEL, prompt="The dog", max_tokens=8, n=3, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    again = client.completions.create(model=MODEL, prompt="The dog", max_tokens=8, n=3, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]      # seeded sampling repeats

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=6, **GREEDY)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content   # greedy: identical samples

    # Stop at a piece of the greedy output: both APIs cut at the same place.
    prompt = "import os"
    full = offline.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY),
                            use_tqdm=False)[0].outputs[0].text
    stop = next(full[i:i + 2] for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2]
                and full[i:i + 2].strip())
    ref = offline.generate(prompt, SamplingParams(max_tokens=24, stop=[stop], **GREEDY), use_tqdm=False)[0].outputs[0]
    for stream in (False, True):
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, stop=[stop], **GREEDY)
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.text for ch in chunks for c in ch.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            c = client.completions.create(**kwargs).choices[0]
            text, finish = c.text, c.finish_reason
        assert text == ref.text and finish == "stop" and stop not in text


def test_beam_search_matches_offline(srv, client, offline):
    """vLLM's use_beam_search: the beam width is best_of (else n), the n best hypotheses come back, best first."""
    from leapdecode.decoding.beam_search import BeamSearchParams
    want = offline.beam_search("The dog", BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5))[0]
    r = client.completions.create(model=MODEL, prompt="The dog", max_tokens=8, n=2, best_of=3,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.text for c in r.choices] == [s.text for s in want.sequences[:2]]
    assert [c.index for c in r.choices] == [0, 1]
    ids = offline.apply_chat_template([{"role": "user", "content": "hi"}])
    want = offline.beam_search(ids, BeamSearchParams(beam_width=2, max_tokens=6))[0]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=6, extra_body={"use_beam_search": True})
    assert [c.message.content for c in chat.choices] == [s.text for s in want.sequences]


@pytest.mark.parametrize("extra", [dict(mirostat=2, mirostat_tau=3.0, seed=5), dict(penalty_alpha=0.6, top_k=4),
                                   dict(dola_layers="high", temperature=0.0, repetition_penalty=1.2)])
def test_decoding_strategy_fields_match_offline(srv, client, offline, extra):
    """Mirostat, contrastive search and DoLa through the server: the same text as the offline API."""
    want = offline.generate("The dog", SamplingParams(max_tokens=8, **extra), use_tqdm=False)[0].outputs[0].text
    r = client.completions.create(model=MODEL, prompt="The dog", max_tokens=8, extra_body=extra)
    assert r.choices[0].text == want


def test_logprobs_and_batch_prompts(srv, client, offline):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob, abs=1e-4)   # greedy took the best
        assert tok.bytes and all(0 <= b < 256 for b in tok.bytes)

    c = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=4, logprobs=2, n=2, **GREEDY)
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2, 3]
    assert all(len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs) for ch in c.choices)
    refs = offline.generate(["one", "two"], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    by_index = {ch.index: ch.text for ch in c.choices}
    assert by_index[0] == by_index[1] == refs[0].outputs[0].text
    assert by_index[2] == by_index[3] == refs[1].outputs[0].text
    assert c.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)

    echo = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, echo=True, **GREEDY)
    assert echo.choices[0].text.startswith("abc")


def test_json_schema(srv, client):
    url, _ = srv
    import jsonschema
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "count": {"type": "integer"}},
              "required": ["name", "count"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "give me json"}], max_tokens=64, **GREEDY,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model=MODEL, prompt="{", max_tokens=64, **GREEDY,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":          # a random model may write one long string until max_tokens
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].finish_reason == "length"
    bad = httpx.post(url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


# -- load, disconnects, overload, shutdown ---------------------------------------------------------------------
def test_64_streams_with_disconnects_free_the_pool(srv, offline):
    url, app = srv
    prompts = [f"Once upon a time {i}" for i in range(8)]
    refs = offline.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY), use_tqdm=False)
    finished0 = httpx.get(url + "/metrics").text

    async def one(i: int, http: httpx.AsyncClient) -> tuple[str, str | None, bool]:
        body = {"model": MODEL, "prompt": prompts[i % 8], "max_tokens": 24, "stream": True, "ignore_eos": True,
                **GREEDY}
        leave = i % 5 == 0
        text, finish, events = "", None, 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                ch = json.loads(line[6:])["choices"][0]
                text += ch["text"]
                finish = ch["finish_reason"] or finish
                if leave and events == 2:
                    break                              # hang up mid-stream
        return text, finish, leave

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*(one(i, http) for i in range(64)))

    results = asyncio.run(run())
    for i, (text, finish, left) in enumerate(results):
        if not left:
            assert text == refs[i % 8].outputs[0].text and finish == "length", i
    wait_idle(app)
    assert_pool_free(app)
    text = httpx.get(url + "/metrics").text
    assert metric(text, "leapdecode_kv_cache_blocks_used") == 0
    assert metric(text, "leapdecode_kv_cache_blocks_free") == metric(text, "leapdecode_kv_cache_blocks_total")
    assert metric(text, "leapdecode_num_requests_running") == 0
    assert metric(text, "leapdecode_num_requests_waiting") == 0

    def count(t, reason):
        m = re.search(rf'^leapdecode_request_finished_total\{{finish_reason="{reason}"\}} (\S+)$', t, re.M)
        return float(m.group(1)) if m else 0.0
    new_length = count(text, "length") - count(finished0, "length")
    new_abort = count(text, "abort") - count(finished0, "abort")
    assert new_length + new_abort == 64 and new_length >= 64 - 13 and new_abort >= 1
    # The server still serves.
    assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code \
        == 200


def test_queue_full_gives_503_then_recovers(llama_dir):
    app = build_app(tiny_llm(llama_dir, max_num_seqs=1, max_model_len=512), served_model_name=MODEL,
                    max_queued_requests=1)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with serve(app) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))       # A is running
            with http.stream("POST", "/v1/completions", json=body) as queued:      # B is admitted, waiting
                assert queued.status_code == 200
                r = http.post("/v1/completions", json={**body, "stream": False})
                assert r.status_code == 503
                assert r.headers["retry-after"].isdigit()
                assert r.json()["error"]["code"] == "queue_full"
        # Both streams were closed: their requests are aborted, the queue drains, new work is accepted.
        deadline = time.time() + 20
        while True:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 200
        # A non-streaming client that gives up is noticed (http.disconnect) and its request aborted too.
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**body, "stream": False}, timeout=0.3)
        wait_idle(app)
        assert_pool_free(app)
        assert metric(http.get("/metrics").text, "leapdecode_request_finished_total", '{finish_reason="abort"}') >= 3


def test_graceful_shutdown_finishes_in_flight_streams(llama_dir):
    app = build_app(tiny_llm(llama_dir), served_model_name=MODEL)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 32, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with serve(app) as (url, server):
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
            it = r.iter_lines()
            lines.append(next(line for line in it if line.startswith("data: ")))
            server.should_exit = True                       # shutdown begins while the stream is in flight
            lines += [line for line in it if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    finish = json.loads(lines[-2][6:])["choices"][0]["finish_reason"]
    assert finish == "length" and text
    assert not app.state.async_engine.running                # the engine thread stopped with the app
    assert_pool_free(app)


def test_shutdown_aborts_what_is_left(llama_dir):
    """AsyncEngine.shutdown with no drain time aborts in-flight requests: the client gets an error, the pool
    is empty, and nothing new is accepted."""
    from leapdecode.server.async_engine import AsyncEngine, EngineUnavailableError

    async def run():
        ae = AsyncEngine(tiny_llm(llama_dir), max_queued_requests=4)
        handle = await ae.submit(["Once"], [SamplingParams(max_tokens=100, ignore_eos=True)], ["r1"])
        got = []
        with pytest.raises(EngineUnavailableError):
            async for snap in handle:
                got.append(snap)
                if len(got) == 2:
                    await ae.shutdown()
        with pytest.raises(EngineUnavailableError):
            await ae.submit(["x"], [SamplingParams()], ["r2"])
        return ae

    ae = asyncio.run(run())
    assert ae.engine.block_manager.num_free_blocks == ae.engine.block_manager.num_blocks
    assert not ae.engine.has_unfinished()


def test_engine_thread_starts_as_the_only_openmp_pool(llama_dir, monkeypatch):
    """The thread that starts the engine thread (the one that built the model, in `leapdecode serve`) gives back
    its OpenMP workers first: with two threads holding pools the server decoded ~2.6x slower (native.py)."""
    import leapdecode.server.async_engine as async_engine
    calls = []
    monkeypatch.setattr(async_engine, "release_openmp_threads", lambda: calls.append(threading.get_ident()) or True)
    ae = async_engine.AsyncEngine(tiny_llm(llama_dir))
    assert calls == []
    ae.start()
    assert calls == [threading.get_ident()] and ae.running
    asyncio.run(ae.shutdown())


def test_engine_failure_is_reported_not_hung(llama_dir):
    """If the engine itself breaks (a bug, not bad input), in-flight and new requests get a clear 503 and the
    health check fails, so an orchestrator can restart the server; nothing hangs."""
    llm = tiny_llm(llama_dir)

    def broken_step():
        raise RuntimeError("simulated engine bug")

    llm.engine.step = broken_step
    failures = []
    app = build_app(llm, served_model_name=MODEL, on_engine_failure=failures.append)
    with serve(app) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/v1/completions", json=_cmpl(max_tokens=4))
        assert r.status_code == 503 and "simulated engine bug" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        assert http.post("/v1/completions", json=_cmpl(max_tokens=4)).status_code == 503
    assert [str(e) for e in failures] == ["simulated engine bug"]      # the hook a supervisor setup uses


# -- bad input -------------------------------------------------------------------------------------------------
def _chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


def _cmpl(**kw):
    return {"model": MODEL, "prompt": "hi", **kw}


BAD_REQUESTS = [
    # (path, body (dict, or raw bytes), expected status, expected param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", _cmpl(prompt=5), 400, "prompt"),
    ("/v1/completions", _cmpl(temperature="hot"), 400, "temperature"),
    ("/v1/completions", _cmpl(temperature=3), 400, "temperature"),
    ("/v1/completions", _cmpl(top_p=0), 400, "top_p"),
    ("/v1/completions", _cmpl(frobnicate=True), 400, "frobnicate"),
    ("/v1/completions", _cmpl(max_tokens=-1), 400, "max_tokens"),
    ("/v1/completions", _cmpl(n=10**6), 400, "n"),
    ("/v1/completions", _cmpl(seed=2**70), 400, "seed"),
    ("/v1/completions", _cmpl(logprobs=21), 400, "logprobs"),
    ("/v1/completions", _cmpl(stop=["x"] * 100), 400, "stop"),
    ("/v1/completions", _cmpl(stop=[""]), 400, "stop"),
    ("/v1/completions", _cmpl(prompt=""), 400, "prompt"),
    ("/v1/completions", _cmpl(prompt=[]), 400, "prompt"),
    ("/v1/completions", _cmpl(prompt="hi " * 400), 400, "prompt"),                 # longer than max_model_len
    ("/v1/completions", _cmpl(prompt=[10**6]), 400, "prompt"),                     # not a token id
    ("/v1/completions", _cmpl(min_tokens=50, max_tokens=5), 400, "min_tokens"),
    ("/v1/completions", _cmpl(suffix="x"), 400, "suffix"),
    ("/v1/completions", _cmpl(stream_options={"include_usage": True}), 400, "stream_options"),
    ("/v1/completions", _cmpl(response_format={"type": "yaml"}), 400, "response_format.type"),
    ("/v1/completions", _cmpl(model="gpt-9"), 404, "model"),
    ("/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("/v1/chat/completions", _chat(messages="hi"), 400, "messages"),
    ("/v1/chat/completions", _chat(top_logprobs=2), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                   tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages[0].content"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hi " * 400}]), 400, "messages"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema"),
    ("/v1/chat/completions", _chat(model="nope"), 404, "model"),
]


def test_bad_input_gives_openai_errors(srv):
    url, app = srv
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, body, status, param in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
            if param is not None:
                assert err["param"] == param, (body, err)
        r = http.post("/v1/completions", json=_cmpl(frobnicate=1))
        assert "Unrecognized request argument" in r.json()["error"]["message"]
        assert http.get("/v1/nothing-here").status_code == 404
        assert http.get("/v1/models/gpt-9").status_code == 404
        r = http.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()
        # The server is still fine.
        assert http.post("/v1/completions", json=_cmpl(max_tokens=2)).status_code == 200
    wait_idle(app)
    assert_pool_free(app)


def test_api_key(llama_dir):
    app = build_app(tiny_llm(llama_dir), api_key="s3cret", served_model_name=MODEL, max_request_bytes=4096)
    with serve(app) as (url, _):
        auth = {"Authorization": "Bearer s3cret"}
        r = httpx.post(url + "/v1/completions", json=_cmpl(prompt="x" * 5000), headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(url + "/v1/completions", json=_cmpl(max_tokens=2), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_schemathesis_no_server_errors(llama_dir):
    """Fuzz every operation of the app's own OpenAPI schema, valid and invalid inputs: never a 5xx.
    ``LEAPDECODE_FUZZ_SCALE=N`` multiplies the number of examples (a longer fuzz run outside CI)."""
    import os
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    # Short max_model_len: a fuzzed request can never generate for long.
    app = build_app(tiny_llm(llama_dir, max_model_len=40), served_model_name=MODEL)
    schema = schemathesis.openapi.from_dict(app.openapi())
    with serve(app) as (url, _):
        operations = [result.ok() for result in schema.get_all_operations()]
        scale = int(os.environ.get("LEAPDECODE_FUZZ_SCALE", "1"))
        calls = collections.Counter()
        assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                # 30 examples per POST operation (20 valid, 10 invalid); the GETs have little to vary.
                examples = scale * ((20 if mode == GenerationMode.POSITIVE else 10) if op.method.upper() == "POST" else 5)

                @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def check(case):
                    response = case.call(base_url=url, timeout=60)
                    calls[response.status_code // 100 * 100] += 1
                    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

                try:
                    check()
                except Unsatisfiable:
                    # An operation without parameters or body (GET /health) has no invalid input to make.
                    assert mode == GenerationMode.NEGATIVE, op.label
        print(f"schemathesis: {sum(calls.values())} requests by status class {dict(calls)}")
        wait_idle(app)
        assert_pool_free(app)


def test_error_param_from_invalid_parameter():
    """InvalidParameter's field is used first (mapped to the endpoint's request field); a plain ValueError falls
    back to reading the message."""
    from leapdecode.errors import InvalidParameter
    from leapdecode.server.errors import CHAT_FIELDS, COMPLETION_FIELDS, invalid_value

    with pytest.raises(InvalidParameter) as info:
        SamplingParams(temperature=-1)
    assert info.value.param == "temperature" and isinstance(info.value, ValueError)
    assert invalid_value(info.value, COMPLETION_FIELDS, "prompt").param == "temperature"
    assert invalid_value(InvalidParameter("bad", param="structured"), CHAT_FIELDS, "messages").param \
        == "response_format"
    assert invalid_value(InvalidParameter("too long", param="prompt"), CHAT_FIELDS, "messages").param == "messages"
    assert invalid_value(ValueError("SamplingParams.logprobs must be <= 20"), CHAT_FIELDS, "messages").param \
        == "top_logprobs"
    assert invalid_value(ValueError("prompt is 500 tokens long"), COMPLETION_FIELDS, "prompt").param == "prompt"


def test_server_tokenizer_is_its_own(srv):
    """Formatting on the event loop never shares a tokenizer object with the engine thread (formatting.py)."""
    _, app = srv
    fmt, engine = app.state.server.fmt, app.state.async_engine.engine
    assert fmt.tokenizer is not engine.tokenizer
    assert fmt.tokenizer.backend_tokenizer is not engine.tokenizer.backend_tokenizer
    ids = engine.tokenizer.encode("hello world")
    assert fmt.tokenizer.decode(ids) == engine.tokenizer.decode(ids)
