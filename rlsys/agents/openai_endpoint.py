"""An OpenAI-compatible endpoint in front of a rollout engine, recording each session token-exact.

Served by aiohttp on the engine actor's own event loop, beside the engine's `RequestEngine`:

- `POST /s/{session}/v1/chat/completions`: the messages (and `tools`, through the chat
  template) continue the session's recording (`ChatSession`); the reply's tool calls
  (`tools.parser`) come back as OpenAI `tool_calls`, their text out of `content`;
- `POST /s/{session}/v1/completions`: a prompt given as text or token ids;
- `GET /s/{session}/v1/models`, `GET /v1/models`: the one model, `policy`.

`stream: true` sends the reply as server-sent events in OpenAI's chunk format
(`rlsys.agents.openai_stream`), sampled and recorded as the same call unstreamed. One choice per
call (`n` > 1 is refused).
The run's sampling settings govern every call (temperature, top_p, stop strings): a request's
own are ignored, so that what is trained on is what the policy samples. `max_tokens` (or
`max_completion_tokens`) can only lower a call's tokens below `rollout.max_new_tokens` and the
session's response budget; a call past that budget gets an empty reply with finish reason
`length`, recorded nowhere.

The server listens on the node's address only, and every request must carry the endpoint's
token (`Authorization: Bearer ...`, what the OpenAI client sends as its API key): made when the
endpoint starts, known to the engine's own harnesses alone. Sessions exist while their harness
runs; a request for another gets 404. Calls of one session are served one at a time.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from rlsys.agents.chat_session import ChatSession
from rlsys.agents.loop import sampling_params
from rlsys.agents.openai_stream import ChunkStream, TextDeltas, include_usage
from rlsys.agents.trajectory import RolloutRequest, Sampling
from rlsys.seeds import turn_seed

MODEL_NAME = "policy"
LISTEN_BACKLOG = 4096
"""Connections waiting to be accepted (the kernel caps it at net.core.somaxconn)."""


@dataclass
class Session:
    chat: ChatSession
    request: RolloutRequest
    sampling: Sampling
    calls: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class RequestError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI's error message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class OpenAIEndpoint:
    def __init__(self, engine, turns, parser, host: str):
        """`engine`: the actor's `RequestEngine`; `turns`: `ChatTurns` of the policy's template;
        `parser`: the tool-call parser (`tools.parser`); `host`: the node's address."""
        self.engine, self.turns, self.parser, self.host = engine, turns, parser, host
        self.tokenizer = turns.tokenizer
        self.token = secrets.token_urlsafe(32)
        self.sessions: dict[str, Session] = {}
        self._listening: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()

    async def start(self) -> str:
        """Listen on a free port of the node, once for the running event loop (an actor has one);
        the base URL."""
        loop = asyncio.get_running_loop()
        if self._listening is None or self._loop is not loop:
            self._loop, self._listening = loop, loop.create_task(self._listen())
        return await asyncio.shield(self._listening)

    async def _listen(self) -> str:
        app = web.Application(middlewares=[self._authorised], client_max_size=64 * 2**20)
        app.add_routes([web.post("/s/{session}/v1/chat/completions", self._chat),
                        web.post("/s/{session}/v1/completions", self._completions),
                        web.get("/s/{session}/v1/models", self._models),
                        web.get("/v1/models", self._models)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        # a free port, on this address only; a backlog for every session of a step connecting at once
        # (a full accept queue drops connections, which the clients retry after a second or more)
        listener = socket.create_server((self.host, 0), backlog=LISTEN_BACKLOG)
        await web.SockSite(runner, listener, backlog=LISTEN_BACKLOG).start()
        return f"http://{self.host}:{listener.getsockname()[1]}"

    def open(self, request: RolloutRequest, sampling: Sampling) -> tuple[str, Session]:
        """A session for one trajectory: its id (the route the harness's client calls) and state."""
        session_id = f"{next(self._ids)}-{uuid.uuid4().hex}"
        session = Session(ChatSession(self.turns, sampling.max_response_tokens), request, sampling)
        self.sessions[session_id] = session
        return session_id, session

    def close(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    # -- requests ---------------------------------------------------------------

    @web.middleware
    async def _authorised(self, request: web.Request, handler):
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return _error(401, "missing or wrong API key (the endpoint's token)")
        try:
            return await handler(request)
        except RequestError as err:
            return _error(err.status, str(err))

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                              "created": 0, "owned_by": "rlsys"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session, body = self._session(request), await _body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError(400, "messages: a non-empty list of message objects is required")
        tools, asked = body.get("tools") or None, _asked_tokens(body)
        stream = ChunkStream(request, "chat", MODEL_NAME, include_usage(body)) if body.get("stream") else None
        async with session.lock:
            call = session.chat.chat_call(messages, tools)
            prompt_tokens = len(call.prompt_ids)
            deltas = TextDeltas(self.tokenizer) if stream and not tools else None  # calls are read whole
            completion = await self._sample(session, call, asked, stream, deltas)
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True) if completion else ""
            calls = [c for c in self.parser.parse(text) if not c.error] if tools and completion else []
            reply = {"role": "assistant", "content": _content(self.parser, text) if calls else text}
            if calls:
                reply["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                       for c in calls]
            if completion:
                session.chat.record(call, completion, len(calls))
                session.chat.replied(messages, reply)
        finish = "tool_calls" if calls else (completion.finish_reason if completion else "length")
        usage = _usage(prompt_tokens, completion)
        if stream:
            await stream.text(deltas.rest(text) if deltas else reply["content"] or "")
            for index, tool_call in enumerate(reply.get("tool_calls", [])):
                await stream.delta({"tool_calls": [{"index": index, **tool_call}]})
            return await stream.finish(finish, usage)
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": MODEL_NAME, "choices": [{"index": 0, "message": reply, "finish_reason": finish,
                                              "logprobs": None}],
            "usage": usage})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session, body = self._session(request), await _body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = prompt
        else:
            raise RequestError(400, "prompt: a string or a list of token ids is required (one prompt a call)")
        asked = _asked_tokens(body)
        stream = ChunkStream(request, "text", MODEL_NAME, include_usage(body)) if body.get("stream") else None
        async with session.lock:
            call = session.chat.prompt_call(prompt_ids)
            prompt_tokens = len(call.prompt_ids)
            deltas = TextDeltas(self.tokenizer) if stream else None
            completion = await self._sample(session, call, asked, stream, deltas)
            if completion:
                session.chat.record(call, completion)
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True) if completion else ""
        finish, usage = completion.finish_reason if completion else "length", _usage(prompt_tokens, completion)
        if stream:
            await stream.text(deltas.rest(text))
            return await stream.finish(finish, usage)
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": MODEL_NAME, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": usage})

    def _session(self, request: web.Request) -> Session:
        session = self.sessions.get(request.match_info["session"])
        if session is None:
            raise RequestError(404, "no such session: it ended, or it was never opened")
        return session

    async def _sample(self, session: Session, call, asked: int | None, stream: ChunkStream | None = None,
                      deltas: TextDeltas | None = None):
        """The call's sampled turn under the run's sampling, at most `asked` tokens, or None when no
        token is left to it. With `stream` (started here) the reply is streamed, its text pieces
        sent as `deltas` collects them when given."""
        sampling = session.sampling
        tokens = min(sampling.max_new_tokens, session.chat.budget(call), asked or sampling.max_new_tokens)
        if stream:
            await stream.start()
        if tokens <= 0:
            return None
        seed = turn_seed(session.request.seed, session.calls)
        session.calls += 1
        sampled = self.engine.generate(call.prompt_ids, sampling_params(sampling, seed, tokens),
                                       on_tokens=deltas.on_tokens if deltas else None)
        return await stream.streamed(sampled, deltas) if stream else await sampled


def _asked_tokens(body: dict) -> int | None:
    """The request's own token limit (checked with what the endpoint refuses, before the session
    is touched)."""
    if body.get("n", 1) != 1:
        raise RequestError(400, "n: one choice a call")
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    if asked is not None and (not isinstance(asked, int) or asked <= 0):
        raise RequestError(400, "max_tokens: a positive integer")
    return asked


def _content(parser, text: str) -> str | None:
    """A reply's text without its tool calls (None when nothing else is left, as OpenAI's replies)."""
    return parser.strip_calls(text) or None


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


def _usage(prompt_tokens: int, completion) -> dict:
    sampled = len(completion.token_ids) if completion else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": sampled, "total_tokens": prompt_tokens + sampled}


def _error(status: int, message: str) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
