"""The OpenAI endpoint's streamed replies (`stream: true`): server-sent events in OpenAI's chunk format.

A streamed call is sampled and recorded exactly as an unstreamed one; only its reply travels in
pieces. Its text goes out as the engine samples it: after an engine step, the tokens so far are
decoded and what is new since the last chunk is sent, so the chunks' text joined is the reply's
text (a step that ends inside a character waits for the next). A chat call with `tools` sends
its reply after the turn instead, its content in one chunk and each tool call in one (the calls
are read from the whole turn). Then a chunk with the finish reason, one with the usage when
`stream_options.include_usage` asks for it, and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable

from aiohttp import web

log = logging.getLogger(__name__)


class TextDeltas:
    """A turn's text as it is sampled. The engine's callback (`on_tokens`) only keeps the latest
    tokens; the reply's coroutine decodes them when it next runs (steps it missed coalesce), so a
    slow client or a long reply never slows the engine's steps."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.sent = ""
        self.latest: list[int] = []
        self.changed = asyncio.Event()

    def on_tokens(self, token_ids: list[int]) -> None:
        self.latest = token_ids
        self.changed.set()

    def piece(self) -> str:
        """The text new since the last piece ("" while a character is incomplete)."""
        self.changed.clear()
        text = self.tokenizer.decode(self.latest, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece

    def rest(self, text: str) -> str:
        """What of the turn's final `text` is still to send."""
        if not text.startswith(self.sent):  # a tokenizer whose decoding of a prefix is not a prefix
            log.warning("a streamed reply's pieces are not a prefix of its text; the rest is not sent")
            return ""
        return text[len(self.sent):]


class ChunkStream:
    """One streamed reply: `chat.completion.chunk`s or `text_completion` chunks."""

    def __init__(self, request: web.Request, kind: str, model: str, include_usage: bool):
        self.request, self.kind, self.model, self.include_usage = request, kind, model, include_usage
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
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
        content = {"delta": delta} if self.kind == "chat" else {"text": delta}
        await self._send({"choices": [{"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}]})

    async def streamed(self, sampling: Awaitable, deltas: TextDeltas | None):
        """Await `sampling` (the call's completion), sending `deltas`' pieces as they come. A failure
        after the headers went out is sent as an error event (OpenAI's), ends the reply, and gives
        None: the call is then recorded nowhere."""
        task = asyncio.ensure_future(sampling)
        while deltas is not None and not task.done():
            changed = asyncio.ensure_future(deltas.changed.wait())
            await asyncio.wait({task, changed}, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            if deltas.changed.is_set():
                await self.text(deltas.piece())
        try:
            return await task
        except Exception as err:  # the engine failed: say so in the stream, as OpenAI's servers do
            log.warning("a streamed call failed after its reply began: %s: %s", type(err).__name__, err)
            await self._write(f"data: {json.dumps({'error': {'message': str(err), 'type': 'server_error'}})}\n\n"
                              .encode())
            if self.open:
                await self.response.write_eof()
            self.open = False
            return None

    async def finish(self, finish_reason: str, usage: dict) -> web.StreamResponse:
        await self.delta({} if self.kind == "chat" else "", finish_reason)
        if self.include_usage:
            await self._send({"choices": [], "usage": usage})
        await self._write(b"data: [DONE]\n\n")
        if self.open:
            await self.response.write_eof()
        return self.response

    async def _send(self, chunk: dict) -> None:
        chunk = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, **chunk}
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
