"""The ``commspan`` command line: table and summary over JSONL files, errors as one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commspan import CommSpanMode
from commspan.cli import _span_list, main
from commspan.exporters import JsonlSpanExporter

STEPS = 2


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = torch.nn.Linear(8, 16)
        self.net2 = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(torch.relu(self.net1(x)))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, fake_pg: None) -> Path:
    """JSONL files of ranks 0 and 1, two steps of a TP MLP each.

    One process writes both: rank 1's file is made by overriding the rank in
    the resource, which is where the files' rank comes from.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    out = tmp_path_factory.mktemp("run")
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = parallelize_module(MLP(), mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    for rank in (0, 1):
        mode = CommSpanMode(
            exporters=[JsonlSpanExporter(out / f"commspan-rank{rank}.jsonl")],
            run_id="cli-test",
            resource_attributes={"commspan.rank": rank},
        )
        with mode:
            for i in range(STEPS):
                with mode.step(i):
                    model(torch.randn(4, 8)).sum().backward()
        mode.shutdown()
    return out


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_one_rank(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`table FILE --rank 0` prints rank 0's module tree with its counts."""
    code, out, err = _cli(capsys, "table", str(run_dir / "commspan-rank0.jsonl"), "--rank", "0")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[:2] == ["Global", f"  *forward: all_reduce {STEPS}"]
    assert "    MLP.net2" in lines
    assert "(Linear)" not in out


def test_table_single_rank_file_needs_no_rank(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file holding one rank needs no --rank."""
    code, out, _ = _cli(capsys, "table", str(run_dir / "commspan-rank1.jsonl"))
    assert code == 0 and out.startswith("Global\n")


def test_table_all_ranks_noise_and_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--rank all` sums ranks; `--noise 1` adds types and placements; `--json` the tree."""
    code, out, _ = _cli(capsys, "table", str(run_dir), "--rank", "all", "--noise", "1")
    assert code == 0
    assert f"*forward: all_reduce {2 * STEPS}" in out
    assert "MLP.net2 (Linear)" in out and "- weight: 8x16 S(1)" in out
    code, out, _ = _cli(capsys, "table", str(run_dir), "--rank", "all", "--json")
    tree = json.loads(out)
    assert tree["fqn"] == "Global"
    assert tree["counts"] == {"forward": {"all_reduce": 2 * STEPS}}
    assert [c["fqn"] for c in tree["children"]] == ["MLP"]


def test_summary_text_and_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`summary` reports spans, traces, ranks, steps and the per-phase op totals."""
    code, out, _ = _cli(capsys, "summary", str(run_dir), "--rank", "all")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["spans:", lines[0].split()[1], "traces:", "2",
                                "ranks:", "0-1", "steps:", "0-1"]
    assert lines[1].split() == ["phase", "op", "count"]
    assert lines[2].split() == ["forward", "all_reduce", str(2 * STEPS)]
    assert lines[-1].split() == ["total", str(2 * STEPS)]
    code, out, _ = _cli(capsys, "summary", str(run_dir), "--rank", "1", "--json")
    data = json.loads(out)
    assert data["ranks"] == [1] and data["steps"] == [0, 1] and data["traces"] == 2
    assert data["collectives"] == {"forward": {"all_reduce": STEPS}} and data["total"] == STEPS
    assert data["spans"] == int(lines[0].split()[1]) // 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["table", "{dir}"], "ValueError: rank=None but the files hold spans of ranks [0, 1]"),
        (["summary", "{dir}"], "ValueError: rank=None but the files hold spans of ranks [0, 1]"),
        (["table", "{dir}", "--rank", "7"],
         "ValueError: --rank 7: the files hold no span of that rank (ranks: 0-1)"),
        (["summary", "{dir}", "--rank", "7"],
         "ValueError: --rank 7: the files hold no span of that rank (ranks: 0-1)"),
        (["table", "{dir}/missing.jsonl"],
         "FileNotFoundError: FILES: '{dir}/missing.jsonl' does not exist"),
        (["table", "{empty}"],
         "FileNotFoundError: FILES: directory '{empty}' holds no *.jsonl file"),
    ],
)
def test_errors_are_one_line(
    run_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    """A user error prints `TypeName: message` on stderr and exits 1, without a traceback."""
    fill = {"dir": str(run_dir), "empty": str(tmp_path)}
    code, out, err = _cli(capsys, *(a.format(**fill) for a in argv))
    assert code == 1 and out == ""
    assert err.startswith(message.format(**fill))
    assert "Traceback" not in err and err.count("\n") == 1


def test_corrupt_line_names_file_and_line(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line that is not JSON (before the last) is reported with its file and line number."""
    bad = tmp_path / "bad.jsonl"
    lines = (run_dir / "commspan-rank0.jsonl").read_bytes().splitlines()
    bad.write_bytes(b"\n".join([b"{not json", *lines]) + b"\n")
    code, _, err = _cli(capsys, "table", str(bad))
    assert code == 1
    assert err.startswith(f"ValueError: {bad}:1: not a JSON line")


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse rejects a bad --rank or a missing command with usage and status 2."""
    for argv in (["table", "x.jsonl", "--rank", "one"], ["table", "x.jsonl", "--rank", "-1"], []):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--rank 'one' is not valid; pass a rank number or 'all'" in err
    assert "--rank '-1' is not valid; ranks are >= 0" in err


def test_console_script(run_dir: Path) -> None:
    """The installed `commspan` script runs main and exits with its status."""
    script = Path(sys.executable).with_name("commspan")
    if not script.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    bad = subprocess.run([str(script), "table", str(run_dir)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 1
    assert bad.stdout == ""
    assert bad.stderr.startswith("ValueError: rank=None")


def test_span_list() -> None:
    """Rank and step lists print as compact ranges."""
    assert _span_list([]) == "-"
    assert _span_list([3]) == "3"
    assert _span_list([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
