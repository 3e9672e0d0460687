"""The OpenAI-compatible HTTP API: ``build_app(llm, ...)`` returns a FastAPI app serving one model.

    GET  /v1/models             the served model
    POST /v1/completions        text completion (prompt: string, strings, token ids, or lists of token ids)
    POST /v1/chat/completions   chat through the model's own chat template
    GET  /health, /ping         200 while the engine runs, 503 when shutting down or dead
    GET  /metrics               Prometheus text (this app's own registry)
    POST /tokenize, /detokenize vLLM's tokenizer endpoints;  GET /version

This file holds the handlers; errors and middleware are in errors.py, the SSE loop in streaming.py, token and
logprobs formatting in formatting.py, tool calling in tools.py, and request preparation (tokenization, chat
templates, grammar compilation: everything slow) in preprocess.py, which runs it in a worker pool with a deadline so
the engine thread only ever receives token ids and compiled grammars.

Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. Anything a client can send
maps to a 4xx: FastAPI's 422 validation errors become 400 naming the field, engine ValueErrors become 400, a full
wait queue is 503 with Retry-After. A 500 means a bug in the server or engine, never bad input.

A request that loses its client (closed stream or dropped connection) is aborted at once, which frees its KV
blocks; see ``streaming.EventStream`` and ``OpenAIServer.collect``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import os
import signal
import sys
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from leapdecode.decoding.beam_search import BeamSearchParams
from leapdecode.outputs import CompletionOutput, RequestOutput
from leapdecode.sampling_params import SamplingParams
from leapdecode.server.async_engine import (AsyncEngine, EngineUnavailableError, PromptLike, QueueFullError,
                                            RequestHandle)
from leapdecode.server.errors import (CHAT_FIELDS, COMPLETION_FIELDS, APIError, ClientGone, HTTPMetrics,
                                      RequestId, RequestSizeLimit, error_response, install_error_handlers,
                                      invalid_value)
from leapdecode.server.formatting import Formatter, usage
from leapdecode.server.metrics import ServerMetrics
from leapdecode.server.preprocess import PreprocessTimeout, Preprocessor
from leapdecode.server.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, CompletionChoice,
                                        CompletionRequest, CompletionResponse, DetokenizeRequest,
                                        DetokenizeResponse, ErrorResponse, ModelCard, ModelList, SamplingFields,
                                        TokenizeRequest, TokenizeResponse, random_id)
from leapdecode.server.streaming import EventStream, StreamState, stream_events
from leapdecode.server.tools import (ToolStream, assistant_message, fallback_messages, named_structured,
                                     required_structured, template_supports_tools, tools_for_template)

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
# The engine thread releases and retakes the GIL around its torch calls; while a preparation thread is busy in
# Python (a big schema's meta-schema check, a chat template), each retake can wait a whole switch interval (5 ms
# by default), which multiplies the step time (the "convoy effect"). At 0.5 ms a 5,000-property schema compiling
# in the pool leaves the other streams' inter-token gap at its baseline (measured: p99 108 ms -> 35 ms).
GIL_SWITCH_INTERVAL_S = 0.0005
RETRY_AFTER_SECONDS = 1


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServer:
    """State shared by the handlers: the engine bridge, the model's name, auth and formatting helpers."""

    def __init__(self, llm: Any, async_engine: AsyncEngine, served_model_name: str, api_key: str | None,
                 prep: Preprocessor) -> None:
        self.llm = llm
        self.engine = async_engine
        self.served_model_name = served_model_name
        self.model_path = str(llm.engine.cfg.model)
        self.api_key = api_key
        self.max_model_len = llm.engine.max_model_len
        self.vocab_size = llm.engine.vocab_size
        self.sampling_defaults = dict(llm.engine.generation_defaults.sampling)
        self.fmt = Formatter(llm.engine.tokenizer)     # its own tokenizer copy: see formatting.py
        self.prep = prep
        self.metrics = async_engine.metrics

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

    def check_request(self, body: SamplingFields) -> None:
        """Model-dependent ranges (the vocabulary, the context), then fields this server cannot honour."""
        v = self.vocab_size
        if body.top_k is not None and body.top_k > v:
            raise APIError(400, f"top_k must be at most the vocabulary size ({v}), got {body.top_k}",
                           param="top_k", code="invalid_value")
        bad = [t for t in body.stop_token_ids or [] if t >= v]
        if bad:
            raise APIError(400, f"stop_token_ids must be in [0, {v}), got {bad[:5]}", param="stop_token_ids",
                           code="invalid_value")
        bad = [k for k in body.logit_bias or {} if int(k) >= v]
        if bad:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {v}), got {bad[:5]}",
                           param="logit_bias", code="invalid_value")
        if body.min_tokens >= self.max_model_len:
            raise APIError(400, f"min_tokens must be below max_model_len ({self.max_model_len})",
                           param="min_tokens", code="invalid_value")
        if body.use_beam_search:
            logprobs = getattr(body, "logprobs", None)
            for name, given in (("stream", body.stream), ("logprobs", logprobs not in (None, False)),
                                ("stop", bool(body.stop)), ("response_format", body.structured()[0] is not None)):
                if given:
                    raise APIError(400, f"use_beam_search cannot be combined with {name}", param=name,
                                   code="invalid_value")
        unsupported = body.unsupported_fields()
        if unsupported:
            raise APIError(400, f"'{unsupported[0]}' is not supported by this server yet", param=unsupported[0],
                           code="unsupported_parameter")

    def sampling_params(self, body: SamplingFields, fields: dict[str, str], *, max_tokens: int | None,
                        logprobs: int | None, **extra: Any) -> SamplingParams:
        """The model's generation_config defaults, overridden by whatever the request set."""
        try:
            defaults = self.sampling_defaults
            if body.mirostat:                   # Mirostat truncates by itself: the model's top-k/p defaults go
                defaults = {k: v for k, v in defaults.items() if k not in ("top_k", "top_p", "min_p")}
            kw = {**defaults, **body.sampling_kwargs(), "max_tokens": max_tokens,
                  "logprobs": logprobs, **extra}
        except ValueError as exc:              # a guided_* / structured_outputs spec that cannot be read
            raise APIError(400, str(exc), param=str(exc).split(":")[0], code="invalid_value") from None
        try:
            return SamplingParams(**kw)
        except ValueError as exc:
            raise invalid_value(exc, fields, "prompt") from None

    @staticmethod
    def beam_params(body: SamplingFields, params: SamplingParams, width: int) -> BeamSearchParams:
        """use_beam_search: the request's limits as a beam search of ``width`` beams (sampling fields ignored)."""
        try:
            return BeamSearchParams(beam_width=width, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                    length_penalty=body.length_penalty, early_stopping=body.early_stopping,
                                    min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids,
                                    skip_special_tokens=params.skip_special_tokens)
        except ValueError as exc:
            param = getattr(exc, "param", None)
            raise APIError(400, str(exc), param={"beam_width": "n"}.get(param, param), code="invalid_value") from None

    def fit(self, ids: list[int], params: SamplingParams, requested: int | None, truncate: int | None,
            prompt_field: str) -> tuple[list[int], SamplingParams]:
        """Truncate (vLLM's truncate_prompt_tokens), refuse a prompt that leaves no room, and shrink max_tokens
        to what fits in the context (left out: everything that fits)."""
        if truncate is not None:
            keep = self.max_model_len - 1 if truncate == -1 else truncate
            ids = ids[-keep:] if keep < len(ids) else ids
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                                f"is {len(ids)} tokens long (it must leave room for at least one generated token)",
                           param=prompt_field, code="context_length_exceeded")
        room = self.max_model_len - len(ids)
        max_tokens = room if requested is None else min(requested, room)
        if params.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({params.min_tokens}) exceeds the {room} tokens that fit after the "
                                "prompt", param="min_tokens", code="invalid_value")
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        return ids, params

    async def prepare(self, fn: Any, *args: Any, fields: dict[str, str], prompt_field: str, **kw: Any) -> Any:
        """Run a preparation step in the worker pool; its errors become 400s naming the field."""
        try:
            return await self.prep.run(functools.partial(fn, *args, **kw))
        except PreprocessTimeout as exc:
            raise APIError(400, f"{exc}; send a shorter prompt or a simpler schema", param=prompt_field,
                           code="preprocessing_timeout") from None
        except ValueError as exc:
            raise invalid_value(exc, fields, prompt_field) from None

    async def compile_structured(self, params: SamplingParams, body: SamplingFields, fields: dict[str, str]) -> None:
        if params.structured is None:
            return
        field = body.structured()[1] or fields.get("structured", "response_format")
        try:
            await self.prep.run(self.prep.compile, params.structured)
        except PreprocessTimeout as exc:
            raise APIError(400, str(exc), param=field, code="preprocessing_timeout") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=field, code="invalid_value") from None

    def check_prompt_ids(self, ids: list[int], prompt_field: str) -> list[int]:
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}",
                           param=prompt_field, code="invalid_value")
        return ids

    async def submit(self, prompts: list[PromptLike], params: list[SamplingParams], request_ids: list[str],
                     fields: dict[str, str], prompt_field: str) -> RequestHandle:
        try:
            return await self.engine.submit(prompts, params, request_ids)
        except QueueFullError as exc:
            raise APIError(503, f"The server is overloaded: {exc}. Retry later.", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except EngineUnavailableError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        except ValueError as exc:
            raise invalid_value(exc, fields, prompt_field) from None

    async def collect(self, handle: RequestHandle, request: Request) -> list[RequestOutput]:
        """Wait for the final outputs, aborting the request if the client goes away first."""

        handle.replayable = True

        async def consume() -> list[RequestOutput]:
            last: list = []
            async for snap in handle:
                last = snap
            return last

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # Cancelled by the server past its graceful-shutdown time: answer 503 in OpenAI's shape.
            raise APIError(503, "the server is shutting down", code="engine_unavailable") from None
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
            handle.abort()
        if consumer not in done:
            raise ClientGone()
        try:
            snap = consumer.result()
        except EngineUnavailableError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        for out in snap:
            for c in out.outputs:
                if c.finish_reason == "error":
                    raise APIError(500, f"the request failed in the engine: {c.stop_reason}",
                                   code="request_failed")
        return snap

    def _stream(self, body: SamplingFields, handle: RequestHandle, rid: str, created: int, obj: str,
                format_choice: Any, **kw: Any) -> EventStream:
        header = {"id": rid, "object": obj, "created": created, "model": self.served_model_name}
        events = stream_events(handle, header, format_choice, n=body.n, include_usage=body.include_usage,
                               continuous_usage=body.continuous_usage, metrics=self.metrics, **kw)
        return EventStream(events, handle)

    # -- /v1/completions --------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_request(body)
        fields = COMPLETION_FIELDS
        n_out = body.n
        n_gen = body.best_of or body.n
        want_lp = body.logprobs
        if n_gen > n_out and want_lp is None:
            want_lp = 0                          # best_of ranks samples by their cumulative logprob
        prompt_lp = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_lp = max(prompt_lp or 0, body.logprobs)
        base = self.sampling_params(body, fields, max_tokens=body.max_tokens, logprobs=want_lp, n=n_gen,
                                    prompt_logprobs=prompt_lp)
        raw = body.prompts()
        texts = [p for p in raw if isinstance(p, str)]
        try:
            for t in texts:
                self.prep.check_text_size(t, "prompt")
        except ValueError as exc:
            raise invalid_value(exc, fields, "prompt") from None
        if texts:
            encoded = iter(await self.prepare(_encode_all, self.prep, texts, body.add_special_tokens,
                                              fields=fields, prompt_field="prompt"))
        ids_list = [next(encoded) if isinstance(p, str) else self.check_prompt_ids(list(p), "prompt") for p in raw]
        fitted = [self.fit(ids, base, body.max_tokens, body.truncate_prompt_tokens, "prompt") for ids in ids_list]
        if body.use_beam_search:
            fitted = [(ids, self.beam_params(body, p, n_gen)) for ids, p in fitted]
        await self.compile_structured(base, body, fields)
        rid = random_id("cmpl")
        ids = [rid] if len(raw) == 1 else [f"{rid}-{i}" for i in range(len(raw))]
        handle = await self.submit([f[0] for f in fitted], [f[1] for f in fitted], ids, fields, "prompt")
        created = int(time.time())
        # Echo the prompt as sent; a truncated or token-id prompt is echoed as its tokens' text.
        echo_text = [p if isinstance(p, str) and len(f[0]) == len(i) else None
                     for p, f, i in zip(raw, fitted, ids_list)]

        def prefix(out: RequestOutput) -> str:
            i = ids.index(out.request_id)
            return echo_text[i] if echo_text[i] is not None else self.fmt.prompt_text(out)

        if body.stream:
            def choice(c: CompletionOutput, text: str, st: StreamState) -> dict[str, Any]:
                lp = None
                if body.logprobs is not None:
                    lp = self.fmt.completion_logprobs(c, st.tokens, len(c.token_ids), st.offset)
                    st.offset += sum(len(t) for t in lp.tokens)
                    if body.echo and st.tokens == 0 and st.source is not None:
                        lp = self.fmt.echo_logprobs(st.source, body.logprobs, lp)
                return {"text": text, "logprobs": lp.model_dump() if lp is not None else None}

            return self._stream(body, handle, rid, created, "text_completion", choice,
                                prefix=prefix if body.echo else None)
        snap = await self.collect(handle, request)
        choices = []
        for p, out in enumerate(snap):
            head = prefix(out) if body.echo else ""
            outs = out.outputs
            if body.use_beam_search:
                outs = outs[:n_out]                  # hypotheses come best first
            elif n_gen > n_out:
                outs = sorted(outs, key=lambda c: -(c.cumulative_logprob or 0.0))[:n_out]
            plp = self.fmt.prompt_logprobs(out) if body.prompt_logprobs is not None else None
            for i, c in enumerate(outs):
                lp = None
                if body.logprobs is not None:
                    lp = self.fmt.completion_logprobs(c, 0, len(c.token_ids), len(head))
                    if body.echo:
                        lp = self.fmt.echo_logprobs(out, body.logprobs, lp)
                choices.append(CompletionChoice(
                    index=p * n_out + i, text=head + c.text, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, logprobs=lp, prompt_logprobs=plp))
        response = CompletionResponse(id=rid, created=created, model=self.served_model_name, choices=choices,
                                      usage=usage(snap))
        return JSONResponse(response.model_dump(exclude_none=False))

    # -- /v1/chat/completions ---------------------------------------------------------------------------------
    async def render_conversation(self, body: Any, fields: dict[str, str], functions: list[Any],
                                  with_tools: bool) -> list[int]:
        conversation = [m.to_template() for m in body.messages]
        tools = None
        if with_tools and functions:
            if template_supports_tools(self.prep.chat_template):
                tools = tools_for_template(functions)
            else:
                conversation = fallback_messages(conversation, functions)
        total = sum(len(m.get("content") or "") for m in conversation)
        if total > 4096:
            try:
                self.prep.check_text_size("".join(m.get("content") or "" for m in conversation), "messages")
            except ValueError as exc:
                raise invalid_value(exc, fields, "messages") from None
        return await self.prepare(self.prep.render_chat, conversation, fields=fields, prompt_field="messages",
                                  add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message, tools=tools,
                                  template_kwargs=body.chat_template_kwargs,
                                  add_special_tokens=bool(body.add_special_tokens))

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_request(body)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        fields = _chat_fields(body)
        functions = body.function_defs()
        mode = body.tool_choice_name()                 # None, "none", "auto", "required" or a function's name
        legacy = body.functions is not None
        extra: dict[str, Any] = {}
        if mode not in (None, "none", "auto"):
            if body.structured()[0] is not None:
                raise APIError(400, "a forced tool call cannot be combined with another output constraint",
                               param="tool_choice", code="invalid_value")
            if mode == "required":
                extra["structured"] = required_structured(functions, body.parallel_tool_calls is not False)
            else:
                extra["structured"] = named_structured(next(f for f in functions if f.name == mode))
        elif mode == "auto" and body.skip_special_tokens is None:
            extra["skip_special_tokens"] = False       # Mistral's [TOOL_CALLS] is a special token
        params = self.sampling_params(body, fields, max_tokens=body.max_new_tokens, logprobs=top_n, **extra)
        ids = await self.render_conversation(body, fields, functions, mode not in (None, "none"))
        ids, params = self.fit(ids, params, body.max_new_tokens, body.truncate_prompt_tokens, "messages")
        if body.use_beam_search:
            if "structured" in extra:
                raise APIError(400, "use_beam_search cannot be combined with a forced tool call",
                               param="tool_choice", code="invalid_value")
            params = self.beam_params(body, params, body.n)
        elif "structured" in extra:
            try:
                await self.prep.run(self.prep.compile, params.structured)
            except (ValueError, PreprocessTimeout) as exc:
                raise APIError(400, f"the tool's parameters schema cannot be used: {exc}",
                               param="tools" if not legacy else "functions", code="invalid_value") from None
        else:
            await self.compile_structured(params, body, fields)
        rid = random_id("chatcmpl")
        handle = await self.submit([ids], [params], [rid], fields, "messages")
        created = int(time.time())
        names = {f.name for f in functions}
        if body.stream:
            streams: dict[int, ToolStream] = {}

            def choice(c: CompletionOutput, text: str, st: StreamState) -> dict[str, Any]:
                lp = self.fmt.chat_logprobs(c, st.tokens, len(c.token_ids), top_n) if top_n is not None else None
                fields_out: dict[str, Any] = {"logprobs": lp.model_dump() if lp is not None else None}
                if mode in (None, "none"):
                    fields_out["delta"] = {"content": text} if text else {}
                    return fields_out
                ts = streams.setdefault(c.index, ToolStream(mode, names, legacy))
                delta, finish = ts.step(text, c)
                fields_out["delta"] = delta
                if finish is not None:
                    fields_out["finish_reason"] = finish
                return fields_out

            # OpenAI opens every choice with the role, before any content.
            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(body.n)]
            return self._stream(body, handle, rid, created, "chat.completion.chunk", choice, opening=opening)
        snap = await self.collect(handle, request)
        (out,) = snap
        choices = []
        for c in out.outputs:
            message, finish = assistant_message(c, mode, names, legacy)
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish,
                                      stop_reason=c.stop_reason,
                                      logprobs=(self.fmt.chat_logprobs(c, 0, len(c.token_ids), top_n)
                                                if top_n is not None else None)))
        response = ChatCompletionResponse(
            id=rid, created=created, model=self.served_model_name, choices=choices, usage=usage(snap),
            prompt_logprobs=self.fmt.prompt_logprobs(out) if body.prompt_logprobs is not None else None)
        return JSONResponse(response.model_dump())

    # -- vLLM's /tokenize and /detokenize ---------------------------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        fields = {"prompt": "prompt"}
        if body.prompt is not None:
            try:
                self.prep.check_text_size(body.prompt, "prompt")
            except ValueError as exc:
                raise invalid_value(exc, fields, "prompt") from None
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self.prepare(self.prep.encode, body.prompt, add, fields=fields, prompt_field="prompt")
        else:
            functions = [t.function for t in body.tools or []]
            body.add_special_tokens = bool(body.add_special_tokens)
            ids = await self.render_conversation(body, fields, functions, bool(functions))
        strs = (await self.prepare(self.prep.token_strs, ids, fields=fields, prompt_field="prompt")
                if body.return_token_strs else None)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        ids = self.check_prompt_ids(body.tokens, "tokens")
        text = await self.prepare(self.prep.detokenize, ids, fields={}, prompt_field="tokens")
        return DetokenizeResponse(prompt=text)

# -- /v1/models -------------------------------------------------------------------------------------------
    def model_card(self) -> ModelCard:
        return ModelCard(id=self.served_model_name, root=self.model_path, max_model_len=self.max_model_len)


def _encode_all(prep: Preprocessor, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    return [prep.encode(t, add_special_tokens) for t in texts]


def _terminate_self(exc: BaseException) -> None:
    logger.critical("the engine died (%s: %s); stopping the server so that a supervisor restarts it",
                    type(exc).__name__, exc)
    os.kill(os.getpid(), signal.SIGTERM)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("leapdecode")
    except Exception:                  # not installed as a distribution (a source checkout on the path)
        return "0.1.0"


def _chat_fields(body: ChatCompletionRequest) -> dict[str, str]:
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    return {**CHAT_FIELDS, "max_tokens": max_field}


_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}


def build_app(llm: Any, api_key: str | None = None, max_queued_requests: int = 512,
              served_model_name: str | None = None, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              drain_timeout: float = 0.0, prep_workers: int = 2, prep_timeout: float = 30.0,
              gil_switch_interval: float | None = GIL_SWITCH_INTERVAL_S,
              on_engine_failure: Any = None, backend: Any = None) -> FastAPI:
    """A FastAPI app serving ``llm`` (a ``leapdecode.LLM``). The engine thread starts with the app's lifespan
    (or on the first request) and stops at shutdown, aborting whatever is still running after
    ``drain_timeout`` seconds. Request preparation runs in ``prep_workers`` threads, each request under a
    ``prep_timeout`` deadline. While the app runs, Python's GIL switch interval is ``gil_switch_interval``
    (None: left alone); see GIL_SWITCH_INTERVAL_S. If the engine itself dies (a fault of the whole device, not of
    one request), /health answers 503 and ``on_engine_failure(exc)`` is called: ``"exit"`` sends this process
    SIGTERM (a graceful stop, for a supervisor to restart it), a callable is called. ``app.state.async_engine``
    and ``app.state.metrics`` are exposed for tests and embedding. ``backend``: something with AsyncEngine's
    surface to serve instead of ``llm``'s own engine (a ``leapdecode.cluster.ClusterEngine``; ``llm`` is then a
    ``FrontLLM``, the engine's tokenizer and limits without weights)."""
    if on_engine_failure == "exit":
        on_engine_failure = _terminate_self
    if backend is None:
        async_engine = AsyncEngine(llm, max_queued_requests=max_queued_requests, metrics=ServerMetrics(),
                                   on_failure=on_engine_failure)
    else:
        async_engine = backend
    metrics = async_engine.metrics
    name = served_model_name or os.path.basename(os.path.normpath(str(llm.engine.cfg.model)))
    prep = Preprocessor(llm.engine, workers=prep_workers, timeout_s=prep_timeout, max_pending=max_queued_requests)
    server = OpenAIServer(llm, async_engine, name, api_key, prep)
    metrics.watch_caches(llm.engine, server.fmt)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        previous = sys.getswitchinterval()
        if gil_switch_interval is not None:
            sys.setswitchinterval(gil_switch_interval)
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown(drain_timeout)
            prep.shutdown()
            if gil_switch_interval is not None:
                sys.setswitchinterval(previous)

    app = FastAPI(title="leapdecode", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API served by the leapdecode engine")
    app.state.server = server
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(HTTPMetrics, metrics=metrics)
    app.add_middleware(RequestSizeLimit, limit=max_request_bytes)
    app.add_middleware(RequestId)

    install_error_handlers(app, metrics)

    bearer = HTTPBearer(auto_error=False)

    def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        server.check_api_key(credentials)

    @app.get("/health", tags=["server"], responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        detail = async_engine.health() if hasattr(async_engine, "health") else None   # a cluster: per instance
        if not async_engine.accepting:
            if detail is not None:
                return JSONResponse(detail, status_code=503)
            return error_response(503, "engine is not running", code="engine_unavailable")
        return JSONResponse(detail or {"status": "ok"})

    @app.get("/ping", tags=["server"], responses={503: {"model": ErrorResponse}})
    async def ping() -> Response:
        return await health()

    @app.get("/version", tags=["server"])
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.post("/tokenize", response_model=TokenizeResponse, dependencies=[Depends(authorized)], responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await server.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=[Depends(authorized)],
              responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await server.detokenize(body)

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
