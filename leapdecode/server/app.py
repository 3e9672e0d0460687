"""The OpenAI-compatible HTTP API: ``build_app(llm, ...)`` returns a FastAPI app serving one model.

    GET  /v1/models             the served model
    POST /v1/completions        text completion (prompt: string, strings, token ids, or lists of token ids)
    POST /v1/chat/completions   chat through the model's own chat template
    GET  /health                200 while the engine runs, 503 when shutting down or dead
    GET  /metrics               Prometheus text (this app's own registry)

Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. Anything a client can send
maps to a 4xx: FastAPI's 422 validation errors become 400 naming the field, engine ValueErrors become 400, a full
wait queue is 503 with Retry-After. A 500 means a bug in the server or engine, never bad input.

A request that loses its client (closed stream or dropped connection) is aborted at once, which frees its KV
blocks; see ``_EventStream`` and ``_collect``.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from leapdecode.outputs import CompletionOutput, RequestOutput
from leapdecode.sampling_params import SamplingParams
from leapdecode.server.async_engine import (AsyncEngine, EngineUnavailableError, PromptLike, QueueFullError,
                                            RequestHandle)
from leapdecode.server.metrics import ServerMetrics
from leapdecode.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                        ChoiceLogprobs, CompletionChoice, CompletionLogprobs, CompletionRequest,
                                        CompletionResponse, ErrorResponse, ModelCard, ModelList, SamplingFields,
                                        TokenLogprob, TopLogprob, Usage, random_id)

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
RETRY_AFTER_SECONDS = 1


# -- errors ----------------------------------------------------------------------------------------------------
class APIError(Exception):
    """Raised anywhere in a handler; rendered as OpenAI's error body with this status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _error_type(status)
        self.headers = headers


class _ClientGone(Exception):
    """The client disconnected before its non-streaming answer was ready."""


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type or _error_type(status), "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _param_from_loc(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'; union-member tags are dropped."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(item, int):
            if not parts:
                break
            parts[-1] += f"[{item}]"
        elif isinstance(item, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", item) and item not in _TYPE_TAGS \
                and not item[0].isupper():
            parts.append(item)
        else:
            break
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request body")
    err = errors[0]
    kind, msg, loc = err.get("type", ""), str(err.get("msg", "invalid value")), tuple(err.get("loc", ()))
    param = _param_from_loc(loc)
    ctx = err.get("ctx") or {}
    if kind == "invalid_field":              # a cross-field check (protocol.field_error) naming its field
        inner = ctx.get("param")
        param = f"{param}.{inner}" if param and inner and not inner.startswith(param) else (inner or param)
        return error_response(400, msg, param=param, code="invalid_value")
    if kind == "json_invalid":
        detail = ctx.get("error", msg)
        return error_response(400, f"We could not parse the JSON body of your request: {detail}", code="json_invalid")
    if kind == "extra_forbidden":
        return error_response(400, f"Unrecognized request argument supplied: {param}", param=param,
                              code="unrecognized_argument")
    if kind == "missing" and param is None:
        return error_response(400, "The request body is missing", code="missing_body")
    if kind == "missing":
        return error_response(400, f"Missing required parameter: '{param}'", param=param, code="missing_parameter")
    msg = msg.removeprefix("Value error, ")
    if param is None and kind == "model_attributes_type":
        return error_response(400, "The request body must be a JSON object", code="invalid_body")
    where = f"Invalid value for '{param}': " if param else ""
    return error_response(400, f"{where}{msg}", param=param, code="invalid_value")


# Engine/SamplingParams field -> request field, per endpoint.
_COMPLETION_FIELDS = {"structured": "response_format"}
_CHAT_FIELDS = {"structured": "response_format", "logprobs": "top_logprobs"}


def _param_from_engine_error(message: str, fields: dict[str, str], prompt_field: str) -> str | None:
    m = re.match(r"SamplingParams\.(\w+)", message)
    if m:
        return fields.get(m.group(1), m.group(1))
    low = message.lower()
    if low.startswith("prompt") or "max_model_len" in low or "chat template" in low:
        return prompt_field
    if any(word in low for word in ("structured", "schema", "response_format", "grammar", "json")):
        return "response_format"
    return None


# -- middleware ------------------------------------------------------------------------------------------------
class _RequestSizeLimit:
    """Refuse bodies over ``limit`` bytes before anything reads them (413), so a client cannot make us buffer
    an arbitrarily large body; chunked bodies are counted as they arrive."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                response = error_response(413, f"request body is larger than {self.limit} bytes",
                                          code="request_too_large")
                return await response(scope, receive, send)
        seen = 0

        async def counted_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise APIError(413, f"request body is larger than {self.limit} bytes", code="request_too_large")
            return message

        await self.app(scope, counted_receive, send)


class _HTTPMetrics:
    """Count every HTTP response by route template (bounded label values) and status code."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        recorded = False

        def record(status: int) -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                route = scope.get("route")
                endpoint = getattr(route, "path", None) or "unmatched"
                self.metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                record(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            record(500)
            raise


class _EventStream(StreamingResponse):
    """Server-sent events whose request is aborted whenever the response ends, however it ends: normal end,
    client disconnect (Starlette cancels the body task), send failure, or server shutdown."""

    def __init__(self, events: AsyncIterator[str], handle: RequestHandle) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._handle = handle

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._handle.abort()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


def _stream_error(exc: Exception) -> str:
    """Once a stream has started its status is 200 for good; a late failure becomes an error event."""
    return _sse({"error": {"message": str(exc), "type": "service_unavailable_error", "param": None,
                           "code": "engine_unavailable"}})


@dataclass
class _StreamState:
    """How much of one choice has been sent. Engine text is cumulative (and may hold back a possible stop
    string's first characters), so each event carries text[sent:] and the matching new tokens."""
    text: int = 0
    tokens: int = 0
    offset: int = 0
    done: bool = False

    def advance(self, c: CompletionOutput) -> None:
        self.text, self.tokens, self.done = len(c.text), len(c.token_ids), c.finished


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- the server ------------------------------------------------------------------------------------------------
class OpenAIServer:
    """State shared by the handlers: the engine bridge, the model's name, auth and formatting helpers."""

    def __init__(self, llm: Any, async_engine: AsyncEngine, served_model_name: str, api_key: str | None) -> None:
        self.llm = llm
        self.engine = async_engine
        self.served_model_name = served_model_name
        self.model_path = str(llm.engine.cfg.model)
        self.api_key = api_key
        self.max_model_len = llm.engine.max_model_len
        self.sampling_defaults = dict(llm.engine.generation_defaults.sampling)
        self._token_text: dict[int, str] = {}

    # -- checks -----------------------------------------------------------------------------------------------
    def check_api_key(self, credentials: HTTPAuthorizationCredentials | None) -> None:
        if self.api_key is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.served_model_name, self.model_path):
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.served_model_name}'", param="model", code="model_not_found")

    @staticmethod
    def check_supported(body: SamplingFields) -> None:
        bad = body.unsupported_fields()
        if bad:
            raise APIError(400, f"'{bad[0]}' is not supported by this server yet", param=bad[0],
                           code="unsupported_parameter")

    def sampling_params(self, body: SamplingFields, fields: dict[str, str], *, max_tokens: int | None,
                        logprobs: int | None) -> SamplingParams:
        """The model's generation_config defaults, overridden by whatever the request set."""
        kw = {**self.sampling_defaults, **body.sampling_kwargs(), "max_tokens": max_tokens, "logprobs": logprobs}
        try:
            return SamplingParams(**kw)
        except ValueError as exc:
            raise APIError(400, str(exc), param=_param_from_engine_error(str(exc), fields, "prompt"),
                           code="invalid_value") from None

    async def submit(self, prompts: list[PromptLike], params: SamplingParams, request_ids: list[str],
                     fields: dict[str, str], prompt_field: str) -> RequestHandle:
        try:
            return await self.engine.submit(prompts, [params] * len(prompts), request_ids)
        except QueueFullError as exc:
            raise APIError(503, f"The server is overloaded: {exc}. Retry later.", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except EngineUnavailableError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=_param_from_engine_error(str(exc), fields, prompt_field),
                           code="invalid_value") from None

    async def collect(self, handle: RequestHandle, request: Request) -> list[RequestOutput]:
        """Wait for the final outputs, aborting the request if the client goes away first."""

        async def consume() -> list[RequestOutput]:
            last: list = []
            async for snap in handle:
                last = snap
            return last

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
            handle.abort()
        if consumer not in done:
            raise _ClientGone()
        try:
            return consumer.result()
        except EngineUnavailableError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None

    # -- formatting -------------------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.llm.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's raw bytes. A token that is part of a multi-byte character decodes to U+FFFD on its own,
        so its bytes come from the vocabulary piece: byte-level BPE ("Ġ" = space) or SentencePiece "<0xAB>"."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return list(text.encode())
        piece = self.llm.engine.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            if m:
                return [int(m.group(1), 16)]
            byte_of = _byte_level_decoder()
            if piece and all(ch in byte_of for ch in piece):
                return [byte_of[ch] for ch in piece]
        return list(text.encode())

    def chat_logprobs(self, c: CompletionOutput, start: int, end: int, top_n: int) -> ChoiceLogprobs:
        content = []
        for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_n]
            content.append(TokenLogprob(
                token=self.token_text(token_id), logprob=entry.get(token_id, float("-inf")),
                bytes=self.token_bytes(token_id),
                top_logprobs=[TopLogprob(token=self.token_text(t), logprob=lp, bytes=self.token_bytes(t))
                              for t, lp in ranked]))
        return ChoiceLogprobs(content=content)

    def completion_logprobs(self, c: CompletionOutput, start: int, end: int, offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            text = self.token_text(token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(entry.get(token_id))
            lp.top_logprobs.append({self.token_text(t): v for t, v in
                                    sorted(entry.items(), key=lambda kv: kv[1], reverse=True)})
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.llm.engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    @staticmethod
    def usage(snap: list[RequestOutput | None]) -> Usage:
        prompt = sum(len(o.prompt_token_ids) for o in snap if o is not None)
        completion = sum(len(c.token_ids) for o in snap if o is not None for c in o.outputs)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    # -- /v1/completions --------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_supported(body)
        params = self.sampling_params(body, _COMPLETION_FIELDS, max_tokens=body.max_tokens, logprobs=body.logprobs)
        prompts: list[PromptLike] = list(body.prompts())
        rid = random_id("cmpl")
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        handle = await self.submit(prompts, params, ids, _COMPLETION_FIELDS, "prompt")
        created = int(time.time())
        if body.stream:
            return _EventStream(self._completion_events(body, handle, rid, created), handle)
        snap = await self.collect(handle, request)
        choices = []
        for p, out in enumerate(snap):
            prefix = self.prompt_text(out) if body.echo else ""
            for c in out.outputs:
                choices.append(CompletionChoice(
                    index=p * body.n + c.index, text=prefix + c.text, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=(self.completion_logprobs(c, 0, len(c.token_ids), len(prefix))
                              if body.logprobs is not None else None)))
        response = CompletionResponse(id=rid, created=created, model=self.served_model_name, choices=choices,
                                      usage=self.usage(snap))
        return JSONResponse(response.model_dump())

    async def _completion_events(self, body: CompletionRequest, handle: RequestHandle, rid: str,
                                 created: int) -> AsyncIterator[str]:
        states: dict[int, _StreamState] = {}
        snap: list = []

        def chunk(choices: list[dict], usage: Usage | None = None) -> str:
            payload = {"id": rid, "object": "text_completion", "created": created, "model": self.served_model_name,
                       "choices": choices}
            if body.include_usage:
                payload["usage"] = usage.model_dump() if usage is not None else None
            return _sse(payload)

        try:
            async for snap in handle:
                choices = []
                for p, out in enumerate(snap):
                    for c in (out.outputs if out is not None else []):
                        index = p * body.n + c.index
                        st = states.get(index)
                        prefix = ""
                        if st is None:
                            prefix = self.prompt_text(out) if body.echo else ""
                            st = states[index] = _StreamState(offset=len(prefix))
                        delta = c.text[st.text:]
                        if st.done or not (delta or prefix or c.finished):
                            continue
                        choice: dict[str, Any] = {"index": index, "text": prefix + delta, "logprobs": None,
                                                  "finish_reason": c.finish_reason if c.finished else None}
                        if c.finished:
                            choice["stop_reason"] = c.stop_reason
                        if body.logprobs is not None:
                            lp = self.completion_logprobs(c, st.tokens, len(c.token_ids), st.offset)
                            choice["logprobs"] = lp.model_dump()
                            st.offset += sum(len(t) for t in lp.tokens)
                        st.advance(c)
                        choices.append(choice)
                if choices:
                    yield chunk(choices, self.usage(snap) if body.continuous_usage else None)
            if body.include_usage:
                yield chunk([], self.usage(snap))
        except EngineUnavailableError as exc:
            yield _stream_error(exc)
        yield _SSE_DONE

    # -- /v1/chat/completions ---------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_supported(body)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling_params(body, _chat_fields(body), max_tokens=body.max_new_tokens, logprobs=top_n)
        conversation = [m.to_template() for m in body.messages]
        llm, add_gen = self.llm, body.add_generation_prompt

        def render() -> list[int]:            # runs on the engine thread: the tokenizer is the engine's
            try:
                return llm.apply_chat_template(conversation, add_generation_prompt=add_gen)
            except ValueError:
                raise
            except Exception as exc:          # jinja2 TemplateError and friends: the conversation was refused
                raise ValueError(f"chat template failed on these messages: {exc}") from None

        rid = random_id("chatcmpl")
        handle = await self.submit([render], params, [rid], _chat_fields(body), "messages")
        created = int(time.time())
        if body.stream:
            return _EventStream(self._chat_events(body, handle, rid, created, top_n), handle)
        snap = await self.collect(handle, request)
        (out,) = snap
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                              logprobs=(self.chat_logprobs(c, 0, len(c.token_ids), top_n)
                                        if top_n is not None else None))
                   for c in out.outputs]
        response = ChatCompletionResponse(id=rid, created=created, model=self.served_model_name, choices=choices,
                                          usage=self.usage(snap))
        return JSONResponse(response.model_dump())

    async def _chat_events(self, body: ChatCompletionRequest, handle: RequestHandle, rid: str, created: int,
                           top_n: int | None) -> AsyncIterator[str]:
        states = [_StreamState() for _ in range(body.n)]
        snap: list = []

        def chunk(choices: list[dict], usage: Usage | None = None) -> str:
            payload = {"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": self.served_model_name, "choices": choices}
            if body.include_usage:
                payload["usage"] = usage.model_dump() if usage is not None else None
            return _sse(payload)

        # OpenAI opens every choice with the role, before any content.
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(body.n)])
        try:
            async for snap in handle:
                choices = []
                for c in snap[0].outputs:
                    st = states[c.index]
                    delta = c.text[st.text:]
                    if st.done or not (delta or c.finished):
                        continue
                    choice: dict[str, Any] = {"index": c.index, "delta": {"content": delta} if delta else {},
                                              "logprobs": None,
                                              "finish_reason": c.finish_reason if c.finished else None}
                    if top_n is not None:
                        choice["logprobs"] = self.chat_logprobs(c, st.tokens, len(c.token_ids), top_n).model_dump()
                    if c.finished:
                        choice["stop_reason"] = c.stop_reason
                    st.advance(c)
                    choices.append(choice)
                if choices:
                    yield chunk(choices, self.usage(snap) if body.continuous_usage else None)
            if body.include_usage:
                yield chunk([], self.usage(snap))
        except EngineUnavailableError as exc:
            yield _stream_error(exc)
        yield _SSE_DONE

    # -- /v1/models -------------------------------------------------------------------------------------------
    def model_card(self) -> ModelCard:
        return ModelCard(id=self.served_model_name, root=self.model_path, max_model_len=self.max_model_len)


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable stand-ins for the 256 byte values, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _chat_fields(body: ChatCompletionRequest) -> dict[str, str]:
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    return {**_CHAT_FIELDS, "max_tokens": max_field}


_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}


def build_app(llm: Any, api_key: str | None = None, max_queued_requests: int = 512,
              served_model_name: str | None = None, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              drain_timeout: float = 0.0) -> FastAPI:
    """A FastAPI app serving ``llm`` (a ``leapdecode.LLM``). The engine thread starts with the app's lifespan
    (or on the first request) and stops at shutdown, aborting whatever is still running after
    ``drain_timeout`` seconds. ``app.state.async_engine`` and ``app.state.metrics`` are exposed for tests and
    embedding."""
    metrics = ServerMetrics()
    async_engine = AsyncEngine(llm, max_queued_requests=max_queued_requests, metrics=metrics)
    name = served_model_name or os.path.basename(os.path.normpath(str(llm.engine.cfg.model)))
    server = OpenAIServer(llm, async_engine, name, api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown(drain_timeout)

    app = FastAPI(title="leapdecode", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API served by the leapdecode engine")
    app.state.server = server
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(_HTTPMetrics, metrics=metrics)
    app.add_middleware(_RequestSizeLimit, limit=max_request_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, type=exc.type,
                              headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = f"Unknown path {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}")

    bearer = HTTPBearer(auto_error=False)

    def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        server.check_api_key(credentials)

    @app.get("/health", tags=["server"], responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not async_engine.accepting:
            return error_response(503, "engine is not running", code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", tags=["server"])
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", response_model=ModelList, dependencies=[Depends(authorized)], responses=_ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=[server.model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=[Depends(authorized)],
             responses=_ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        if model_id != server.served_model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return server.model_card()

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=[Depends(authorized)],
              responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=[Depends(authorized)],
              responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    return app
