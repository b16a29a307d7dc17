"""The CLI over a thousand-rank run: ``summary``, ``table``, ``check``, ``html``,
``perfetto``, ``stragglers`` and ``diff`` (the run against itself) on 1,024 rank
files.

How the run directory is made (it is generated, not traced whole: tracing 1,024
ranks one by one on the fake process group would take the best part of an hour):

1. Eight processes each play one rank ``t`` (0-7) of a TP 8 x FSDP 128 job on the
   fake process group (``commspan.testing.models.tp_fsdp_transformer``, the
   tracesize section's medium model), with one ``COMMSPAN_RUN_ID``, so that all
   share one trace per step, and trace ``steps`` steps to plain JSONL.
2. Rank ``r = 8 g + t`` is rank ``t``'s file with what differs between the two
   put right: the ``commspan.rank`` and ``service.instance.id`` values, and its
   tensor-parallel group's name and ranks (``9 + g``; ``8 g`` to ``8 g + 7``), as
   the fake process group names them when it plays rank ``r``. Its FSDP group is
   rank ``t``'s. Each file is written compressed, one gzip member per line, as
   ``JsonlSpanExporter(compress=True)`` writes, and given its digest with
   :func:`commspan.analysis.digest.write_digest` (``commspan digest``), which
   builds it from the file's lines exactly as ``JsonlSpanExporter(digest=True)``
   does while tracing.

Then each command runs as ``python -m commspan.cli ...`` in a process of its own
(wall time, peak RSS), ``Aggregator.from_jsonl(dir, rank="all")`` is timed in a
process of its own, and, for comparison, ``summary`` runs on the first 16 rank
files without their digests (digested in memory as their lines are parsed), and
with ``--no-digest`` (the lines' reader, every span held as a record).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import run_in_subprocess

__all__ = ["run_offline"]

TP = 8
RUN_ID = "offline-bench"
_BASELINE_RANKS = 16


def _base_rank(t: int, world: int, steps: int, out: str) -> dict[str, Any]:
    os.environ["COMMSPAN_RUN_ID"] = RUN_ID
    import torch

    from benchmarks.common import quiet
    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter
    from commspan.testing.distributed import fake_process_group
    from commspan.testing.models import ModelArgs, make_batch, tp_fsdp_transformer, train_step

    quiet()
    torch.set_num_threads(1)
    args = ModelArgs(n_layers=4, vocab_size=1024, dim=256, n_heads=8, max_seq_len=64,
                     checkpoint={1: False, 3: False})
    path = Path(out) / f"base{t}.jsonl"
    with fake_process_group(world_size=world, rank=t):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp_shard", "tp"))
        model = tp_fsdp_transformer(args, mesh)
        tokens, targets = make_batch(args, batch=8, seq=64)
        train_step(model, tokens, targets)
        mode = CommSpanMode(exporters=[JsonlSpanExporter(path)])
        with mode:
            for i in range(steps):
                with mode.step(i):
                    train_step(model, tokens, targets)
        mode.shutdown()
    return {"bytes": path.stat().st_size}


def _ints(values: list[int]) -> bytes:
    return b"[" + b",".join(b'{"intValue":"%d"}' % v for v in values) + b"]"


def _rank_file(base: bytes, r: int, out: Path) -> None:
    """Rank ``r``'s file from its TP position's base file (see the module docstring)."""
    import gzip

    from commspan.analysis.digest import write_digest

    g, t = divmod(r, TP)
    text = base.replace(
        b'{"key":"commspan.rank","value":{"intValue":"%d"}}' % t,
        b'{"key":"commspan.rank","value":{"intValue":"%d"}}' % r,
    ).replace(
        b'{"key":"service.instance.id","value":{"stringValue":"%d"}}' % t,
        b'{"key":"service.instance.id","value":{"stringValue":"%d"}}' % r,
    )
    if g:
        text = text.replace(
            b'{"key":"commspan.pg.name","value":{"stringValue":"9"}}',
            b'{"key":"commspan.pg.name","value":{"stringValue":"%d"}}' % (9 + g),
        ).replace(
            b'{"key":"commspan.pg.ranks","value":{"arrayValue":{"values":%s}}}'
            % _ints(list(range(TP))),
            b'{"key":"commspan.pg.ranks","value":{"arrayValue":{"values":%s}}}'
            % _ints(list(range(TP * g, TP * g + TP))),
        )
    path = out / f"commspan-rank{r}.jsonl.gz"
    with path.open("wb") as fh:
        for line in text.splitlines(keepends=True):
            fh.write(gzip.compress(line, 1, mtime=0))
    write_digest(path)


def _expand(work: str, ranks: list[int]) -> None:
    bases: dict[int, bytes] = {}
    out = Path(work) / "run"
    for r in ranks:
        t = r % TP
        if t not in bases:
            bases[t] = (Path(work) / f"base{t}.jsonl").read_bytes()
        _rank_file(bases[t], r, out)


# The command, then its own peak RSS (VmHWM: the high-water mark of the process's
# memory since exec; ru_maxrss would also count the pages of the benchmark process
# it was forked from) on the last line of stderr.
_CLI = """
import sys
from commspan.cli import main
try:
    code = main(sys.argv[1:])
finally:
    with open("/proc/self/status") as fh:
        hwm = next((line.split()[1] for line in fh if line.startswith("VmHWM:")), "0")
    sys.stderr.write(f"\\nVmHWM_kB={hwm}\\n")
sys.exit(code)
"""


def _run_cli(args: list[str]) -> dict[str, Any]:
    """One command in a process of its own: wall and CPU seconds, peak RSS, status."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", _CLI, *args], stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        lines = out.read().count(b"\n")
        text, _, hwm = err.read().decode(errors="replace").rpartition("VmHWM_kB=")
    return {
        "args": args,
        "seconds": wall,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "status": proc.returncode,
        "stdout_lines": lines,
        "stderr_tail": text.strip()[-300:],
        "peak_rss_mb": int(hwm.strip() or 0) / 1024,
    }


def _from_jsonl(run_dir: str) -> dict[str, Any]:
    from commspan import Aggregator

    t0, c0 = time.perf_counter(), time.process_time()
    agg = Aggregator.from_jsonl(run_dir, rank="all")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    events = agg.total_count()
    return {"events": events, "seconds": wall, "cpu_seconds": cpu,
            "events_per_s": events / wall, "events_per_cpu_s": events / cpu}


def run_offline(world: int = 1024, steps: int = 20) -> dict[str, Any]:
    """Generate the run (see the module docstring), then time the CLI over it."""
    from multiprocessing import get_context

    work = tempfile.mkdtemp(prefix="commspan-bench-offline-")
    try:
        t0 = time.perf_counter()
        with get_context("spawn").Pool(2) as pool:
            bases = pool.starmap(_base_rank, [(t, world, steps, work) for t in range(TP)])
        t_base = time.perf_counter() - t0
        run_dir = Path(work) / "run"
        run_dir.mkdir()
        with get_context("spawn").Pool(2) as pool:
            pool.starmap(_expand, [(work, list(range(i, world, 2))) for i in range(2)])
        t_gen = time.perf_counter() - t0 - t_base
        files = sorted(run_dir.glob("*.jsonl.gz"))
        jsonl_bytes = sum(f.stat().st_size for f in files)
        digest_bytes = sum(f.stat().st_size for f in run_dir.glob("*.digest"))
        commands = {
            "summary": _run_cli(["summary", str(run_dir), "--rank", "all"]),
            "table": _run_cli(["table", str(run_dir), "--rank", "all"]),
            "check": _run_cli(["check", str(run_dir)]),
            # the views hold the 32 lowest ranks (--max-ranks), whose files the digests
            # name
            "html": _run_cli(["html", str(run_dir), "-o", str(Path(work) / "report.html")]),
            "perfetto": _run_cli(["perfetto", str(run_dir), "-o",
                                  str(Path(work) / "trace.json")]),
            # from the digests (version 6 on: module spans and pauses), and from the lines,
            # the run built as every file's lines are read
            "stragglers": _run_cli(["stragglers", str(run_dir)]),
            "stragglers --no-digest": _run_cli(["stragglers", str(run_dir), "--no-digest"]),
            # the run against itself, folded from the digests (version 7: each
            # collective's placements and mesh dimension; a folder named twice is
            # read once)
            "diff": _run_cli(["diff", str(run_dir), str(run_dir)]),
        }
        for name, out in (("html", "report.html"), ("perfetto", "trace.json")):
            written = Path(work) / out
            commands[name]["output_mb"] = written.stat().st_size / 1e6 if written.exists() \
                else None
        from_jsonl = run_in_subprocess(_from_jsonl, str(run_dir), timeout_s=1800)
        # the same command without digests, on a few ranks: the files digested in
        # memory as their lines are parsed, and the lines' reader (--no-digest), which
        # holds every span as a record (all 1,024 ranks' take some 11 GB)
        few = Path(work) / "few"
        few.mkdir()
        for f in files[:_BASELINE_RANKS]:
            shutil.copy(f, few / f.name)
        baseline = _run_cli(["summary", str(few), "--rank", "all"])
        baseline_lines = _run_cli(["summary", str(few), "--rank", "all", "--no-digest"])
        with_digest = _run_cli(["summary", str(run_dir), "--rank", "all"])  # warm, again
        return {
            "world": world,
            "steps": steps,
            "files": len(files),
            "base_bytes": [b["bytes"] for b in bases],
            "generate_seconds": {"base_ranks": t_base, "rank_files_and_digests": t_gen},
            "jsonl_gz_mb": jsonl_bytes / 1e6,
            "digest_mb": digest_bytes / 1e6,
            "commands": commands,
            "summary_again": with_digest,
            "from_jsonl": from_jsonl,
            "without_digests": {
                "ranks": _BASELINE_RANKS,
                "summary": baseline,
                "projected_seconds": baseline["seconds"] * world / _BASELINE_RANKS,
                "summary_no_digest": baseline_lines,
                "projected_seconds_no_digest":
                    baseline_lines["seconds"] * world / _BASELINE_RANKS,
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
