"""Tools run in a pool of Ray actors, so a slow tool does not hold up generation.

Every tool worker builds every configured tool. A trajectory's calls all go to one worker
(chosen by its key), which creates each tool's instance on the first call (with the data
row's `create_kwargs`) and, when the trajectory ends, asks each instance for its reward and
releases it. A call that raises or runs past `tools.timeout_s` answers with an error text,
as a malformed call does: the model sees it, the loop counts it, the trajectory goes on. A
worker that dies is restarted by Ray, and a call in flight when it died is sent once more to
the restarted worker (a tool instance it held is created again there on that call); a call
that kills its worker again answers with an error. The driver holds the workers as a group
(`ToolPool`, an `ActorGroup`); the engines call them through `ToolClient`, inside their own
event loops, where a tool's failure is the model's observation rather than the group's.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import zlib
from typing import Any

import ray

from rlsys.actors.cluster import actor_name, spawn
from rlsys.actors.group import ActorGroup
from rlsys.console import StartupClock, record_startup, redirect_actor_output
from rlsys.tools.base import AgentData, ToolResult, response_text
from rlsys.tools.registry import ToolSpec

_MARGIN_S = 5.0
"""How much longer than a call's own limit the caller waits for a worker that does not answer."""


class ToolWorker:
    def __init__(self, specs: list[ToolSpec]):
        startup = StartupClock()
        redirect_actor_output()
        self.tools = {spec.name: spec.build() for spec in specs}
        self.takes_agent_data = {name: _takes(tool.execute, "agent_data") for name, tool in self.tools.items()}
        """Tools written for VeRL's current agent loop read `agent_data=` in `execute`."""
        self.instances: dict[str, dict[str, str]] = {}
        """Per trajectory key: each tool's instance id."""
        record_startup("tool", startup)

    async def call(self, key: str, name: str, arguments: dict[str, Any], create_kwargs: dict,
                   timeout_s: float) -> ToolResult:
        started = time.perf_counter()
        try:
            instance = await self._instance(key, name, create_kwargs)
            extra = {"agent_data": AgentData(key, {name: {"create_kwargs": create_kwargs}})} \
                if self.takes_agent_data[name] else {}
            response, reward, _ = await asyncio.wait_for(self.tools[name].execute(instance, arguments, **extra),
                                                         timeout_s)
            return ToolResult(response_text(response), False, time.perf_counter() - started, float(reward or 0.0))
        except asyncio.TimeoutError:
            text = f"Error: the {name} call did not finish within {timeout_s:g} s"
        except Exception as err:  # the tool's own error: an observation, not a crash
            text = f"Error: {type(err).__name__}: {err}"
        return ToolResult(text, True, time.perf_counter() - started)

    async def finish(self, key: str) -> list[float]:
        """Each of the trajectory's tool instances: its reward, then its release."""
        rewards = []
        for name, instance in self.instances.pop(key, {}).items():
            try:
                rewards.append(float(await self.tools[name].calc_reward(instance)))
                await self.tools[name].release(instance)
            except Exception:  # a tool failing to score or release its instance costs its reward only
                rewards.append(0.0)
        return rewards

    def shutdown(self) -> None:
        """Nothing of a tool worker's outlives its process (a sandboxed tool's runs end with their calls)."""

    async def _instance(self, key: str, name: str, create_kwargs: dict) -> str:
        instances = self.instances.setdefault(key, {})
        if name not in instances:
            created = await self.tools[name].create(create_kwargs=create_kwargs)
            instances[name] = created[0] if isinstance(created, tuple) else created
        return instances[name]


def _takes(method, name: str) -> bool:
    """Whether `method` accepts the keyword `name` (by name or through **kwargs)."""
    parameters = inspect.signature(method).parameters.values()
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


class ToolClient:
    """The rollout engines' side of the pool: picklable, awaited inside their event loops."""

    def __init__(self, workers: list, timeout_s: float):
        self.workers, self.timeout_s = workers, timeout_s

    async def call(self, key: str, name: str, arguments: dict, create_kwargs: dict) -> ToolResult:
        started = time.perf_counter()
        try:
            return await asyncio.wait_for(
                self._worker(key).call.remote(key, name, arguments, create_kwargs, self.timeout_s),
                self.timeout_s + _MARGIN_S)
        except asyncio.TimeoutError:
            text = f"Error: the {name} call did not finish within {self.timeout_s:g} s"
        except ray.exceptions.RayError as err:  # the worker died during the call and its retry
            text = f"Error: the {name} tool's worker failed ({type(err).__name__})"
        return ToolResult(text, True, time.perf_counter() - started)

    async def finish(self, key: str) -> list[float]:
        try:
            return await asyncio.wait_for(self._worker(key).finish.remote(key), self.timeout_s + _MARGIN_S)
        except (asyncio.TimeoutError, ray.exceptions.RayError):
            return []

    def _worker(self, key: str):
        return self.workers[zlib.crc32(key.encode()) % len(self.workers)]


class ToolPool(ActorGroup[ToolWorker]):
    """The driver's handle on the pool: `client()` for the engines, `shutdown()` at the end."""

    stop_timeout_s = 0.0
    """A pool that ends kills its workers at once (one may still run a tool past its time)."""

    def __init__(self, specs: list[ToolSpec], num_workers: int, timeout_s: float, role: str = "tool"):
        """`role` names the workers in the dashboard (rlsys/<role>/<i>)."""
        super().__init__([actor_name(role, i) for i in range(num_workers)])
        self.timeout_s = timeout_s
        actor_cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=1, max_concurrency=256)(ToolWorker)
        self.actors = [spawn(actor_cls, role, i, specs) for i in range(num_workers)]
        # A call's limit is the tool's time, not the worker's start (its process, imports, the tools' builds).
        self.wait([worker.__ray_ready__.remote() for worker in self.actors])

    def client(self) -> ToolClient:
        return ToolClient(self.actors, self.timeout_s)
