"""commspan.analysis.runs: the runs a set of span records holds, one picked, steps kept."""

from __future__ import annotations

import pytest

from commspan import semconv
from commspan.analysis.runs import SelectionError, StepRange, format_numbers, list_runs, select
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
                                 "spans": 8, "start_ns": 1000, "end_ns": 1150}
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
