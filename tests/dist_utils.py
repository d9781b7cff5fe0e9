"""Run a function on several real torch.distributed ranks (gloo on 127.0.0.1), with a timeout."""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, env, pg_timeout_s, queue):
    try:
        os.environ.update(env or {})
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # report everything, including KeyboardInterrupt from the function
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, env=None, timeout_s: float = 120, pg_timeout_s: float = 60):
    """Return [fn(rank, world_size, *args) for each rank]; raise with the failing rank's traceback.

    `fn` must be a module-level function (it is pickled by reference into spawned processes).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, env, pg_timeout_s, queue), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, failures = {}, []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    import time

    while len(results) + len(failures) < world_size:
        if datetime.datetime.now() > deadline:
            for p in procs:
                p.kill()
            raise TimeoutError(f"ranks did not finish within {timeout_s}s (got {sorted(results)})")
        if queue.empty():
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, ok, payload = queue.get()
        (results.__setitem__(rank, payload) if ok else failures.append((rank, payload)))
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if failures:
        rank, tb = sorted(failures)[0]
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    if len(results) != world_size:
        raise RuntimeError(f"ranks exited without a result: got {sorted(results)} of {world_size}")
    return [results[r] for r in range(world_size)]
