"""A run's timeline as one Chrome trace-event file, trace.json (Perfetto and chrome://tracing open it).

Three sources, one clock: the driver's spans (each step and its phases), the spans a process records
inside a call (a training rank's forward, backward and optimizer step of each micro-batch), both kept
by `span` in the process that ran them, and Ray's own record of every actor call (`ray.timeline`:
each rank's, engine's, reward and tool worker's calls, named `<phase>: <method>`). Every process
stamps with its node's wall clock; the driver measures each node's offset to its own from the
actors it asks for their spans (the round trip's midpoint, the fastest of the tries) and moves
that node's events by it.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

TRACE_FILE = "trace.json"

_spans: list[tuple[str, int, int, int, dict]] = []
"""This process's spans not yet taken: (name, start ns, duration ns, thread id, args)."""


@contextmanager
def span(name: str, **args):
    """Record the block as a span of this process (a list append: about a microsecond)."""
    start = time.time_ns()
    try:
        yield
    finally:
        _spans.append((name, start, time.time_ns() - start, threading.get_ident(), args))


def take_spans() -> list[tuple[str, int, int, int, dict]]:
    """This process's spans since the last call."""
    global _spans
    taken, _spans = _spans, []
    return taken


@dataclass
class ProcessSpans:
    """One process's spans as the driver gathered them."""

    process: str
    """Its name on the timeline: `driver`, or the actor's (`rlsys/train/0`)."""
    node: str
    spans: list[tuple[str, int, int, int, dict]]


def gather_spans(actors: dict[str, object], tries: int = 3) -> tuple[list[ProcessSpans], dict[str, float]]:
    """Each named actor's spans, and each node's clock offset to the driver's in microseconds (what to
    subtract from its stamps), from the fastest of `tries` round trips to the node's actors."""
    import ray

    def ask(_self, take: bool) -> tuple[str, int, list]:
        return ray.util.get_node_ip_address(), time.time_ns(), take_spans() if take else []

    offsets: dict[str, tuple[int, float]] = {}  # node -> (round trip ns, offset us)
    gathered = []
    for name, actor in actors.items():
        for attempt in range(tries):
            sent = time.time_ns()
            node, stamp, spans = ray.get(actor.__ray_call__.remote(ask, attempt == tries - 1), timeout=60)
            back = time.time_ns()
            if node not in offsets or back - sent < offsets[node][0]:
                offsets[node] = (back - sent, (stamp - (sent + back) / 2) / 1000)
        gathered.append(ProcessSpans(name, node, spans))
    return gathered, {node: offset for node, (_, offset) in offsets.items()}


def write_trace(path: str, processes: list[ProcessSpans], ray_events: list[dict], offsets: dict[str, float],
                since_us: float) -> int:
    """Write the timeline to `path`: the processes' spans and Ray's events of the run's own workers from
    `since_us` on, each moved by its node's offset; returns how many events it holds."""
    workers = _worker_names(ray_events)
    events: list[dict] = []
    pids: dict[str, int] = {}
    for process in processes:
        pid = pids.setdefault(process.process, len(pids) + 1)
        shift = offsets.get(process.node, 0.0)
        events += [{"name": name, "ph": "X", "pid": pid, "tid": thread % 100_000, "ts": start / 1000 - shift,
                    "dur": duration / 1000, "args": args} for name, start, duration, thread, args in process.spans
                   if start / 1000 - shift >= since_us]  # a kept actor's spans of an earlier run are not this one's
    for event in ray_events:
        name = workers.get(event.get("tid"))
        if event.get("ph") != "X" or name is None or event["ts"] < since_us or not event["cat"].startswith("task::"):
            continue
        pid = pids.setdefault(name, len(pids) + 1)
        events.append({"name": event["cat"].removeprefix("task::"), "ph": "X", "pid": pid, "tid": 0,
                       "ts": event["ts"] - offsets.get(event.get("pid"), 0.0), "dur": event["dur"],
                       "args": {"source": "ray"}})
    events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}} for name, pid in pids.items()]
    events += [{"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
               for pid in pids.values()]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)


def _worker_names(ray_events: list[dict]) -> dict[str, str]:
    """Ray's worker ids by the rlsys actor each one hosts, read off its actor's creation
    (`task::rlsys/train/0:TrainWorker.__init__`); the newest actor of a worker wins."""
    names = {}
    for event in sorted(ray_events, key=lambda e: e.get("ts", 0)):
        category = event.get("cat", "")
        if category.startswith("task::rlsys/") and category.endswith(".__init__"):
            names[event["tid"]] = category.removeprefix("task::").rsplit(":", 1)[0]
    return names
