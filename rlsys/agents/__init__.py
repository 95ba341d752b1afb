"""Agent loops: one prompt -> one trajectory (token ids, loss mask, the engine's log-probs)."""

from rlsys.agents import openai_loop, tool_loop  # noqa: F401  (register the `openai` and `tool` loops)
from rlsys.agents.loop import AGENT_LOOPS, AgentContext, AgentLoop, register_agent_loop, resolve_agent_loop
from rlsys.agents.trajectory import RolloutRequest, Sampling, Trajectories, Trajectory

__all__ = ["AGENT_LOOPS", "AgentContext", "AgentLoop", "RolloutRequest", "Sampling", "Trajectories", "Trajectory",
           "register_agent_loop", "resolve_agent_loop"]
