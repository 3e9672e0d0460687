"""Serving with several engine instances on a local Ray cluster: replicas behind a prefix-aware router, and
prefill/decode disaggregation with KV transfer. Outputs are checked against a single in-process engine (greedy,
token for token); the instances' block pools against leaks; and an instance killed mid-request against hangs."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from leapdecode import LLM, SamplingParams
from test_server import serve

ray = pytest.importorskip("ray")

from leapdecode.cluster.launch import serve_cluster  # noqa: E402

MAX_MODEL_LEN = 256
PROMPTS = [list(range(5, 5 + n)) for n in (7, 16, 33, 50)]      # short, block-aligned, a few blocks, more


@pytest.fixture(scope="module")
def model(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def llm_kwargs(model):
    return {"model": model, "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def reference(llm_kwargs):
    """Greedy completions of a single in-process engine."""
    llm = LLM(**llm_kwargs)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _complete(url: str, prompt: list[int], **extra) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_tokens(url: str, prompt: list[int]) -> tuple[list[str], str | None]:
    """The streamed text pieces and the finish reason (or the error message of an error event)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    pieces, finish = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for event in _events(r):
            if "error" in event:
                return pieces, "error: " + event["error"]["message"]
            choice = event["choices"][0]
            pieces.append(choice["text"])
            finish = choice["finish_reason"] or finish
    return pieces, finish


def _events(response):
    """The JSON events of a server-sent event stream."""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _stats(backend) -> list[dict]:
    return ray.get([inst.actor.stats.remote() for inst in backend.instances])


def _wait_pools_free(backend, timeout: float = 30.0) -> list[dict]:
    deadline = time.time() + timeout
    while True:
        stats = _stats(backend)
        if all(s["free_blocks"] == s["num_blocks"] and not s["unfinished"] for s in stats) or time.time() > deadline:
            return stats
        time.sleep(0.1)


@pytest.fixture(scope="module")
def replicas(ray_cluster, llm_kwargs):
    app, backend = serve_cluster(llm_kwargs, replicas=2, num_threads=1, served_model_name="m",
                                 health_interval=0.2)
    with serve(app) as (url, _):
        yield url, backend


@pytest.fixture(scope="module")
def disagg(ray_cluster, llm_kwargs):
    app, backend = serve_cluster(llm_kwargs, prefill=1, decode=1, num_threads=1, served_model_name="m",
                                 health_interval=0.2)
    with serve(app) as (url, _):
        yield url, backend


# -- replicas ---------------------------------------------------------------------------------------------------
def test_replicas_match_single_engine(replicas, reference):
    url, backend = replicas
    for prompt, (ids, text) in zip(PROMPTS, reference):
        out = _complete(url, prompt)
        assert out["choices"][0]["text"] == text
        assert out["usage"]["completion_tokens"] == len(ids)
    pieces, finish = _stream_tokens(url, PROMPTS[2])
    assert "".join(pieces) == reference[2][1] and finish == "length"
    stats = _wait_pools_free(backend)
    assert all(s["free_blocks"] == s["num_blocks"] for s in stats)


def test_router_sends_a_shared_prefix_to_the_replica_that_holds_it(replicas):
    url, backend = replicas
    shared = list(range(100, 100 + 48))                    # three full blocks
    before = {s["name"]: s["prefix_hit_tokens"] for s in _stats(backend)}
    for tail in ([7], [8], [9]):
        _complete(url, shared + tail, max_tokens=2)
    gained = {s["name"]: s["prefix_hit_tokens"] - before[s["name"]] for s in _stats(backend)}
    # the first request warms one replica; the next two hit it there (48 tokens each), none on the other
    assert sorted(gained.values()) == [0, 96], gained


def test_bad_input_is_a_400_from_the_proxy(replicas):
    url, _ = replicas
    body = {"model": "m", "prompt": list(range(1, 300)), "max_tokens": 4}     # longer than max_model_len
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert _complete(url, PROMPTS[0])["choices"][0]["finish_reason"] == "length"   # nothing else broke


# -- disaggregation ---------------------------------------------------------------------------------------------
def test_disaggregated_matches_single_engine_and_imports_kv(disagg, reference):
    url, backend = disagg
    for prompt, (_, text) in zip(PROMPTS, reference):
        assert _complete(url, prompt)["choices"][0]["text"] == text
    pieces, finish = _stream_tokens(url, PROMPTS[3])
    assert "".join(pieces) == reference[3][1] and finish == "length"
    stats = {s["role"]: s for s in _wait_pools_free(backend)}
    assert stats["prefill"]["free_blocks"] == stats["prefill"]["num_blocks"]
    assert stats["decode"]["free_blocks"] == stats["decode"]["num_blocks"]
    # the decode instance computed only the tails: every full prompt block came from the prefill instance
    bs = 16
    imported = sum((len(p) - 1) // bs * bs for p in PROMPTS) + (len(PROMPTS[3]) - 1) // bs * bs
    assert stats["decode"]["prefix_hit_tokens"] >= imported


def test_health_reports_each_instance(disagg):
    url, _ = disagg
    r = httpx.get(f"{url}/health", timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["layout"] == "disaggregated"
    assert {(i["role"], i["alive"]) for i in body["instances"]} == {("prefill", True), ("decode", True)}


def _wait_healthy(url: str, timeout: float = 120.0) -> dict:
    deadline = time.time() + timeout
    while True:
        h = httpx.get(f"{url}/health", timeout=10)
        if (h.status_code == 200 and h.json()["status"] == "ok") or time.time() > deadline:
            return h.json()
        time.sleep(0.3)


def _instance_pid(backend, role: str = "decode") -> tuple[object, int]:
    inst = next(i for i in backend.instances if i.role == role)
    return inst, ray.get(inst.actor.ping.remote())["pid"]


LONG = {"model": "m", "prompt": PROMPTS[3], "max_tokens": 150, "temperature": 0.0, "ignore_eos": True}


def _slow_down(decode, seconds: float = 0.03) -> None:
    """Every engine step of the instance takes ``seconds`` longer, so a request is still in flight when the test
    kills the process (the restarted instance runs at full speed). The function runs inside the actor; defined
    here, in a function, so that Ray ships it by value."""
    def slow_steps(instance) -> None:
        import time as _time
        step = instance.llm.engine.step

        def slow():
            _time.sleep(seconds)
            return step()
        instance.llm.engine.step = slow
    ray.get(decode.actor.__ray_call__.remote(slow_steps))


def _kill_when_busy(inst, pid: int, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not ray.get(inst.actor.stats.remote())["unfinished"]:
        assert time.time() < deadline, "the request never reached the decode instance"
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)


def test_killed_decode_instance_mid_request_is_retried_from_the_prompt(disagg):
    """A non-streaming client waits only for the answer, so the request restarts on the restarted instance."""
    url, backend = disagg
    decode, pid = _instance_pid(backend)
    _slow_down(decode)
    retries = backend.retries
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=httpx.post(f"{url}/v1/completions", json=LONG,
                                                                          timeout=180)))
    thread.start()
    _kill_when_busy(decode, pid)
    thread.join(180)
    assert not thread.is_alive(), "the request hung"
    r = result["r"]
    assert r.status_code == 200, r.text
    assert backend.retries == retries + 1
    assert _wait_healthy(url)["status"] == "ok"
    assert ray.get(decode.actor.ping.remote())["pid"] != pid
    again = httpx.post(f"{url}/v1/completions", json=LONG, timeout=180).json()
    assert r.json()["choices"][0]["text"] == again["choices"][0]["text"]      # the whole greedy completion


def test_killed_decode_instance_mid_stream_ends_the_stream_with_an_error_and_recovers(disagg, reference):
    """Tokens already streamed cannot be taken back: the client gets an error event, never a hang."""
    url, backend = disagg
    decode, pid = _instance_pid(backend)
    _slow_down(decode)
    pieces, error = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=180) as r:
        for event in _events(r):
            if "error" in event:
                error = event["error"]["message"]
                break
            pieces.append(event["choices"][0]["text"])
            if len(pieces) == 3:
                os.kill(pid, signal.SIGKILL)
    assert error is not None and "failed" in error, (error, len(pieces))
    assert _wait_healthy(url)["status"] == "ok"
    assert _complete(url, PROMPTS[1])["choices"][0]["text"] == reference[1][1]
    stats = {s["role"]: s for s in _wait_pools_free(backend)}
    assert all(s["free_blocks"] == s["num_blocks"] for s in stats.values())


def test_killed_prefill_instance_is_retried_and_a_client_that_leaves_frees_its_blocks(disagg):
    url, backend = disagg
    prefill, pid = _instance_pid(backend, "prefill")
    _slow_down(prefill, seconds=1.0)              # the prompt's one prefill step now lasts a second
    retries = backend.retries
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=httpx.post(f"{url}/v1/completions", json=LONG,
                                                                          timeout=180)))
    thread.start()
    deadline = time.time() + 60
    while not backend.routers["prefill"].in_flight[0]:      # routed: its one (slowed) step is about to run
        assert time.time() < deadline, "the request never reached the prefill instance"
        time.sleep(0.02)
    time.sleep(0.4)
    os.kill(pid, signal.SIGKILL)
    thread.join(180)
    assert not thread.is_alive(), "the request hung"
    assert result["r"].status_code == 200, result["r"].text
    assert backend.retries == retries + 1
    assert _wait_healthy(url)["status"] == "ok"
    # a streaming client that goes away after two chunks: both instances end up with every block free
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        for k, _ in enumerate(_events(r)):
            if k == 1:
                break
    stats = _wait_pools_free(backend)
    assert all(s["free_blocks"] == s["num_blocks"] and not s["unfinished"] for s in stats), stats
