"""The examples refuse bad command-line values with one line naming the option, the
value and what to pass (argparse's exit status 2), before any rank starts: no traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _example_run import load_example

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TRAINING = ("tp_transformer", "fsdp2_tp", "pipeline")


def _refused(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> str:
    """The error line of ``examples/NAME.py ARGV`` (exit status 2, nothing started)."""
    module = load_example(EXAMPLES / f"{name}.py")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    started: list[object] = []
    monkeypatch.setattr("torch.multiprocessing.start_processes",
                        lambda *a, **k: started.append(a))
    with pytest.raises(SystemExit) as exc:
        module.main(argv) if name in ("hang_and_straggler", "plan_at_scale") else module.main()
    assert exc.value.code == 2 and not started
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("name", (*TRAINING, "hang_and_straggler"))
def test_out_naming_a_file_is_refused_naming_the_option(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--out FILE (a file where the directory of JSONL files goes), or a directory below a
    file: the error names --out, the value and what to pass; the file is left alone."""
    afile = tmp_path / "notes.txt"
    afile.write_text("keep")
    for out in (afile, afile / "sub"):
        line = _refused(name, ["--out", str(out)], monkeypatch, capsys)
        assert line.endswith(f"error: --out {out}: cannot make this directory ("
                             f"{'File exists' if out == afile else 'Not a directory'}); "
                             "pass a directory, new or existing, you can write to"), line
    assert afile.read_text() == "keep"


@pytest.mark.parametrize("name", TRAINING)
@pytest.mark.parametrize("steps", ("0", "-1"))
def test_steps_below_one_are_refused(
    name: str, steps: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--steps 0 trained nothing and printed an empty table: refused, naming --steps."""
    line = _refused(name, ["--out", str(tmp_path), "--steps", steps], monkeypatch, capsys)
    assert line.endswith(f"error: --steps {steps}: pass 1 or more training steps"), line


@pytest.mark.parametrize(("world", "tp"), (("512", "0"), ("6", "4"), ("4", "8"), ("0", "8")))
def test_plan_world_and_tp_that_make_no_mesh_are_refused(
    world: str, tp: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """--tp 0 planned TP 8 without a word (0 read as "not given"); a world size that is
    not a multiple of --tp raised a traceback from a fake rank: both one line now."""
    line = _refused("plan_at_scale", ["--world", world, "--tp", tp], monkeypatch, capsys)
    assert line.endswith(f"error: --world {world} --tp {tp}: the world size must be a "
                         "positive multiple of the tensor-parallel degree (1 or more), e.g. "
                         "--world 512 --tp 8"), line
