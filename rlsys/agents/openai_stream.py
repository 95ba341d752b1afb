"""The OpenAI endpoint's streamed replies (`stream: true`): server-sent events in OpenAI's chunk format.

A streamed call is sampled and recorded exactly as an unstreamed one; only its reply travels in
pieces. Its text goes out as the engine samples it: after each engine step, the tokens so far are
decoded and what is new since the last chunk is sent, so the chunks' text joined is the reply's
text (a step that ends inside a character waits for the next). A chat call with `tools` sends
its reply after the turn instead, its content in one chunk and each tool call in one (the calls
are read from the whole turn). Then a chunk with the finish reason, one with the usage when
`stream_options.include_usage` asks for it, and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable

from aiohttp import web


class TextDeltas:
    """A turn's text as it is sampled: `on_tokens` (the engine's callback) queues each new piece."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.sent = ""
        self.pieces: asyncio.Queue[str | None] = asyncio.Queue()

    def on_tokens(self, token_ids: list[int]) -> None:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.sent) or text == self.sent:
            return  # a character not complete yet, or nothing new
        self.pieces.put_nowait(text[len(self.sent):])
        self.sent = text

    def rest(self, text: str) -> str:
        """What of the turn's final `text` is still to send."""
        return text[len(self.sent):] if text.startswith(self.sent) else ""


class ChunkStream:
    """One streamed reply: `chat.completion.chunk`s or `text_completion` chunks."""

    def __init__(self, request: web.Request, kind: str, model: str, include_usage: bool):
        self.request, self.kind, self.model, self.include_usage = request, kind, model, include_usage
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache"})
        self.open = True
        """False once the client has gone: what is left is sampled and recorded, not sent."""

    async def start(self) -> None:
        await self.response.prepare(self.request)
        if self.kind == "chat":
            await self.delta({"role": "assistant", "content": ""})

    async def text(self, text: str) -> None:
        if text:
            await self.delta({"content": text} if self.kind == "chat" else text)

    async def delta(self, delta, finish_reason: str | None = None) -> None:
        """One chunk: a chat delta (a dict) or a completion's text."""
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            await self._send({"object": "chat.completion.chunk", "choices": [choice]})
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
            await self._send({"object": "text_completion", "choices": [choice]})

    async def streamed(self, sampling: Awaitable, deltas: TextDeltas | None):
        """Await `sampling` (the call's completion), sending `deltas`' pieces as they come."""
        task = asyncio.ensure_future(sampling)
        if deltas is None:
            return await task
        task.add_done_callback(lambda _: deltas.pieces.put_nowait(None))
        while (piece := await deltas.pieces.get()) is not None:
            await self.text(piece)
        return await task

    async def finish(self, finish_reason: str, usage: dict) -> web.StreamResponse:
        await self.delta({} if self.kind == "chat" else "", finish_reason)
        if self.include_usage:
            await self._send({"object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                              "choices": [], "usage": usage})
        await self._write(b"data: [DONE]\n\n")
        if self.open:
            await self.response.write_eof()
        return self.response

    async def _send(self, chunk: dict) -> None:
        chunk = {"id": self.id, "created": self.created, "model": self.model, **chunk}
        await self._write(f"data: {json.dumps(chunk)}\n\n".encode())

    async def _write(self, data: bytes) -> None:
        if not self.open:
            return
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError):  # the client went away mid-reply
            self.open = False


def include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    return isinstance(options, dict) and bool(options.get("include_usage"))
