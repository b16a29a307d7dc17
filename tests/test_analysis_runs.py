"""commspan.analysis.runs: the runs a set of span records holds, one picked, steps kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from commspan import semconv
from commspan.analysis.runs import (
    SelectionError,
    StepPruner,
    StepRange,
    format_numbers,
    list_runs,
    select,
)
from commspan.otlpjson.records import SpanRecord


def _records(
    run: str | None, steps: range, start: int, ranks: tuple[int, ...] = (0, 1)
) -> list[SpanRecord]:
    """Per rank and step: a rank span (with the step) and a module span in its trace."""
    out = []
    for step in steps:
        trace = f"{run}-{step}"
        for rank in ranks:
            resource = {semconv.RANK: rank} | ({semconv.RUN_ID: run} if run else {})
            t = start + 100 * step
            out.append(SpanRecord(semconv.SPAN_RANK, trace, f"r{rank}", "", t, t + 50,
                                  {semconv.STEP: step, semconv.MODULE_FQN: semconv.GLOBAL_FQN},
                                  rank=rank, resource=resource))
            out.append(SpanRecord("Net forward", trace, f"m{rank}", f"r{rank}", t + 1, t + 9,
                                  {semconv.MODULE_FQN: "Net"}, rank=rank, resource=resource))
    return out


def test_one_run_is_kept_whole() -> None:
    """A single run: every record kept, no note."""
    records = _records("a", range(3), 1000)
    sel = select(records)
    assert sel.records == records and sel.note is None
    assert sel.run is not None and sel.run.describe() == "a (ranks 0-1, steps 0-2)"
    assert sel.steps == (0, 1, 2)


def test_several_runs_pick_the_latest_with_a_note() -> None:
    """Two runs: the one that started last is kept, and the note names both."""
    old, new = _records("old", range(2), 1000), _records("new", range(3), 5000)
    runs = list_runs(new + old)  # in any order
    assert [r.run_id for r in runs] == ["old", "new"]
    assert runs[0].to_dict() == {"run_id": "old", "ranks": [0, 1], "steps": [0, 1],
                                 "spans": 8, "start_ns": 1000, "end_ns": 1150,
                                 "world_size": None, "rank_sample": None,
                                 "missing_ranks": []}
    sel = select(old + new)
    assert sel.records == new
    assert sel.note == ("the files hold 2 runs: old (ranks 0-1, steps 0-1); new (ranks 0-1, "
                        "steps 0-2); showing the latest, new")


def test_run_by_id_or_unique_prefix() -> None:
    """--run takes an id or a start naming one run; an unknown or ambiguous one says so."""
    records = _records("run-a", range(1), 0) + _records("run-b", range(1), 10) + _records(
        "other", range(1), 20)
    assert {r.resource[semconv.RUN_ID] for r in select(records, run="run-a").records} == {
        "run-a"}
    assert select(records, run="o").run.run_id == "other"  # type: ignore[union-attr]
    with pytest.raises(SelectionError) as info:
        select(records, run="run-")
    assert str(info.value) == (
        "run='run-' is not valid: 2 runs start with it (run-a (ranks 0-1, steps 0); run-b "
        "(ranks 0-1, steps 0); other (ranks 0-1, steps 0)); give more of the run id")
    with pytest.raises(SelectionError, match="run='zz' is not valid: no such run in the files"):
        select(records, run="zz")


def test_steps_are_kept_by_trace() -> None:
    """A step range keeps the traces of those steps (module spans included); a range
    holding none of the run's steps is an error naming the steps there are."""
    records = _records("a", range(4), 0)
    sel = select(records, steps=StepRange(1, 2))
    assert sel.steps == (1, 2)
    assert {r.trace_id for r in sel.records} == {"a-1", "a-2"}
    assert len(sel.records) == 8
    assert select(records, steps=StepRange(3, 9)).steps == (3,)
    with pytest.raises(SelectionError, match=r"steps='7' is not valid: not in run a, which has "
                                             r"steps 0-3"):
        select(records, steps=StepRange(7, 7))
    with pytest.raises(SelectionError, match=r"none of them is in run a"):
        select(records, steps=StepRange(5, 9))


def _as_written(records: list[SpanRecord]) -> list[SpanRecord]:
    """Each trace's spans as an exporter writes them: children (which end first)
    before the rank span that names the step."""
    out: list[SpanRecord] = []
    for i in range(0, len(records), 2):
        out += [records[i + 1], records[i]]
    return out


def _hang(run: str, rank: int, step: int, t: int) -> SpanRecord:
    resource = {semconv.RANK: rank, semconv.RUN_ID: run}
    return SpanRecord(semconv.SPAN_HANG, f"{run}-hang-{rank}-{step}", f"h{rank}{step}", "", t,
                      t + 1, {semconv.STEP: step}, rank=rank, resource=resource)


def test_step_pruner_selects_as_select_does_holding_only_the_steps_wanted() -> None:
    """StepPruner (spans added one at a time) gives select()'s Selection, field by
    field, over two runs, other programs' spans, hang records of earlier steps and a
    rank whose last step has no rank span (cut short); while reading it holds the
    spans of the steps wanted, not the run's."""
    old = _as_written(_records("old", range(3), 1000))
    new = _as_written(_records("new", range(40), 9000))
    cut = new[-4:-3] + new[-2:]  # step 39: rank 0 never wrote its rank span
    del new[-4:]
    other = _as_written(_records(None, range(2), 500))
    hangs = [_hang("new", 1, 3, 9350), _hang("new", 0, 20, 11050)]
    records = other + old + new[:20] + hangs[:1] + new[20:] + cut + hangs[1:]
    for run, steps in ((None, StepRange(5, 6)), (None, StepRange(25, 39)), ("old", StepRange(1, 1)),
                       (None, StepRange(39, 39)), ("new", StepRange(0, 0))):
        pruner = StepPruner(steps)
        most = 0
        for rec in records:
            pruner.add(rec)
            most = max(most, pruner.held)
            pruner.compact()  # (a reader does at the end of each file: here, the worst case)
        got, want = pruner.select(run), select(records, run=run, steps=steps)
        assert got.records == want.records, (run, steps)
        assert (got.run, got.runs, got.steps, got.note, got.last_traces) == (
            want.run, want.runs, want.steps, want.note, want.last_traces), (run, steps)
        # at most the steps wanted, the hangs and one step being read, of 90 traces
        wanted = 4 * (steps.last - steps.first + 1)
        assert most <= wanted + len(hangs) + 4 + len(other), (run, steps, most)
    with pytest.raises(SelectionError, match="not in run new, which has steps 0-39"):
        pruner = StepPruner(StepRange(50, 50))
        for rec in records:
            pruner.add(rec)
        pruner.select(None)


def test_spans_without_run_id_form_one_run() -> None:
    """Spans without commspan.run_id (another writer) are one run named ''."""
    sel = select(_records(None, range(1), 0))
    assert sel.run is not None and sel.run.run_id == ""
    assert sel.run.describe() == "(no run id) (ranks 0-1, steps 0)"
    assert select([]).run is None


def test_format_numbers() -> None:
    """Numbers print as compact ranges."""
    assert format_numbers([]) == "-"
    assert format_numbers([5, 3, 4, 3]) == "3-5"
    assert format_numbers((0, 2, 3, 9)) == "0,2-3,9"


def test_load_run_holds_one_lines_spans_at_a_time(
    fake_pg: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_run builds the run as it reads: no more span records are alive at once
    than one line of the file holds (it kept every span of the run in a list, some
    24 times the size of a compressed file), and the run is the one build_run makes
    of all the spans at once; its collectives are the all_reduces the model issued,
    counted here."""
    import gc
    import json
    import weakref

    import torch
    import torch.distributed as dist

    import commspan.analysis.records as records_module
    from commspan import CommSpanMode
    from commspan.analysis import build_run, load_run
    from commspan.exporters import JsonlSpanExporter, read_spans

    issued = 0

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            nonlocal issued
            y = self.lin(x)
            dist.all_reduce(y)
            issued += 1
            return y

    path = tmp_path / "rank0.jsonl"
    net = Net()
    for run_id in ("first", "second"):  # two runs: the second (latest) is read
        mode = CommSpanMode(run_id=run_id, exporters=[JsonlSpanExporter(path)])
        with mode:
            for step in range(6):
                with mode.step(step):
                    net(torch.randn(2, 4))
                mode.flush()  # a line (at least) per step
        mode.shutdown()
        if run_id == "first":
            issued = 0
    lines = path.read_text().splitlines()
    per_line = [sum(len(ss["spans"]) for rs in json.loads(line)["resourceSpans"]
                    for ss in rs["scopeSpans"]) for line in lines]
    assert len(lines) >= 12

    alive = 0
    most = 0

    def gone() -> None:
        nonlocal alive
        alive -= 1

    from commspan.otlpjson.decode import read_spans_in

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal alive, most
        for rec in read_spans_in(*args, **kwargs):
            alive += 1
            most = max(most, alive)
            weakref.finalize(rec, gone)
            yield rec
            gc.collect()

    monkeypatch.setattr(records_module, "read_spans_in", counted)
    run = load_run(path)
    assert most <= max(per_line) + 1, (most, per_line)
    monkeypatch.undo()
    whole = build_run(r for r in read_spans(path) if r.resource.get(semconv.RUN_ID) == "second")
    assert run.collectives == whole.collectives
    assert (run.rank_steps, run.module_spans, run.trace_steps) == (
        whole.rank_steps, whole.module_spans, whole.trace_steps)
    assert len(run.collectives) == issued == 6
