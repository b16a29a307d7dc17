"""tools/run_pytorch_compat_tests.py: bad input, the class swap in the test processes, the table.

PyTorch's own test files are not available here (no package ships them), so the runner is
pointed at a small test file of ours that reports which classes it sees.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


def _runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "run_pytorch_compat_tests", REPO / "tools/run_pytorch_compat_tests.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing directory, an unknown implementation, or no test file found: exit 2 and a
    message naming the argument."""
    runner = _runner()
    assert runner.main([str(tmp_path / "nope")]) == 2
    assert "not a directory; pass PyTorch's test/ directory" in capsys.readouterr().err
    assert runner.main([str(tmp_path), "--impl", "jax"]) == 2
    assert "--impl='jax': use torch, commspan or torch,commspan" in capsys.readouterr().err
    assert runner.main([str(tmp_path)]) == 2
    assert "no test file found under" in capsys.readouterr().err


_PROBE_TEST = '''
import torch.distributed._tools.mod_tracker as mod_tracker
import torch.distributed.tensor.debug as debug


def test_sees_commspan():
    assert debug.CommDebugMode.__module__ == "commspan.compat.comm_debug_mode"
    assert mod_tracker.ModTracker.__module__ == "commspan.compat.mod_tracker"


def test_sees_torch():
    assert debug.CommDebugMode.__module__.startswith("torch.")


def test_unrelated():
    assert True
'''


def test_runs_each_file_on_both_classes(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Each file runs once with torch's classes and once with commspan's (swapped in the
    test process); the table has one row per test and the exit status is 1 because a test
    passes on torch only."""
    tests = tmp_path / "test"
    (tests / "distributed/_tools").mkdir(parents=True)
    (tests / "distributed/_tools/test_mod_tracker.py").write_text(textwrap.dedent(_PROBE_TEST))
    stub = tmp_path / "stub"  # torch.testing._internal imports expecttest; none is needed here
    stub.mkdir()
    (stub / "expecttest.py").write_text("import unittest\n\nTestCase = unittest.TestCase\n")
    table = tmp_path / "results.md"
    code = _runner().main([
        str(tests), "--files", "test_mod_tracker.py", "--python", sys.executable,
        "--extra-path", str(stub), "--markdown", str(table),
    ])
    out = capsys.readouterr().out
    assert code == 1
    assert "pass on torch, not on commspan:\n  test_mod_tracker.py::test_sees_torch" in out
    rows = [row.removeprefix("| test_mod_tracker.py | ") for row in table.read_text().splitlines()]
    assert rows[2].startswith("test_sees_commspan | yes | failed | passed |")
    assert rows[3].startswith("test_sees_torch | yes | passed | failed |")
    assert rows[4].startswith("test_unrelated |  | passed | passed |")
    assert "- torch: failed 1, passed 2" in rows and "- commspan: failed 1, passed 2" in rows
    assert "- commspan (tests using CommDebugMode or ModTracker): failed 1, passed 1" in rows

    code = _runner().main([
        str(tests), "--files", "test_mod_tracker.py", "--impl", "commspan", "--only-users",
        "--python", sys.executable, "--extra-path", str(stub), "--markdown", str(table),
    ])
    assert code == 0  # no torch run to compare with
    assert "test_unrelated" not in table.read_text()
    assert "- commspan: failed 1, passed 1" in table.read_text()
