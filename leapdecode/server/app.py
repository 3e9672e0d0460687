"""The OpenAI-compatible HTTP API: ``build_app(llm, ...)`` returns a FastAPI app serving one model.

    GET  /v1/models             the served model
    POST /v1/completions        text completion (prompt: string, strings, token ids, or lists of token ids)
    POST /v1/chat/completions   chat through the model's own chat template
    GET  /health                200 while the engine runs, 503 when shutting down or dead
    GET  /metrics               Prometheus text (this app's own registry)

This file holds the handlers; errors and middleware are in errors.py, the SSE loop in streaming.py, token and
logprobs formatting in formatting.py.

Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. Anything a client can send
maps to a 4xx: FastAPI's 422 validation errors become 400 naming the field, engine ValueErrors become 400, a full
wait queue is 503 with Retry-After. A 500 means a bug in the server or engine, never bad input.

A request that loses its client (closed stream or dropped connection) is aborted at once, which frees its KV
blocks; see ``streaming.EventStream`` and ``OpenAIServer.collect``.
"""
from __future__ import annotations

import asyncio
import hmac
import os
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from leapdecode.errors import InvalidParameter
from leapdecode.outputs import CompletionOutput, RequestOutput
from leapdecode.sampling_params import SamplingParams
from leapdecode.server.async_engine import (AsyncEngine, EngineUnavailableError, PromptLike, QueueFullError,
                                            RequestHandle)
from leapdecode.server.errors import (CHAT_FIELDS, COMPLETION_FIELDS, APIError, ClientGone, HTTPMetrics,
                                      RequestSizeLimit, error_response, install_error_handlers, invalid_value)
from leapdecode.server.formatting import Formatter, usage
from leapdecode.server.metrics import ServerMetrics
from leapdecode.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                        CompletionChoice, CompletionRequest, CompletionResponse, ErrorResponse,
                                        ModelCard, ModelList, SamplingFields, random_id)
from leapdecode.server.streaming import EventStream, StreamState, stream_events

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
RETRY_AFTER_SECONDS = 1


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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
        self.fmt = Formatter(llm.engine.tokenizer)     # its own tokenizer copy: see formatting.py

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
            raise invalid_value(exc, fields, "prompt") from None

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
            raise invalid_value(exc, fields, prompt_field) from None

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
            raise ClientGone()
        try:
            return consumer.result()
        except EngineUnavailableError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None

    def _stream(self, body: SamplingFields, handle: RequestHandle, rid: str, created: int, obj: str,
                format_choice: Any, **kw: Any) -> EventStream:
        header = {"id": rid, "object": obj, "created": created, "model": self.served_model_name}
        events = stream_events(handle, header, format_choice, n=body.n, include_usage=body.include_usage,
                               continuous_usage=body.continuous_usage, **kw)
        return EventStream(events, handle)

    # -- /v1/completions --------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_supported(body)
        params = self.sampling_params(body, COMPLETION_FIELDS, max_tokens=body.max_tokens, logprobs=body.logprobs)
        prompts: list[PromptLike] = list(body.prompts())
        rid = random_id("cmpl")
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        handle = await self.submit(prompts, params, ids, COMPLETION_FIELDS, "prompt")
        created = int(time.time())
        if body.stream:
            def choice(c: CompletionOutput, text: str, st: StreamState) -> dict[str, Any]:
                lp = None
                if body.logprobs is not None:
                    lp = self.fmt.completion_logprobs(c, st.tokens, len(c.token_ids), st.offset)
                    st.offset += sum(len(t) for t in lp.tokens)
                return {"text": text, "logprobs": lp.model_dump() if lp is not None else None}

            return self._stream(body, handle, rid, created, "text_completion", choice,
                                prefix=self.fmt.prompt_text if body.echo else None)
        snap = await self.collect(handle, request)
        choices = []
        for p, out in enumerate(snap):
            prefix = self.fmt.prompt_text(out) if body.echo else ""
            for c in out.outputs:
                choices.append(CompletionChoice(
                    index=p * body.n + c.index, text=prefix + c.text, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=(self.fmt.completion_logprobs(c, 0, len(c.token_ids), len(prefix))
                              if body.logprobs is not None else None)))
        response = CompletionResponse(id=rid, created=created, model=self.served_model_name, choices=choices,
                                      usage=usage(snap))
        return JSONResponse(response.model_dump())

    # -- /v1/chat/completions ---------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_supported(body)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        fields = _chat_fields(body)
        params = self.sampling_params(body, fields, max_tokens=body.max_new_tokens, logprobs=top_n)
        conversation = [m.to_template() for m in body.messages]
        llm, add_gen = self.llm, body.add_generation_prompt

        def render() -> list[int]:            # runs on the engine thread: the tokenizer is the engine's
            try:
                return llm.apply_chat_template(conversation, add_generation_prompt=add_gen)
            except ValueError:
                raise
            except Exception as exc:          # jinja2 TemplateError and friends: the conversation was refused
                raise InvalidParameter(f"chat template failed on these messages: {exc}", param="prompt") from None

        rid = random_id("chatcmpl")
        handle = await self.submit([render], params, [rid], fields, "messages")
        created = int(time.time())
        if body.stream:
            def choice(c: CompletionOutput, text: str, st: StreamState) -> dict[str, Any]:
                lp = self.fmt.chat_logprobs(c, st.tokens, len(c.token_ids), top_n) if top_n is not None else None
                return {"delta": {"content": text} if text else {},
                        "logprobs": lp.model_dump() if lp is not None else None}

            # OpenAI opens every choice with the role, before any content.
            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(body.n)]
            return self._stream(body, handle, rid, created, "chat.completion.chunk", choice, opening=opening)
        snap = await self.collect(handle, request)
        (out,) = snap
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                              logprobs=(self.fmt.chat_logprobs(c, 0, len(c.token_ids), top_n)
                                        if top_n is not None else None))
                   for c in out.outputs]
        response = ChatCompletionResponse(id=rid, created=created, model=self.served_model_name, choices=choices,
                                          usage=usage(snap))
        return JSONResponse(response.model_dump())

    # -- /v1/models -------------------------------------------------------------------------------------------
    def model_card(self) -> ModelCard:
        return ModelCard(id=self.served_model_name, root=self.model_path, max_model_len=self.max_model_len)


def _chat_fields(body: ChatCompletionRequest) -> dict[str, str]:
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    return {**CHAT_FIELDS, "max_tokens": max_field}


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
    app.add_middleware(HTTPMetrics, metrics=metrics)
    app.add_middleware(RequestSizeLimit, limit=max_request_bytes)

    install_error_handlers(app)

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
