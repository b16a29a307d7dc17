"""Small helpers shared by the benchmark sections: statistics, RSS, ports, processes."""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "free_port",
    "median",
    "quiet",
    "rss_mb",
    "run_in_subprocess",
    "spread",
]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def spread(values: Sequence[float]) -> tuple[float, float]:
    return (float(min(values)), float(max(values))) if values else (float("nan"),) * 2


def rss_mb() -> float:
    """Resident set size of this process in MiB (after a full garbage collection)."""
    gc.collect()
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quiet() -> None:
    """Settings every benchmark process applies first: one intra-op thread, no warnings."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


def _child(fn: Callable[..., Any], args: tuple[Any, ...], conn: Any) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as exc:  # report, do not hang the parent
        import traceback

        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_in_subprocess(
    fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0
) -> Any:
    """Run ``fn(*args)`` in a fresh spawned process and return its (picklable) result.

    Raises:
        RuntimeError: the child raised, died or ran past ``timeout_s``.
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, args, child), daemon=True)
    proc.start()
    child.close()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{fn.__name__} ran past {timeout_s:.0f} s")
            if parent.poll(min(left, 1.0)):
                status, value = parent.recv()
                break
            if not proc.is_alive() and not parent.poll(0):
                raise RuntimeError(f"{fn.__name__} died with exit code {proc.exitcode}")
    finally:
        if proc.is_alive():
            proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise RuntimeError(f"{fn.__name__} failed in its subprocess:\n{value}")
    return value
