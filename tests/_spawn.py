"""Real gloo ranks for the tests that need them: a script started once per rank on
127.0.0.1, waited for, and killed if it fails or hangs.

The multi-process tests spawn their ranks once (a module-scoped fixture) and read
what every scenario wrote; this is the spawning they share.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

TESTS_DIR = Path(__file__).parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(world: int) -> dict[str, str]:
    """The environment of a rank of ``world`` on this host (RANK set per rank): no run
    id inherited from the test's own environment, one intra-op thread per rank, and
    the tests directory importable (the scenario scripts share helpers there)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("COMMSPAN_RUN_ID", "TORCHELASTIC_RUN_ID")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    return env


def spawn(script: Path, args: Sequence[str], logs: Sequence[Path],
          env: dict[str, str] | None = None) -> list[subprocess.Popen[bytes]]:
    """Start ``python script *args`` once per log (rank = its index), output to its log."""
    base = env if env is not None else rank_env(len(logs))
    procs = []
    for rank, path in enumerate(logs):
        with path.open("w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(script), *args],
                env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)),
                stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float,
             grace_s: float = 5.0) -> None:
    """Wait until every rank exited or ``timeout_s`` passed; once one rank failed,
    give the others ``grace_s`` (they are likely blocked in a collective with it),
    then kill whatever still runs."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
        end = min(deadline, time.monotonic() + grace_s)
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_ranks(script: Path, args: Sequence[str], root: Path, world: int,
              timeout_s: float) -> tuple[list[int], list[str]]:
    """Run ``script`` on ``world`` ranks to the end (or ``timeout_s``): each rank's
    exit status (negative: killed) and its output (``root/rank<r>.log``)."""
    logs = [root / f"rank{r}.log" for r in range(world)]
    procs = spawn(script, args, logs)
    wait_all(procs, timeout_s)
    return ([int(p.returncode) for p in procs],
            [log.read_text(errors="replace") for log in logs])
