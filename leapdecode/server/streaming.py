"""Server-sent events for both endpoints: one generic loop (``stream_events``) that turns a request's cumulative
engine outputs into OpenAI chunks. Each endpoint supplies only how a choice's new text (and logprobs) is written.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from leapdecode.outputs import CompletionOutput, RequestOutput
from leapdecode.server.async_engine import EngineUnavailableError, RequestHandle
from leapdecode.server.formatting import usage

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def stream_error(exc: Exception, type: str = "service_unavailable_error", code: str = "engine_unavailable") -> str:
    """Once a stream has started its status is 200 for good; a late failure becomes an error event."""
    return sse({"error": {"message": str(exc), "type": type, "param": None, "code": code}})


class EventStream(StreamingResponse):
    """Server-sent events whose request is aborted whenever the response ends, however it ends: normal end,
    client disconnect (Starlette cancels the body task), send failure, or server shutdown."""

    def __init__(self, events: AsyncIterator[str], handle: RequestHandle) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._handle = handle

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        state = {"started": False, "ended": False}

        async def tracked_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await super().__call__(scope, receive, tracked_send)
        except asyncio.CancelledError:
            # The server cancels what is left once its graceful-shutdown time is over: end the stream the way
            # the README promises (an error event and [DONE]) instead of cutting it mid-event.
            if state["started"] and not state["ended"]:
                with contextlib.suppress(Exception):
                    final = stream_error(RuntimeError("the server is shutting down")) + SSE_DONE
                    await send({"type": "http.response.body", "body": final.encode(), "more_body": False})
            raise
        finally:
            self._handle.abort()


@dataclass
class StreamState:
    """How much of one choice has been sent. Engine text is cumulative (and may hold back a possible stop
    string's first characters), so each event carries text[sent:] and the matching new tokens. ``offset`` is the
    character offset of the next token in the choice's text (legacy completion logprobs' ``text_offset``)."""
    text: int = 0
    tokens: int = 0
    offset: int = 0
    done: bool = False
    source: RequestOutput | None = None     # the output the choice's first event was made from (echo)

    def advance(self, c: CompletionOutput) -> None:
        self.text, self.tokens, self.done = len(c.text), len(c.token_ids), c.finished


# (choice, new text, its state before this event) -> the endpoint's fields of the choice: {"text", "logprobs"}
# or {"delta", "logprobs"}. It may move ``state.offset``; the loop then advances the state past the choice.
FormatChoice = Callable[[CompletionOutput, str, StreamState], dict[str, Any]]


async def stream_events(handle: RequestHandle, header: dict[str, Any], format_choice: FormatChoice, *, n: int,
                        include_usage: bool, continuous_usage: bool, opening: list[dict] | None = None,
                        prefix: Callable[[RequestOutput], str] | None = None,
                        metrics: Any = None) -> AsyncIterator[str]:
    """The SSE body of one request: a chunk per engine update with each choice's new text, its finish reason
    once finished, the usage chunk when asked for, an error event if the engine fails mid-stream, then [DONE].

    header:  the chunk's fixed fields (id, object, created, model).
    n:       samples per prompt; choice index = prompt index x n + sample index.
    opening: choices of a first chunk sent before any output (chat sends the role).
    prefix:  text put before a choice's first delta (completions' echo of the prompt).

    A choice the engine ended with finish reason "error" (a fault in that request alone) ends the stream with an
    error event carrying the engine's message, then [DONE].
    """
    states: dict[int, StreamState] = {}
    snap: list = []

    def chunk(choices: list[dict], usage_now: Any = None) -> str:
        payload = {**header, "choices": choices}
        if include_usage:
            payload["usage"] = usage_now.model_dump() if usage_now is not None else None
        return sse(payload)

    if opening is not None:
        yield chunk(opening)
    try:
        async for snap in handle:
            choices = []
            for p, out in enumerate(snap):
                for c in (out.outputs if out is not None else []):
                    index = p * n + c.index
                    st = states.get(index)
                    head = ""
                    if st is None:
                        if prefix is not None and not (c.token_ids or c.finished):
                            continue      # an echo waits for the first token: the prompt's logprobs are whole
                        head = prefix(out) if prefix is not None else ""
                        st = states[index] = StreamState(offset=len(head), source=out)
                    delta = c.text[st.text:]
                    if st.done or not (delta or head or c.finished):
                        continue
                    if c.finish_reason == "error":
                        if metrics is not None:
                            metrics.failures.labels(cause="request_failed").inc()
                        yield stream_error(RuntimeError(f"the request failed in the engine: {c.stop_reason}"),
                                           "server_error", "request_failed")
                        yield SSE_DONE
                        return
                    fields = format_choice(c, head + delta, st)
                    finish = fields.pop("finish_reason", c.finish_reason if c.finished else None)
                    choice = {"index": index, **fields, "finish_reason": finish}
                    if c.finished:
                        choice["stop_reason"] = c.stop_reason
                    st.advance(c)
                    choices.append(choice)
            if choices:
                yield chunk(choices, usage(snap) if continuous_usage else None)
        if include_usage:
            yield chunk([], usage(snap))
    except EngineUnavailableError as exc:
        yield stream_error(exc)
    yield SSE_DONE
