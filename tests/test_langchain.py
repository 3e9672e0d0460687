"""LangChain's OpenAI chat model against a real leapdecode server: ``bind_tools`` (named and "any" tool choice,
invoke and stream) and ``with_structured_output`` with each of its three methods (function_calling, json_schema,
json_mode). The tiny random model says nothing meaningful, so what is checked is the protocol: LangChain parses
what the server sends into tool calls and structured results that validate against the schemas."""
from __future__ import annotations

import json

import jsonschema
import pytest

from leapdecode.server import build_app
from test_server import MODEL, one_torch_thread, serve, tiny_llm  # noqa: F401

langchain_openai = pytest.importorskip("langchain_openai")

WEATHER = {"title": "get_weather", "description": "Weather forecast for a city",
           "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
CHOICE = {"title": "verdict", "description": "A verdict",
          "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
SCHEMA_KEYS = ("properties", "required", "additionalProperties", "type")


def _schema(s):
    return {k: s[k] for k in SCHEMA_KEYS}


@pytest.fixture(scope="module")
def chat(llama_dir):
    app = build_app(tiny_llm(llama_dir, max_model_len=2048), served_model_name=MODEL)
    with serve(app) as (url, _):
        yield langchain_openai.ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", max_retries=0,
                                          timeout=120, temperature=0.0, max_tokens=96)


@pytest.mark.parametrize("choice", ["get_weather", "any"])
def test_bind_tools_invoke(chat, choice):
    # one call: the random model would otherwise keep adding calls until max_tokens (a real one stops)
    msg = chat.bind_tools([WEATHER], tool_choice=choice, parallel_tool_calls=False).invoke(
        "Weather in Rome for two days?")
    assert len(msg.tool_calls) >= 1
    for call in msg.tool_calls:
        assert call["name"] == "get_weather" and call["id"]
        jsonschema.validate(call["args"], _schema(WEATHER))


def test_bind_tools_stream_chunks_add_up_to_a_valid_call(chat):
    total = None
    n = 0
    for chunk in chat.bind_tools([WEATHER], tool_choice="get_weather").stream("Weather in Paris?"):
        total = chunk if total is None else total + chunk
        n += 1
    assert n > 2                                        # streamed in pieces, not one message
    assert len(total.tool_calls) == 1
    jsonschema.validate(total.tool_calls[0]["args"], _schema(WEATHER))


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output(chat, method):
    out = chat.with_structured_output(CHOICE, method=method).invoke("Is the sky blue?")
    jsonschema.validate(out, _schema(CHOICE))


def test_with_structured_output_json_mode(chat, llama_dir):
    """json_mode asks for a JSON object (response_format json_object) and parses it: whatever object the model
    writes must come back parsed. A logit_bias towards the tokens of ``{"ok": true}`` makes the random model write
    a short object instead of a thousand tokens of random strings."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(llama_dir)
    bias = {str(t): 30 for t in tok.encode('{"ok": true}', add_special_tokens=False)}
    model = chat.model_copy(update={"model_kwargs": {"logit_bias": bias}})
    r = model.with_structured_output(CHOICE, method="json_mode", include_raw=True).invoke(
        "Answer in JSON: is the sky blue?")
    raw = r["raw"].content
    assert r["parsing_error"] is None, raw
    assert isinstance(r["parsed"], dict) and r["parsed"] == json.loads(raw)
