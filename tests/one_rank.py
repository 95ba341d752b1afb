"""Run a function as a torch.distributed rank of one, in a process of its own (a spawned
process: its gloo group and its monkeypatches end with it)."""

from __future__ import annotations

import multiprocessing


def one_rank_results(target, model_dir: str, store: str):
    """What `target(model_dir, store, conn)`, run as a rank of one in a process of its own, sends."""
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    rank = context.Process(target=target, args=(model_dir, store, child_conn), daemon=True)
    rank.start()
    try:
        while rank.is_alive() and not conn.poll(1):
            pass
        assert conn.poll(), "the rank died before sending its results"
        return conn.recv()
    finally:
        rank.join(timeout=30)
