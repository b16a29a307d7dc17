"""Rank sampling: which ranks trace (``CommSpanMode(ranks=...)``), and what the others do.

The chosen ranks are checked against lists worked out by hand from each rule;
the modes run over the fake process group, with the rank a process plays set
through ``commspan.session.mode.process_ranks`` (one process plays each rank in
turn, writing that rank's file).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _tracing import AllReduceNet

from commspan import CommSpanMode, RankSample, semconv
from commspan.analysis import build_run, check
from commspan.capture.ranks import Ranks
from commspan.exporters import JsonlSpanExporter, read_spans
from commspan.session import mode as mode_module
from commspan.session.sampling import rank_sample
from commspan.testing import fake_mesh


@pytest.mark.parametrize(("share", "world", "expected"), [
    (0.25, 16, [0, 4, 8, 12]),
    (0.5, 5, [0, 2, 4]),
    (0.3, 10, [0, 4, 7]),
    (1.0, 3, [0, 1, 2]),
    (0.01, 8, [0]),
])
def test_fraction_spreads_evenly_from_rank_0(share: float, world: int,
                                             expected: list[int]) -> None:
    assert RankSample.fraction(share).chosen(world) == expected


def test_fraction_of_a_big_world() -> None:
    chosen = RankSample.fraction(1 / 8).chosen(4096)
    assert len(chosen) == math.floor(4095 / 8) + 1 == 512
    assert {b - a for a, b in zip(chosen, chosen[1:])} == {8}


def test_explicit_ranks_and_all() -> None:
    assert RankSample.of({3, 0}).chosen(6) == [0, 3]
    assert RankSample.of([0, 3]).description == "ranks 0,3"
    assert RankSample.all().chosen(3) == [0, 1, 2]


def test_one_per_group_of_a_mesh_dimension(fake_pg: None) -> None:
    """On a (dp 2, tp 2) mesh of ranks [[0, 1], [2, 3]]: one per tp group is the
    ranks with tp coordinate 0, [0, 2]; one per dp group, [0, 1]."""
    mesh = fake_mesh((2, 2), names=("dp", "tp"))
    assert RankSample.one_per_group(mesh, "tp").chosen(4) == [0, 2]
    assert RankSample.one_per_group(mesh, "dp").chosen(4) == [0, 1]
    assert RankSample.one_per_group(mesh, 1).description == "one per tp group"
    with pytest.raises(ValueError, match="dim='pp' is not a dimension of the mesh"):
        RankSample.one_per_group(mesh, "pp")


@pytest.mark.parametrize(("value", "error", "match"), [
    (3, TypeError, r"ranks=3 is not valid; pass a set of ranks \(\[3\]\)"),
    ("0,1", TypeError, "ranks='0,1' is not valid"),
    (1.5, ValueError, "ranks=1.5 is not a valid fraction"),
    (0.0, ValueError, "not a valid fraction"),
    ([], ValueError, "ranks is empty"),
    ([0, -1], ValueError, "-1 is not a rank"),
])
def test_bad_values_name_the_argument(value: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        rank_sample(value)
    with pytest.raises(error, match=match):
        CommSpanMode(ranks=value)


def _play(out: Path, world: int, ranks: Any, monkeypatch: pytest.MonkeyPatch,
          dump: bool = False) -> list[Any]:
    """Each rank of ``world`` in turn, 2 steps, its own JSONL file (and, with ``dump``, a
    ``mode.dump()`` after them); returns the modes."""
    modes = []
    for rank in range(world):
        monkeypatch.setattr(mode_module, "process_ranks", lambda r=rank: Ranks(r, r, world))
        mode = CommSpanMode(run_id="sampled", ranks=ranks,
                            exporters=[JsonlSpanExporter(out / f"rank{rank}.jsonl")])
        traced = []
        with mode:
            for step in range(2):
                with mode.step(step) as on:
                    traced.append(on)
                    AllReduceNet()(torch.randn(2, 4))
            if dump:
                assert mode.dump()
        mode.shutdown()
        modes.append((mode, traced))
    return modes


def test_ranks_left_out_record_nothing_and_check_expects_only_the_traced(
    fake_pg: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ranks=[0, 2] of 4: ranks 1 and 3 trace no step and export no span, not even the
    record of a ``mode.dump()`` (one made check report them missing); the traced
    ranks' resources name the rule; ``commspan check`` finds nothing missing."""
    modes = _play(tmp_path, 4, [0, 2], monkeypatch, dump=True)
    for rank, (mode, traced) in enumerate(modes):
        exported = mode.stats()["spans"]
        if rank in (0, 2):
            assert traced == [True, True] and exported > 0
        else:
            assert traced == [False, False] and exported == 0
            assert mode.stats()["collectives"] == 0
    spans = list(read_spans(*sorted(tmp_path.glob("*.jsonl")), strict=False))
    assert {s.resource.get(semconv.RANK) for s in spans} == {0, 2}
    assert {s.resource.get(semconv.SAMPLING_RANKS) for s in spans} == {"ranks 0,2"}
    result = check(build_run(spans))
    assert result.ok, [f.message for f in result.findings]
    assert result.checked["ranks"] == 2


def test_without_sampling_a_rank_without_spans_is_missing(
    fake_pg: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference for the test above: the same files without the rule in their
    resources (all ranks traced, ranks 1 and 3 lost) are missing ranks."""
    _play(tmp_path, 4, None, monkeypatch)
    for rank in (1, 3):
        (tmp_path / f"rank{rank}.jsonl").unlink()
    spans = list(read_spans(*sorted(tmp_path.glob("*.jsonl")), strict=False))
    assert all(semconv.SAMPLING_RANKS not in s.resource for s in spans)
    (finding,) = check(build_run(spans)).findings
    assert finding.kind == "missing" and sorted(finding.ranks) == [1, 3]


def test_an_empty_step_set_says_so_and_numpy_fractions_of_any_width_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """sample=[] traces no step: a warning says so (it was silent); ranks= takes a
    numpy float32 fraction as it takes a float64 one (it raised TypeError)."""
    import numpy as np

    CommSpanMode(sample=[])
    assert "sample=[] names no step: no step is traced" in caplog.text
    for share in (np.float32(0.5), np.float64(0.5), 0.5):
        chosen = [r for r in range(8) if rank_sample(share).traces(r, 8)]
        assert chosen == [0, 2, 4, 6], share


@pytest.mark.parametrize("digest", [False, True])
def test_counts_over_a_rank_sample_say_they_cover_the_traced_ranks_only(
    fake_pg: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], digest: bool,
) -> None:
    """ranks=0.5 of 4: summary's total is the all_reduces of ranks 0 and 2 (counted
    here, 2 steps each), and it says so: ``ranks: 0,2 of 4 (traced: fraction 0.5)``
    and, in JSON, ``world_size`` and ``rank_sample``; every reading command says on
    stderr that what it shows covers those ranks only (it read as the whole job)."""
    from commspan.cli import main

    modes = _play(tmp_path, 4, 0.5, monkeypatch)
    traced = [rank for rank, (_, on) in enumerate(modes) if any(on)]
    assert traced == [0, 2]
    if digest:
        assert main(["digest", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["summary", str(tmp_path), "--rank", "all"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split("   ")[2] == "ranks: 0,2 of 4 (traced: fraction 0.5)"
    assert out.splitlines()[-1].split() == ["total", str(2 * len(traced))]
    covers = "ranks 0,2 of 4 traced (rank sample: fraction 0.5): what follows covers those"
    assert covers in err
    assert main(["summary", str(tmp_path), "--rank", "all", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["world_size"], data["rank_sample"], data["total"]) == (
        4, "fraction 0.5 (ranks 0,2)", 4)
    assert (data["runs"][0]["world_size"], data["runs"][0]["rank_sample"]) == (
        4, "fraction 0.5 (ranks 0,2)")
    for command in (["check"], ["stragglers"], ["table", "--rank", "all"]):
        main([*command, str(tmp_path)])
        assert covers in capsys.readouterr().err, command
    # every rank traced: nothing of the kind
    for f in tmp_path.iterdir():
        f.unlink()
    _play(tmp_path, 4, None, monkeypatch)
    assert main(["summary", str(tmp_path), "--rank", "all"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split("   ")[2] == "ranks: 0-3"
    assert "traced" not in err


@pytest.mark.parametrize("rule", ["fraction", "one_per_group"])
def test_a_rank_a_fraction_or_one_per_group_chose_that_wrote_nothing_is_missing(
    fake_pg: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rule: str,
) -> None:
    """ranks=0.5 of 4 (ranks 0, 2) or one per dp group of a (dp 2, tp 2) mesh (ranks 0,
    1), and the second traced rank's file lost: check reports it missing (it said
    "consistent": only a sample of given ranks named its ranks), and not the ranks
    the rule left out. The traced ranks' resources name the ranks with the rule."""
    if rule == "fraction":
        ranks: Any = 0.5
    else:
        ranks = RankSample.one_per_group(fake_mesh((2, 2), names=("dp", "tp")), "dp")
    modes = _play(tmp_path, 4, ranks, monkeypatch)
    traced = [rank for rank, (_, on) in enumerate(modes) if any(on)]
    assert traced == ([0, 2] if rule == "fraction" else [0, 1])
    lost = traced[1]
    (tmp_path / f"rank{lost}.jsonl").unlink()
    spans = list(read_spans(*sorted(tmp_path.glob("*.jsonl"))))
    (finding,) = check(build_run(spans)).findings
    assert finding.kind == "missing" and list(finding.ranks) == [lost]
    words = {s.resource.get(semconv.SAMPLING_RANKS) for s in spans}
    assert words == {"fraction 0.5 (ranks 0,2)" if rule == "fraction"
                     else "one per dp group (ranks 0-1)"}


def test_the_html_report_of_a_rank_sample_says_it_covers_the_traced_ranks_only(
    fake_pg: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The page is read away from the command's stderr: its header says which ranks of
    the job traced (it said "2 ranks", and its counts read as the whole job's)."""
    from commspan.cli import main

    out = tmp_path / "run"
    _play(out, 4, 0.5, monkeypatch)
    assert main(["html", str(out), "-o", str(tmp_path / "report.html")]) == 0
    page = (tmp_path / "report.html").read_text()
    assert ("Ranks 0,2 of 4 traced (rank sample: fraction 0.5): the counts, bytes and "
            "timeline below cover those ranks only.") in page
    for f in out.iterdir():
        f.unlink()
    _play(out, 4, None, monkeypatch)
    assert main(["html", str(out), "-o", str(tmp_path / "report.html")]) == 0
    assert "traced (rank sample" not in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize(("ranks", "lost", "said"), [
    (None, (1, 2, 3), "ranks 1-3 of 4 wrote no spans (no file of theirs read): {} rank 0 "
     "only"),
    (None, (1, 3), "ranks 1,3 of 4 wrote no spans (no file of theirs read): {} ranks "
     "0,2 only"),
    (0.5, (2,), "ranks 0,2 of 4 traced (rank sample: fraction 0.5), and rank 2 of them "
     "wrote no spans (no file of theirs read): {} rank 0 only"),
], ids=["ranks-1-3-lost", "ranks-1,3-lost", "sampled-rank-2-lost"])
@pytest.mark.parametrize("digest", [False, True])
def test_every_reader_names_the_ranks_of_the_job_that_wrote_no_file(
    fake_pg: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], ranks: Any, lost: tuple[int, ...], said: str,
    digest: bool,
) -> None:
    """4 ranks wrote their files (of a rank sample: the ranks it chose) and the files of
    ``lost`` are deleted: every reading command names those ranks on stderr, as it
    names a rank sample's (html, perfetto, table and stragglers said nothing: the page
    said "1 ranks" and its counts read as the job's), the page's header says it, and
    summary --json lists them (``missing_ranks``); check reports them missing, not in
    a note. The same files with none deleted: nothing of the kind."""
    from commspan.cli import main

    run = tmp_path / "run"
    _play(run, 4, ranks, monkeypatch)
    for rank in lost:
        (run / f"rank{rank}.jsonl").unlink()
    if digest:
        assert main(["digest", str(run)]) == 0
    page = tmp_path / "report.html"
    commands = [["summary", "--rank", "all"], ["table", "--rank", "all"], ["stragglers"],
                ["perfetto", "-o", str(tmp_path / "t.json")], ["html", "-o", str(page)]]
    capsys.readouterr()
    for command in commands:
        assert main([*command, str(run)]) == 0, command
        err = capsys.readouterr().err
        assert f"commspan: {said.format('what follows covers')}" in err, (command, err)
    warning = f"{said.format('the counts, bytes and timeline below cover')}."
    assert f"{warning[0].upper()}{warning[1:]}" in page.read_text()
    assert main(["summary", str(run), "--rank", "all", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["missing_ranks"], data["runs"][0]["missing_ranks"]) == ([*lost], [*lost])
    assert main(["check", str(run), "--json"]) == 1
    out, err = capsys.readouterr()
    findings = json.loads(out)["findings"]
    assert [(f["kind"], sorted(map(int, f["ranks"]))) for f in findings] == [
        ("missing", [*lost])]
    assert "wrote no spans" not in err
    # the whole job's files: no note, no warning
    for f in run.iterdir():
        f.unlink()
    _play(run, 4, ranks, monkeypatch)
    if digest:
        assert main(["digest", str(run)]) == 0
    capsys.readouterr()
    for command in [*commands, ["check"]]:
        main([*command, str(run)])
        assert "wrote no spans" not in capsys.readouterr().err, command
    assert "wrote no spans" not in page.read_text()
    assert main(["summary", str(run), "--rank", "all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_ranks"] == []
