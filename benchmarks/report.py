"""Plain-text tables of the results and the targets of issue 4."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["TARGETS", "evaluate_targets", "format_report"]

# (key, description, metric path, comparison, threshold)
TARGETS: list[tuple[str, str, str, str, float]] = [
    ("full_tracing_cpu", "commspan + JSONL, CPU step time vs no mode",
     "step.variants.cs_jsonl.cpu_ratio", "<=", 1.10),
    ("full_tracing_wall", "commspan + JSONL, wall step time vs no mode",
     "step.variants.cs_jsonl.wall_ratio", "<=", 1.10),
    ("above_floor_vs_cdm", "commspan + JSONL cost above floor / CommDebugMode's (CPU)",
     "step.variants.cs_jsonl.cpu_above_floor_vs_cdm", "<=", 0.15),
    ("otlp_over_jsonl_cpu", "commspan + OTLP/HTTP CPU ratio minus commspan + JSONL's",
     "step.variants.cs_otlp.cpu_ratio_over_jsonl", "<=", 0.03),
    ("otlp_over_jsonl_wall", "commspan + OTLP/HTTP wall ratio minus commspan + JSONL's",
     "step.variants.cs_otlp.wall_ratio_over_jsonl", "<=", 0.03),
    ("sampled_out", "sampled-out step, CPU step time vs no mode",
     "step.variants.cs_sampled_out.cpu_ratio", "<=", 1.02),
    ("jsonl_kb", "JSONL kB per rank per step, plain", "export.jsonl.kb_per_step", "<=", 50.0),
    ("jsonl_gzip_kb", "JSONL kB per rank per step, compress=True",
     "export.jsonl.gzip_kb_per_step", "<=", 50.0),
    ("jsonl_spans_per_s", "JsonlSpanExporter spans/s (one core)", "export.jsonl.spans_per_s",
     ">=", 200_000),
    ("from_jsonl_events_per_s", "Aggregator.from_jsonl events/s, lines only",
     "export.from_jsonl.events_per_s", ">=", 500_000),
    ("from_jsonl_digest_events_per_s", "Aggregator.from_jsonl events/s, digest=True",
     "export.from_jsonl.digest_events_per_s", ">=", 500_000),
    ("offline_from_jsonl", "Aggregator.from_jsonl events/s, 1,024 ranks x 20 steps",
     "offline.from_jsonl.events_per_s", ">=", 500_000),
    ("offline_summary_s", "commspan summary, 1,024 ranks x 20 steps (s)",
     "offline.commands.summary.seconds", "<=", 60.0),
    ("offline_table_s", "commspan table, 1,024 ranks x 20 steps (s)",
     "offline.commands.table.seconds", "<=", 60.0),
    ("offline_check_s", "commspan check, 1,024 ranks x 20 steps (s)",
     "offline.commands.check.seconds", "<=", 60.0),
    ("rss_growth", "RSS growth over 1,000 traced steps, commspan + JSONL (MB)",
     "memory.variants.commspan_jsonl.projected_growth_mb", "<", 20.0),
    ("stalls_jsonl", "p99 / median step wall time, commspan + JSONL",
     "stalls.variants.commspan + JSONL.p99_over_median", "<=", 1.3),
    ("stalls_otlp", "p99 / median step wall time, commspan + OTLP/HTTP",
     "stalls.variants.commspan + OTLP/HTTP (local receiver).p99_over_median", "<=", 1.3),
    ("stalls_jsonl_frozen", "p99 / median step wall time, commspan + JSONL, gc.freeze()",
     "stalls.variants.commspan + JSONL, heap frozen first.p99_over_median", "<=", 1.3),
    ("stalls_otlp_frozen", "p99 / median step wall time, commspan + OTLP/HTTP, gc.freeze()",
     "stalls.variants.commspan + OTLP/HTTP, heap frozen first.p99_over_median", "<=", 1.3),
    ("timing_functional", "collective timing, µs added per functional collective (CPU)",
     "timing.kinds.functional.added_us", "<=", 1.0),
    ("timing_c10d", "collective timing, µs added per blocking c10d collective (CPU)",
     "timing.kinds.c10d_blocking.added_us", "<=", 1.0),
    ("timing_c10d_async", "collective timing, µs added per async c10d collective (CPU)",
     "timing.kinds.c10d_async.added_us", "<=", 1.0),
]


def _lookup(results: dict[str, Any], path: str) -> Any:
    node: Any = results
    for part in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, desc, path, op, threshold in TARGETS:
        value = _lookup(results, path)
        if not isinstance(value, (int, float)) or math.isnan(value):
            verdict = "n/a"
        elif op == "<=":
            verdict = "PASS" if value <= threshold else "FAIL"
        elif op == "<":
            verdict = "PASS" if value < threshold else "FAIL"
        else:
            verdict = "PASS" if value >= threshold else "FAIL"
        if verdict == "PASS" and op != ">=" and value < 0:
            verdict = "PASS (noise: below 0)"  # a cost cannot be negative: noise
        if key == "rss_growth" and isinstance(results.get("memory"), dict):
            steps = results["memory"].get("steps")
            if steps:
                desc = f"RSS growth over {steps:,} traced steps, commspan + JSONL (MB)"
        offline = results.get("offline")
        if key.startswith("offline_") and isinstance(offline, dict) and offline.get("files"):
            # the rank files generated (--quick: 64), not the full run's 1,024
            desc = desc.replace(
                "1,024 ranks x 20 steps",
                f"{offline['files']:,} ranks x {offline.get('steps', 20):,} steps")
        out.append(
            {"target": key, "description": desc, "value": value, "op": op,
             "threshold": threshold, "verdict": verdict}
        )
    return out


def _table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(headers)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ) + " |"

    sep = "|" + "|".join(
        ("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)
    ) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def _f(value: Any, fmt: str = "{:.1f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return fmt.format(value)


def _step_section(step: dict[str, Any]) -> str:
    cfg = step["config"]
    plan = step["plan"]
    head = (
        f"Step time: {step['world_size']} ranks over {step['backend']}, TP Transformer dim "
        f"{cfg['dim']}, {cfg['n_heads']} heads, {cfg['n_layers']} layers (checkpoint every "
        f"{cfg['checkpoint_every']}nd), vocab {cfg['vocab']}, seq {cfg['seq']}, batch "
        f"{cfg['batch']}; {'with' if plan['optimizer'] else 'no'} optimizer step; "
        f"{step['rounds_measured']} rounds x {plan['steps_per_round']} steps per variant "
        f"after {plan['warmup']} warm-up rounds; medians over rounds and ranks"
    )
    rows = []
    for v in step["variants"].values():
        rows.append([
            v["label"],
            _f(v["cpu_ms_median"]),
            f"{_f(v['cpu_ms_min'])}–{_f(v['cpu_ms_max'])}",
            _f(v["wall_ms_median"]),
            _f(v.get("cpu_ratio"), "×{:.3f}"),
            _f(v.get("wall_ratio"), "×{:.3f}"),
            # summarize() gives the fraction to the rows it applies to
            _f(v["cpu_above_floor_vs_cdm"], "{:.2f}") if "cpu_above_floor_vs_cdm" in v else "",
            _f(v["wall_above_floor_vs_cdm"], "{:.2f}") if "wall_above_floor_vs_cdm" in v else "",
        ])
    table = _table(
        ["variant", "CPU ms/step", "CPU min–max", "wall ms/step", "CPU ratio",
         "wall ratio", "above floor / CDM (CPU)", "(wall)"],
        rows,
    )
    notes = []
    if step.get("unavailable"):
        notes.append("not run: " + "; ".join(f"{k}: {v}" for k, v in step["unavailable"].items()))
    otlp = step.get("otlp_receiver") or {}
    if otlp.get("requests"):
        notes.append(
            f"OTLP receiver: {otlp['requests']} requests, {otlp['bytes'] / 1e6:.1f} MB received"
        )
    s0 = step.get("variant_stats_rank0", {}).get("cs_jsonl") or {}
    if s0.get("steps_traced"):
        notes.append(
            f"rank 0, commspan + JSONL: {s0['spans'] / s0['steps_traced']:.0f} spans and "
            f"{s0['collectives'] / s0['steps_traced']:.0f} collectives per traced step"
            f", {s0.get('spans_dropped', 0)} spans dropped"
        )
    return "\n".join([head, "", table, *([""] + notes if notes else [])])


def _export_section(export: dict[str, Any]) -> str:
    j, f = export["jsonl"], export["from_jsonl"]
    rows = [
        ["JsonlSpanExporter.export, one step per batch", f"{j['spans_per_s']:,.0f} spans/s",
         f"{j['batch_spans']} spans/batch, {j['bytes_per_span']:.0f} B/span, "
         f"wall {j['spans_per_wall_s']:,.0f} spans/s"],
        ["JsonlSpanExporter.export, large batches", f"{j['large_spans_per_s']:,.0f} spans/s",
         f"{j['large_batch_spans']} spans/batch, wall {j['large_spans_per_wall_s']:,.0f} spans/s"],
        *([["JsonlSpanExporter(compress=True).export, one step per batch",
            f"{j['gzip_spans_per_s']:,.0f} spans/s",
            f"{j['gzip_bytes_per_step'] / 1e3:,.1f} kB per step against "
            f"{j['bytes_per_step'] / 1e3:,.1f} kB plain "
            f"(×{j['bytes_per_step'] / max(j['gzip_bytes_per_step'], 1):.1f} smaller) "
            f"for {j['gzip_cpu_ms_per_step']:.2f} ms more CPU per step"]]
          if "gzip_bytes_per_step" in j else []),
        *[[f"OTLP/protobuf encoding, {what}: SDK encoder / commspan's",
            f"{e['sdk_spans_per_s']:,.0f} / {e['commspan_spans_per_s']:,.0f} spans/s",
            f"×{e['speedup']:.1f}; {e['batch_spans']} spans/batch, "
            f"{e['bytes_per_span']:.0f} B/span, the same bytes"]
           for what, e in ((w, export.get("otlp_protobuf", {}).get(k))
                           for w, k in (("one step per batch", "one_step"),
                                        ("large batches", "large")))
           if e],
        *([["OTLP/HTTP export to a local receiver, one step per batch: SDK's requests "
            "transport / commspan's",
            f"{h['requests_spans_per_s']:,.0f} / {h['plain_spans_per_s']:,.0f} spans/s",
            f"exporting thread's CPU (encoding and HTTP); {h['ms_saved_per_batch']:.2f} ms "
            "less per batch"]]
          if (h := export.get("otlp_http") or {}).get("plain_http") else []),
        ["Aggregator.from_jsonl", f"{f['events_per_s']:,.0f} events/s",
         f"{f['spans_per_s']:,.0f} spans/s; file of {f['steps']} steps, {f['spans']:,} spans, "
         f"{f['events']:,} events, {f['bytes'] / 1e6:.1f} MB; wall {f['events_per_wall_s']:,.0f} "
         "events/s"],
        *([["Aggregator.from_jsonl, the same file compressed",
            f"{f['gzip_events_per_s']:,.0f} events/s", ""]]
          if "gzip_events_per_s" in f else []),
        *([["JsonlSpanExporter(digest=True).export, one step per batch",
            f"{j['digest_spans_per_s']:,.0f} spans/s",
            f"digest {j['digest_kb_per_step']:,.1f} kB per step, "
            f"{j['digest_cpu_ms_per_step']:.2f} ms more CPU per step than plain"],
           ["Aggregator.from_jsonl, the same file compressed, with its digest",
            f"{f['digest_events_per_s']:,.0f} events/s", "JsonlSpanExporter(digest=True)"]]
          if "digest_events_per_s" in f else []),
        ["  ceiling: orjson.loads of the same lines only",
         f"{f['parse_only_events_per_s']:,.0f} events/s",
         f"{f['parse_only_mb_per_s']:,.0f} MB/s of OTLP/JSON; "
         f"{f['bytes'] / max(f['events'], 1) / 1e3:.1f} kB of JSON per collective event"],
    ]
    head = (
        f"Exporter throughput: spans of {export['captured_steps']} real traced steps "
        f"({export['spans_per_step']:.0f} spans, {export['events_per_step']:.0f} collective "
        f"events per step; fake process group, world 4, one thread); rates per CPU second, "
        f"best of {export['repeats']} timed passes"
    )
    return "\n".join([head, "", _table(["what", "rate", "details"], rows, right={1})])


def _memory_section(memory: dict[str, Any]) -> str:
    rows = []
    for v in memory["variants"].values():
        if v.get("error"):
            rows.append([v["label"], "–", "–", "–", "–", "–", v["error"].splitlines()[0][:80]])
            continue
        rows.append([
            v["label"],
            f"{v['steps_done']}",
            _f(v["rss_after_warmup_mb"]),
            _f(v["rss_end_mb"]),
            _f(v["growth_mb"], "{:+.1f}"),
            _f(v.get("projected_growth_mb"), "{:+.1f}"),
            f"{v['ms_per_step']:.1f} ms/step" + (f"; {v['note']}" if v.get("note") else ""),
        ])
    cfg = memory["config"]
    head = (
        f"Memory: RSS of one process (fake process group, world 4), TP Transformer dim "
        f"{cfg['dim']}, {cfg['n_layers']} layers; {memory['warmup_steps']} warm-up steps, then "
        f"{memory['steps']} steps; RSS read after gc.collect(); a run stopped by its time cap "
        f"is projected linearly to {memory['steps']} steps"
    )
    table = _table(
        ["variant", "steps", "RSS after warm-up MB", "RSS at end MB", "growth MB",
         f"growth over {memory['steps']} steps MB", "notes"],
        rows, right={1, 2, 3, 4, 5},
    )
    return "\n".join([head, "", table])


def _profile_section(profile: dict[str, Any]) -> str:
    rows = [
        [r["function"], f"{r['cumtime_ms_per_step']:.2f}", f"{r['tottime_ms_per_step']:.2f}",
         f"{r['calls_per_step']:.0f}"]
        for r in profile["top"]
    ]
    head = (
        f"Where commspan's time goes (cProfile, one process, fake PG, commspan + JSONL, "
        f"{profile['steps']} traced steps. CPU per step: untraced "
        f"{profile['untraced_ms_per_step']:.1f} ms, traced "
        f"{profile['unprofiled_ms_per_step']:.1f} ms, "
        f"traced under the profiler {profile['profiled_ms_per_step']:.1f} ms; the times below are "
        f"per step and inflated by the profiler; cumulative time of __torch_dispatch__ includes "
        f"running the op itself; cProfile sees the training thread only, so JSONL encoding in "
        f"the export thread is not here: see the export section)"
    )
    table = _table(["commspan function", "cum ms", "own ms", "calls"], rows)
    d = profile.get("decomposition_cpu_ms_per_step") or {}
    split = ""
    if {"none", "floor", "cs_jsonl"} <= set(d):
        drows = [
            [label, f"{d[k]['ms']:.1f}", f"{d[k]['delta_ms']:+.1f}", f"×{d[k]['ratio']:.3f}"]
            for k, label in (("none", "no mode"), ("none_aa", "no mode again (A/A)"),
                             ("floor", "pass-through floor"),
                             ("floor_hooks", "floor + module/grad hooks doing nothing"),
                             ("floor_dm_hooks", "floor as a DebugMode + hooks doing nothing"),
                             ("floor_modtracker", "floor + torch ModTracker"),
                             ("kernels_hooks", "no mode: kernels on the collective ops + hooks"),
                             ("cs_agg", "commspan, aggregator only"),
                             ("cs_jsonl", "commspan + JSONL"),
                             ("cs_sampled_out", "commspan, sampled-out step"))
            if k in d
        ]
        floor, full = d["floor"]["delta_ms"], d["cs_jsonl"]["delta_ms"]
        hooks = ""
        if "floor_hooks" in d and "floor_dm_hooks" in d:
            bare = d["floor_hooks"]["delta_ms"]
            dm = d["floor_dm_hooks"]["delta_ms"]
            hooks = (
                f"; of that, torch's module and gradient hooks alone (doing nothing) cost "
                f"{bare - floor:+.1f} ms, DTensor reporting to a DebugMode "
                f"{dm - bare:+.1f} ms more, and commspan's recording and JSONL export "
                f"{full - dm:+.1f} ms"
            )
        if "kernels_hooks" in d and "floor_hooks" in d:
            hooks += (
                f"; seeing the collectives through kernels registered on their ops instead of "
                f"a dispatch mode (the same hooks) costs "
                f"{d['kernels_hooks']['delta_ms']:+.1f} ms against the hooked floor's "
                f"{d['floor_hooks']['delta_ms']:+.1f} ms"
            )
        if "none_aa" in d:
            hooks += (
                f" (the A/A row, {d['none_aa']['delta_ms']:+.1f} ms, shows how large a "
                f"difference noise alone makes)"
            )
        split = (
            f"One rank's step, split (one process, fake PG, {profile['decomposition_rounds']} "
            f"interleaved rounds of one step; CPU per step, median; 'vs no mode' and ratio are "
            f"medians of same-round differences): the floor costs {floor:+.1f} ms, commspan + "
            f"JSONL {full - floor:+.1f} ms above it{hooks}\n\n"
            + _table(["variant", "CPU ms/step", "vs no mode ms", "ratio"], drows) + "\n\n"
        )
    pk = [[k, f"{v:.1f}"] for k, v in profile["own_ms_per_step_by_package"].items()]
    by_pkg = _table(["own time per step, by package (profiled)", "ms"], pk)
    return split + "\n".join([head, "", table, "", by_pkg])


def _labels_section(labels: dict[str, Any]) -> str:
    pair = labels["pair_us"]
    rows = [[k, _f(v, "{:.2f}")] for k, v in pair.items()]
    steps = labels["fsdp_step_ms"]
    return (
        "record_function labels (how commspan finds FSDP2's units)\n\n"
        + _table(["one with record_function(...) pair under", "us"], rows, right={1})
        + f"\n\nlabel tracking: {labels['label_pair_cost_us']:.2f} us per pair; an FSDP2 step "
        f"opens {labels['fsdp_labels_per_step']} labels and costs "
        f"{steps['labels']:.2f} ms CPU traced vs {steps['no_labels']:.2f} ms without label "
        f"tracking: {labels['fsdp_label_cost_ms_per_step']:.3f} ms "
        f"({labels['fsdp_label_cost_share']:.1%}) per step"
    )


def _timing_section(data: dict[str, Any]) -> str:
    rows = [
        [kind, _f(v["us_per_collective_no_mode"]), _f(v["us_per_collective_untimed"]),
         _f(v["us_per_collective_timed"]), _f(v["added_us"], "{:.2f}"),
         _f(v.get("opcodes_untimed", float("nan")), "{:.0f}"),
         _f(v.get("opcodes_added", float("nan")), "{:+.0f}")]
        for kind, v in data["kinds"].items()
    ]
    return (
        f"Collective timing: CPU µs per collective on the training thread (one process, fake "
        f"process group, a module per collective; median of {data['rounds']} rounds of "
        f"{data['calls']:,} calls), and Python bytecodes per collective (deterministic)\n\n"
        + _table(["collective", "no mode", "timing off", "timing on", "added",
                  "bytecodes off", "bytecodes added"], rows)
    )


def _stalls_section(data: dict[str, Any]) -> str:
    base = data["variants"].get("no mode", {}).get("p99_ms")
    rows = [
        [name, _f(v["median_ms"]), _f(v["p99_ms"]), _f(v["max_ms"]),
         _f(v["p99_over_median"], "×{:.2f}"),
         _f(v["p99_ms"] / base if base else float("nan"), "×{:.2f}"),
         # older result files have no garbage-collection columns
         f"{v['full_gc']} (longest {v['full_gc_max_ms']:.0f} ms)" if "full_gc" in v else "–",
         f"{v['full_gc_in_worst_ms']:.0f} ms" if "full_gc" in v else "–"]
        for name, v in data["variants"].items()
    ]
    return (
        f"Stalls: wall ms per step, {data['steps']} steps per variant in one entered mode "
        "(one process, fake process group; export runs beside the steps, never flushed "
        "in between); full garbage collections during the steps, and how much of the "
        "worst step was one\n\n"
        + _table(["variant", "median", "p99", "worst", "p99 / median", "p99 / no mode's",
                  "full GCs", "full GC in worst"], rows)
    )


def _offline_section(data: dict[str, Any]) -> str:
    rows = [
        [name, f"{c['seconds']:.1f} s", f"CPU {c['cpu_seconds']:.1f} s, peak RSS "
         f"{c['peak_rss_mb']:,.0f} MB, exit {c['status']}"
         + (f", wrote {c['output_mb']:,.1f} MB" if c.get("output_mb") is not None else "")]
        for name, c in data["commands"].items()
    ]
    f = data["from_jsonl"]
    rows.append(["Aggregator.from_jsonl(rank='all')", f"{f['seconds']:.1f} s",
                 f"{f['events']:,} collective events, {f['events_per_s']:,.0f} events/s"])
    w = data["without_digests"]
    rows.append([f"summary without digests, {w['ranks']} ranks", f"{w['summary']['seconds']:.1f} s",
                 f"peak RSS {w['summary']['peak_rss_mb']:,.0f} MB; projected to "
                 f"{data['world']} ranks: {w['projected_seconds']:,.0f} s"])
    lines = w.get("summary_no_digest")  # (not in results older than 2026-11-29)
    if lines is not None:
        rows.append([f"summary --no-digest, {w['ranks']} ranks", f"{lines['seconds']:.1f} s",
                     f"peak RSS {lines['peak_rss_mb']:,.0f} MB; projected to "
                     f"{data['world']} ranks: {w['projected_seconds_no_digest']:,.0f} s"])
    g = data["generate_seconds"]
    head = (
        f"Offline at scale: {data['files']} rank files x {data['steps']} steps "
        f"({data['jsonl_gz_mb']:,.0f} MB of compressed JSONL, {data['digest_mb']:,.0f} MB of "
        f"digests; generated in {g['base_ranks'] + g['rank_files_and_digests']:.0f} s, "
        "benchmarks/offline.py says how)"
    )
    return "\n".join([head, "", _table(["what", "time", "details"], rows, right={1})])


def _tracesize_section(data: dict[str, Any]) -> str:
    worlds = data["worlds"]
    kinds = list(next(iter(worlds.values()))["step_bytes"]) if worlds else []
    rows = [
        [f"{int(w):,}", f"{v['bytes_per_rank_step'] / 1e3:,.0f} kB",
         f"{v.get('gzip_bytes_per_rank_step', float('nan')) / 1e3:,.0f} kB",
         str(v["collectives"]),
         *(f"{v['step_bytes'][k] / 1e6:,.1f} MB ({v['traced_ranks'][k]:,})" for k in kinds),
         f"{v.get('gzip_step_bytes_all', float('nan')) / 1e6:,.1f} MB"]
        for w, v in worlds.items()
    ]
    return (
        f"Trace size per step: rank 0 of TP {data['tp']} x FSDP (world / {data['tp']}) on the "
        "fake process group, the step section's model; one traced step to JSONL, times the "
        "ranks that trace (in brackets)\n\n"
        + _table(["world", "per rank", "per rank, gzip", "collectives", *kinds,
                  "all ranks, gzip"], rows)
    )


def format_report(results: dict[str, Any]) -> str:
    parts = []
    machine = results.get("machine", {})
    parts.append(
        f"commspan benchmarks — {machine.get('cpu_model', '?')}, {machine.get('nproc', '?')} "
        f"cores, torch {machine.get('torch', '?')}, python {machine.get('python', '?')}, "
        f"commspan {machine.get('commspan', '?')} ({machine.get('git', '?')}); "
        f"mode {results.get('mode', '?')}"
    )
    if results.get("mode") == "quick":
        parts[-1] += "\nquick mode: a smoke run; too few rounds and steps for numbers to mean much"
    load = machine.get("load_average_at_start")
    if load:
        parts[-1] += (
            f"\nload average (1 min) at start {load[0]:.1f}"
            + (f", at end {machine['load_average_at_end'][0]:.1f}"
               if machine.get("load_average_at_end") else "")
            + " (other work on the machine adds noise; the A/A row shows how much)"
        )
    for name, fn in (("step", _step_section), ("export", _export_section),
                     ("memory", _memory_section), ("profile", _profile_section),
                     ("labels", _labels_section), ("timing", _timing_section),
                     ("stalls", _stalls_section),
                     ("tracesize", _tracesize_section), ("offline", _offline_section)):
        if name in results:
            data = results[name]
            if isinstance(data, dict) and data.get("error"):
                parts.append(f"{name}: ERROR\n{data['error']}")
                continue
            try:
                parts.append(fn(data))
            except Exception as exc:  # a report bug must not lose the measurements
                parts.append(f"{name}: cannot format ({type(exc).__name__}: {exc}); see the JSON")
    targets = results.get("targets") or []
    if targets:
        rows = [
            [t["description"], _f(t["value"], "{:,.3f}" if abs(t["value"] or 0) < 100 else
                                  "{:,.0f}") if isinstance(t["value"], (int, float)) else "–",
             f"{t['op']} {t['threshold']:,g}", t["verdict"]]
            for t in targets
        ]
        parts.append(
            "Targets (issues 4, 11 and 13, one run; a measurement, never a failure of this "
            "command)\n\n"
            + _table(["target", "measured", "target", "verdict"], rows, right={1, 2})
        )
    return "\n\n".join(parts) + "\n"
