"""One engine instance of a cluster: an ``LLM`` in a Ray actor, behind the server's AsyncEngine bridge.

The class is plain Python (``launch.py`` wraps it with ``ray.remote``), so it can be read and tested without Ray.
Its methods are the whole protocol between the proxy and an instance:

- ``generate``: a stream of cumulative ``RequestOutput``s (first ``None``, once the request is admitted, so the
  proxy can answer bad input with a 400 before it commits to a response). With ``kv`` (a ``KVTransfer`` from a
  prefill instance) the prompt's blocks are imported first, on the engine thread, and the request then finds them
  like a prefix-cache hit: only the prompt's tail (less than one block, at least one token) is computed here.
- ``prefill``: compute the prompt (one token, which is dropped: the decode instance samples the first token with
  the request's own parameters) and return the KV of its full blocks.
- ``abort``, ``ping`` and ``stats`` (the block pool, for the health endpoint and the tests).
"""
from __future__ import annotations

import os
from typing import Any, AsyncIterator

from leapdecode.outputs import RequestOutput
from leapdecode.sampling_params import SamplingParams

ROLES = ("replica", "prefill", "decode")


class EngineInstance:
    def __init__(self, name: str, role: str, llm_kwargs: dict, num_threads: int | None = None,
                 max_queued_requests: int = 512) -> None:
        import torch

        from leapdecode.llm import LLM
        from leapdecode.server.async_engine import AsyncEngine

        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if num_threads:
            torch.set_num_threads(num_threads)
        self.name, self.role = name, role
        self.llm = LLM(**llm_kwargs)
        self.bridge = AsyncEngine(self.llm, max_queued_requests=max_queued_requests)
        self.bridge.start()
        self._handles: dict[str, Any] = {}

    async def generate(self, request_id: str, prompt_ids: list[int], params: Any,
                       kv: Any = None) -> AsyncIterator[RequestOutput | None]:
        prompt = prompt_ids if kv is None else self._importing(kv, prompt_ids)
        handle = await self.bridge.submit([prompt], [params], [request_id])
        self._handles[request_id] = handle
        try:
            yield None
            async for snap in handle:
                yield snap[0]
        finally:                                  # finished, cancelled by the proxy, or the proxy went away
            handle.abort()
            self._handles.pop(request_id, None)

    def _importing(self, kv: Any, prompt_ids: list[int]):
        """A prompt that the bridge resolves on the engine thread: import the blocks, then add the request."""
        engine = self.llm.engine

        def prompt() -> list[int]:
            engine.import_kv(kv)
            return prompt_ids
        return prompt

    async def prefill(self, request_id: str, prompt_ids: list[int]) -> Any:
        handle = await self.bridge.submit([prompt_ids], [SamplingParams(max_tokens=1, temperature=0.0)], [request_id])
        self._handles[request_id] = handle
        try:
            async for _ in handle:
                pass
        finally:
            handle.abort()
            self._handles.pop(request_id, None)
        engine = self.llm.engine
        return await self.bridge.call(lambda: engine.export_kv(prompt_ids))

    def abort(self, request_id: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            handle.abort()

    def ping(self) -> dict:
        return {"name": self.name, "role": self.role, "pid": os.getpid(), "accepting": self.bridge.accepting}

    async def stats(self) -> dict:
        engine = self.llm.engine

        def read() -> dict:
            bm = engine.block_manager
            return {"name": self.name, "role": self.role, "num_blocks": bm.num_blocks,
                    "free_blocks": bm.num_free_blocks, "prefix_hit_tokens": bm.hits,
                    "unfinished": engine.has_unfinished(), "block_size": bm.block_size}
        return await self.bridge.call(read)
