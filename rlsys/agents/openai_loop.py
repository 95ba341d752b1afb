"""The `openai` agent loop: an agent harness written against the OpenAI client, as a rollout.

The harness is the user's `async def run(client: openai.AsyncOpenAI, row: dict) -> str | dict`
(`rollout.agent_entry: FILE:function`). For each trajectory the loop opens a session on its
engine's OpenAI endpoint (`OpenAIEndpoint`), gives the harness a client whose base URL is that
session's route, and runs it under `rollout.agent_timeout_s`. Every call the harness makes is
recorded token-exact (`ChatSession`); the trajectory is the session's episode, every segment
of it (a call that rewrote the history starts a new one), and what the harness returns is the
response the reward scores with the last segment: a string, or
`{"response": str, "extra_info": dict}` whose extra_info joins the reward's.

A harness that raises, runs past its time, returns something else or never calls the endpoint
makes no trajectory: the sample is dropped from the step and counted (`agent/dropped_*`), and
the step goes on. Harnesses run on the engine actor's event loop, many at once: they must
await, never block (a blocking call holds up every session of the engine).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import replace

from rlsys.agents.chat import ChatTurns
from rlsys.agents.loop import AgentContext, AgentLoop, register_agent_loop
from rlsys.agents.openai_endpoint import LISTEN_BACKLOG, OpenAIEndpoint
from rlsys.agents.tool_parsers import TOOL_PARSERS
from rlsys.agents.trajectory import RolloutRequest, Sampling, Trajectory, dropped

log = logging.getLogger(__name__)


@register_agent_loop("openai")
class OpenAILoop(AgentLoop):
    harness = None
    """The user's `async def run(client, row)`: set by `bind`."""
    timeout_s = 600.0

    @classmethod
    def bind(cls, harness, timeout_s: float) -> type:
        """This loop running `harness`, each run within `timeout_s`."""
        return type(cls.__name__, (cls,), {"harness": staticmethod(harness), "timeout_s": timeout_s})

    def __init__(self, context: AgentContext):
        super().__init__(context)
        self.endpoint = OpenAIEndpoint(context.engine, ChatTurns(context.tokenizer),
                                       TOOL_PARSERS[context.limits.parser](), _node_address())
        self._http, self._http_loop = None, None

    async def run(self, request: RolloutRequest, sampling: Sampling) -> Trajectory:
        import openai

        url = await self.endpoint.start()
        session_id, session = self.endpoint.open(request, sampling)
        client = openai.AsyncOpenAI(base_url=f"{url}/s/{session_id}/v1", api_key=self.endpoint.token,
                                    max_retries=0, timeout=self.timeout_s, http_client=self._http_client())
        try:
            answer = await asyncio.wait_for(self.harness(client, copy.deepcopy(request.row)), self.timeout_s)
            return _trajectory(request, session.chat, answer)
        except asyncio.TimeoutError:
            return _dropped(request, session.chat, "timeout")
        except Exception as err:  # the user's harness: count it, keep the step going
            log.warning("agent harness failed on prompt %d: %s: %s", request.prompt_index, type(err).__name__, err)
            return _dropped(request, session.chat, "error")
        finally:
            self.endpoint.close(session_id)

    def _http_client(self):
        """One HTTP client for every session's OpenAI client on this event loop: a client of its own
        would cost each trajectory an SSL context and a connection, and httpx's pool slows with
        hundreds of connections at once, which aiohttp's does not. It holds as many connections as the
        endpoint's backlog, open from step to step (the client's default keeps 100, for 5 s), so
        that a step's sessions do not open hundreds of new ones at once."""
        import openai

        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            limits = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=LISTEN_BACKLOG,
                                                            max_keepalive_connections=LISTEN_BACKLOG,
                                                            keepalive_expiry=self.timeout_s)
            try:
                self._http = openai.DefaultAioHttpClient(limits=limits)
            except RuntimeError:  # an openai without its aiohttp transport
                self._http = openai.DefaultAsyncHttpxClient(limits=limits)
            self._http_loop = loop
        return self._http


def _trajectory(request: RolloutRequest, chat, answer) -> Trajectory:
    """The session's episode: its last segment, scored on `answer`, with the segments before it."""
    if isinstance(answer, dict) and isinstance(answer.get("response"), str):
        text, extra_info = answer["response"], answer.get("extra_info") or {}
    elif isinstance(answer, str):
        text, extra_info = answer, {}
    else:
        log.warning("agent harness returned %s on prompt %d; expected str or {'response': str, 'extra_info': dict}",
                    type(answer).__name__, request.prompt_index)
        return _dropped(request, chat, "error")
    if not chat.segments:
        return _dropped(request, chat, "no_call")
    *earlier, last = [_segment(request, segment) for segment in chat.segments]
    calls = sum(segment.calls for segment in chat.segments)
    tool_calls = sum(segment.tool_calls for segment in chat.segments)
    return replace(last, text=text, num_turns=calls, tool_calls=tool_calls, prefix_breaks=chat.prefix_breaks,
                   reward_info={"num_turns": calls, "tool_calls": tool_calls,
                                **(extra_info if isinstance(extra_info, dict) else {})},
                   earlier=earlier)


def _segment(request: RolloutRequest, segment) -> Trajectory:
    """One segment of the session as a trajectory of its own (the reward's text is the last one's)."""
    return Trajectory(request.prompt_index, segment.prompt_ids, segment.ids, segment.mask, segment.logprobs,
                      segment.versions, text="", finish_reason=segment.finish_reason, num_turns=segment.calls,
                      tool_calls=segment.tool_calls)


def _dropped(request: RolloutRequest, chat, reason: str) -> Trajectory:
    return dropped(request, reason, chat.prefix_breaks)


def _node_address() -> str:
    """This node's address in the Ray cluster (the loopback address outside one)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
