"""Exporter throughput: JSONL spans/s, OTLP/protobuf encoding spans/s (the SDK's
encoder against commspan's) and ``Aggregator.from_jsonl`` events/s.

Runs in one spawned process with one thread. The spans are real: those of a
few traced steps of the tensor-parallel model over torch's fake process
group (world 4), collected by a span exporter that keeps what commspan hands
it. They are then written again and again by a ``JsonlSpanExporter`` to a
file in a temporary directory (page cache; files are replaced between timed
passes so they stay small), and a file of many steps is read back with
``Aggregator.from_jsonl``. The same spans are encoded as an OTLP
``ExportTraceServiceRequest`` by the SDK's encoder (what its OTLP/HTTP exporter
does on the export thread: ``encode_spans(spans).SerializePartialToString()``)
and by commspan's (``encode_spans_protobuf``), alternately, after checking
that both give the same bytes.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import quiet
from benchmarks.workload import ModelConfig

__all__ = ["run_export_throughput"]

LARGE_BATCH = 4096  # the export queue's largest batch


def _capture(cfg: ModelConfig, steps: int) -> list[list[Any]]:
    """The spans commspan hands its exporters for ``steps`` traced steps, per step."""
    import torch.distributed as dist
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.workload import build_model, make_batch, train_step
    from commspan import CommSpanMode

    class Keep(SpanExporter):
        def __init__(self) -> None:
            self.spans: list[Any] = []

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            self.spans.extend(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh = init_device_mesh("cpu", (4,))
    model = build_model(cfg, mesh)
    batch = make_batch(cfg)
    train_step(model, batch)  # warm-up, untraced
    per_step: list[list[Any]] = []
    keep = Keep()
    mode = CommSpanMode(exporters=[keep])
    for i in range(steps):
        with mode:
            with mode.step(i):
                train_step(model, batch)
        # leaving the mode flushed its exporter: these are step i's spans
        per_step.append(list(keep.spans))
        keep.spans.clear()
    mode.shutdown()
    return per_step


def _events(spans: Sequence[Any]) -> int:
    """Collective events (not e.g. ``exception`` events) on ``spans``."""
    from commspan import semconv

    return sum(
        1
        for s in spans
        for e in (getattr(s, "events", ()) or ())
        if e.attributes and semconv.COLL_OP in e.attributes
    )


def _time_exports(
    batch: list[Any], directory: Path, min_seconds: float, repeats: int, compress: bool = False,
    digest: bool = False,
) -> dict[str, float]:
    """Best of ``repeats`` passes of at least ``min_seconds`` exporting ``batch``."""
    from commspan.exporters import JsonlSpanExporter

    best_wall = best_cpu = 0.0
    nbytes = 0
    for rep in range(repeats):
        path = directory / f"throughput-{rep}.jsonl"
        exporter = JsonlSpanExporter(path, compress=compress, digest=digest)
        exporter.export(batch)  # opens the file; not timed
        n = 0
        w0, c0 = time.perf_counter(), time.process_time()
        while True:
            for _ in range(8):
                exporter.export(batch)
            n += 8
            w1 = time.perf_counter()
            if w1 - w0 >= min_seconds:
                break
        c1 = time.process_time()
        exporter.shutdown()
        nbytes = path.stat().st_size // (n + 1)
        path.unlink()
        if digest:
            side = Path(str(path) + ".digest")
            nbytes_digest = side.stat().st_size // (n + 1)
            side.unlink()
        best_wall = max(best_wall, n * len(batch) / (w1 - w0))
        best_cpu = max(best_cpu, n * len(batch) / max(c1 - c0, 1e-9))
    out = {"spans_per_s": best_wall, "spans_per_cpu_s": best_cpu, "bytes_per_batch": nbytes}
    if digest:
        out["digest_bytes_per_batch"] = nbytes_digest
    return out


def _time_encoders(batch: list[Any], min_seconds: float, repeats: int) -> dict[str, float]:
    """Best spans per CPU second of the SDK's and commspan's OTLP/protobuf encoders on
    ``batch``, timed alternately (a shared machine slows both alike)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from commspan.otlpjson.protobuf import encode_spans_protobuf

    def sdk(spans: Sequence[Any]) -> bytes:
        return encode_spans(spans).SerializePartialToString()  # type: ignore[no-any-return]

    expected = sdk(batch)
    if encode_spans_protobuf(batch) != expected:
        raise RuntimeError("commspan's OTLP/protobuf encoding differs from the SDK's")
    best = {"sdk": 0.0, "commspan": 0.0}
    for _ in range(repeats):
        for name, fn in (("sdk", sdk), ("commspan", encode_spans_protobuf)):
            n = 0
            c0 = time.process_time()
            while True:
                fn(batch)
                n += 1
                c1 = time.process_time()
                if c1 - c0 >= min_seconds:
                    break
            best[name] = max(best[name], n * len(batch) / (c1 - c0))
    return {
        "batch_spans": len(batch),
        "bytes_per_span": len(expected) / len(batch),
        "sdk_spans_per_s": best["sdk"],
        "commspan_spans_per_s": best["commspan"],
        "speedup": best["commspan"] / best["sdk"],
    }


def _time_otlp_http(batch: list[Any], min_seconds: float, repeats: int) -> dict[str, Any]:
    """Best spans per CPU second of the exporting thread (encoding and HTTP, not the
    receiver's thread) of commspan's OTLP/HTTP exporter posting ``batch`` to a local
    receiver, through commspan's plain-HTTP transport and through the SDK's
    ``requests`` transport (a ``session=`` of the exporter's keeps it), alternately."""
    import requests

    from benchmarks.otlp_receiver import OtlpReceiver
    from commspan.exporters import otlp_exporter
    from commspan.exporters._otlp_http import OTLPSpanExporter

    best = {"plain": 0.0, "requests": 0.0}
    with OtlpReceiver() as rx:
        exporters = {"plain": otlp_exporter(protocol="http/protobuf", endpoint=rx.endpoint),
                     "requests": OTLPSpanExporter(endpoint=rx.endpoint,
                                                  session=requests.Session())}
        if not getattr(exporters["plain"], "plain_http", False):
            return {"plain_http": False}  # (a proxy in the environment: requests only)
        for exporter in exporters.values():
            exporter.export(batch)  # (connects; not timed)
        for _ in range(repeats):
            for name, exporter in exporters.items():
                n = 0
                c0 = time.thread_time()
                while True:
                    exporter.export(batch)
                    n += 1
                    c1 = time.thread_time()
                    if c1 - c0 >= min_seconds:
                        break
                best[name] = max(best[name], n * len(batch) / (c1 - c0))
        for exporter in exporters.values():
            exporter.shutdown()
        if rx.stats()["rejected"]:
            raise RuntimeError("the receiver rejected OTLP/HTTP requests")
    return {
        "plain_http": True,
        "batch_spans": len(batch),
        "plain_spans_per_s": best["plain"],
        "requests_spans_per_s": best["requests"],
        "ms_saved_per_batch": (1 / best["requests"] - 1 / best["plain"]) * len(batch) * 1e3,
    }


def _worker(cfg_dict: dict[str, Any], capture_steps: int, file_steps: int, min_seconds: float,
            repeats: int) -> dict[str, Any]:
    quiet()
    from commspan import Aggregator
    from commspan.exporters import JsonlSpanExporter

    per_step = _capture(ModelConfig(**cfg_dict), capture_steps)
    counts = [len(s) for s in per_step]
    if not all(counts):
        raise RuntimeError(f"a traced step produced no span: spans per step {counts}")
    all_spans = [s for step in per_step for s in step]
    one_step = per_step[-1]
    spans_per_step = len(all_spans) / len(per_step)
    events_per_step = _events(all_spans) / len(per_step)

    with tempfile.TemporaryDirectory(prefix="commspan-bench-export-") as tmp:
        d = Path(tmp)
        small = _time_exports(one_step, d, min_seconds, repeats)
        packed = _time_exports(one_step, d, min_seconds, repeats, compress=True)
        digested = _time_exports(one_step, d, min_seconds, repeats, digest=True)
        large_batch = (all_spans * (LARGE_BATCH // len(all_spans) + 1))[:LARGE_BATCH]
        large = _time_exports(large_batch, d, min_seconds, repeats)
        protobuf = _time_encoders(one_step, min_seconds, repeats)
        protobuf_large = _time_encoders(large_batch, min_seconds, repeats)
        otlp_http = _time_otlp_http(one_step, min_seconds, repeats)

        def write_steps(path: Path, **options: Any) -> Path:
            """A file of ``file_steps`` steps, one line per step (as a small export
            batch writes)."""
            exporter = JsonlSpanExporter(path, **options)
            for i in range(file_steps):
                exporter.export(per_step[i % len(per_step)])
            exporter.shutdown()
            return path

        def read_cpu(path: Path) -> tuple[list[float], Any]:
            """CPU seconds of each of ``repeats`` reads with from_jsonl, and the last
            aggregator."""
            cpu, agg = [], None
            for _ in range(repeats):
                c0 = time.process_time()
                agg = Aggregator.from_jsonl(path)
                cpu.append(time.process_time() - c0)
            return cpu, agg

        path = write_steps(d / "steps.jsonl")
        n_spans = sum(len(per_step[i % len(per_step)]) for i in range(file_steps))
        n_events = sum(_events(per_step[i % len(per_step)]) for i in range(file_steps))
        times, cpu_times = [], []
        agg = None
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            agg = Aggregator.from_jsonl(path)
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        assert agg is not None
        ingested = agg.total_count()
        # ceiling for this file format: parsing the JSON lines and nothing else
        import orjson

        raw = path.read_bytes().split(b"\n")
        parse_cpu = []
        for _ in range(repeats):
            c0 = time.process_time()
            for line in raw:
                if line:
                    orjson.loads(line)
            parse_cpu.append(time.process_time() - c0)
        size = path.stat().st_size
        gz_cpu, gz_agg = read_cpu(write_steps(d / "steps.jsonl.gz", compress=True))
        if gz_agg.total_count() != ingested:
            raise RuntimeError("the compressed file counts differently from the plain one")
        # the same steps with digests (JsonlSpanExporter(digest=True)), compressed lines
        dg_cpu, dg_agg = read_cpu(
            write_steps(d / "steps-digest.jsonl.gz", compress=True, digest=True))
        if dg_agg.to_dict() != agg.to_dict():
            raise RuntimeError("the digests count differently from the lines")
    best, best_cpu = min(times), min(cpu_times)
    return {
        "config": cfg_dict,
        "captured_steps": len(per_step),
        "spans_per_step": spans_per_step,
        "events_per_step": events_per_step,
        "repeats": repeats,
        "min_seconds_per_pass": min_seconds,
        "jsonl": {
            "batch_spans": len(one_step),
            "spans_per_s": small["spans_per_cpu_s"],
            "spans_per_wall_s": small["spans_per_s"],
            "bytes_per_span": small["bytes_per_batch"] / len(one_step),
            "large_batch_spans": len(large_batch),
            "large_spans_per_s": large["spans_per_cpu_s"],
            "large_spans_per_wall_s": large["spans_per_s"],
            "bytes_per_step": small["bytes_per_batch"],
            "gzip_bytes_per_step": packed["bytes_per_batch"],
            "kb_per_step": small["bytes_per_batch"] / 1e3,
            "gzip_kb_per_step": packed["bytes_per_batch"] / 1e3,
            "gzip_spans_per_s": packed["spans_per_cpu_s"],
            "gzip_cpu_ms_per_step": (1 / packed["spans_per_cpu_s"] - 1 / small["spans_per_cpu_s"])
            * len(one_step) * 1e3,
            "digest_spans_per_s": digested["spans_per_cpu_s"],
            "digest_kb_per_step": digested["digest_bytes_per_batch"] / 1e3,
            "digest_cpu_ms_per_step": (
                1 / digested["spans_per_cpu_s"] - 1 / small["spans_per_cpu_s"]
            ) * len(one_step) * 1e3,
        },
        "otlp_protobuf": {"one_step": protobuf, "large": protobuf_large},
        "otlp_http": otlp_http,
        "from_jsonl": {
            "steps": file_steps,
            "spans": n_spans,
            "events": n_events,
            "collectives_counted": ingested,
            "bytes": size,
            "cpu_seconds": best_cpu,
            "wall_seconds": best,
            "events_per_s": n_events / best_cpu,
            "spans_per_s": n_spans / best_cpu,
            "events_per_wall_s": n_events / best,
            "parse_only_cpu_seconds": min(parse_cpu),
            "parse_only_events_per_s": n_events / min(parse_cpu),
            "parse_only_mb_per_s": size / 1e6 / min(parse_cpu),
            "gzip_events_per_s": n_events / min(gz_cpu),
            "digest_events_per_s": n_events / min(dg_cpu),
            "cpu_seconds_all": cpu_times,
            "wall_seconds_all": times,
        },
        "pid_cpu_affinity": len(os.sched_getaffinity(0)),
    }


def run_export_throughput(
    cfg: ModelConfig,
    *,
    capture_steps: int = 3,
    file_steps: int = 300,
    min_seconds: float = 1.0,
    repeats: int = 3,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Run the throughput measurements in a fresh process and return them."""
    from benchmarks.common import run_in_subprocess

    return run_in_subprocess(
        _worker, cfg.as_dict(), capture_steps, file_steps, min_seconds, repeats,
        timeout_s=timeout_s,
    )
