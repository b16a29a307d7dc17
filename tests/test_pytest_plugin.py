"""The pytest plugin: fixtures, the marker and the failure report section (via pytester)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

# A module that issues one all_reduce in forward (over the commspan_fake_pg fixture's group).
_ALL_REDUCE_MODULE = """
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class Reduce(torch.nn.Module):
    def forward(self, x):
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group=dist.group.WORLD))
"""


def _run(pytester: pytest.Pytester, source: str, *args: str,
         subprocess: bool = False) -> pytest.RunResult:
    """Run ``source`` as a test file: in this process, or in a fresh one (``subprocess``:
    where no process group of this session's exists yet)."""
    pytester.makepyfile(helpers=_ALL_REDUCE_MODULE, test_inner=source)
    run = pytester.runpytest_subprocess if subprocess else pytester.runpytest_inprocess
    return run("--strict-markers", "-p", "no:cacheprovider", *args)


def test_capture_fixture_counts_collectives(pytester: pytest.Pytester) -> None:
    """commspan_capture runs the test under an entered mode whose counts the test asserts on."""
    result = _run(pytester, """
import torch
from helpers import Reduce
from commspan.testing import assert_counts

def test_counts(commspan_fake_pg, commspan_capture):
    assert commspan_capture.mode.active
    torch.nn.Linear(2, 2)(Reduce()(torch.ones(1, 2))).sum().backward()
    assert_counts(commspan_capture, "Reduce", "forward", {"all_reduce": 1})
    commspan_capture.assert_no_comm("backward")
""")
    result.assert_outcomes(passed=1)


def test_fixture_order_does_not_change_the_rank(pytester: pytest.Pytester) -> None:
    """commspan_capture listed before commspan_fake_pg still records the fake group's
    rank and world (the mode was entered before the group existed: rank 0 of 1, and
    ``ranks=[1]`` on rank 1 then traced nothing); so does commspan_mode. A test that
    leaves the capture's mode itself tears down cleanly (it raised)."""
    result = _run(pytester, """
import pytest
import torch
from helpers import Reduce
from commspan.testing import assert_counts

@pytest.mark.commspan_fake_pg(world_size=4, rank=1)
@pytest.mark.commspan(ranks=[1])
def test_late_group(commspan_capture, commspan_fake_pg):
    Reduce()(torch.ones(2))
    assert_counts(commspan_capture, "Reduce", "forward", {"all_reduce": 1})
    span = next(s for s in commspan_capture.spans if s.name == "Reduce forward")
    assert (span.resource.attributes["commspan.rank"],
            span.resource.attributes["commspan.world_size"]) == (1, 4)

@pytest.mark.commspan_fake_pg(world_size=4, rank=2)
def test_mode_too(commspan_mode, commspan_fake_pg):
    with commspan_mode:
        assert commspan_mode.resource.attributes["commspan.rank"] == 2

def test_left_by_the_test(commspan_fake_pg, commspan_capture):
    commspan_capture.mode.__exit__(None, None, None)
""", subprocess=True)
    result.assert_outcomes(passed=3)


def test_fake_pg_parametrized_indirectly_takes_each_size(pytester: pytest.Pytester) -> None:
    """parametrize("commspan_fake_pg", [...], indirect=True) runs the test at each world
    size (or dict of arguments), over the marker's; it ran every case at 4 ranks."""
    result = _run(pytester, """
import pytest
import torch.distributed as dist

@pytest.mark.commspan_fake_pg(world_size=4, rank=1)
@pytest.mark.parametrize("commspan_fake_pg,want", [
    (2, (2, 1)), (8, (8, 1)), ({"world_size": 8, "rank": 5}, (8, 5)), ({}, (4, 1)),
], indirect=["commspan_fake_pg"])
def test_sizes(commspan_fake_pg, want):
    assert (dist.get_world_size(), dist.get_rank()) == want == (commspan_fake_pg.size(),
                                                                 dist.get_rank())

@pytest.mark.parametrize("commspan_fake_pg", ["8"], indirect=True)
def test_bad(commspan_fake_pg):
    pass
""", subprocess=True)
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*commspan_fake_pg parameter '8' is not valid; pass a world "
                                 "size (int) or a dict*"])


def test_mode_fixtures_parametrized_indirectly_take_each_case(pytester: pytest.Pytester) -> None:
    """parametrize("commspan_capture" / "commspan_mode", [{...}], indirect=True) gives
    each case's CommSpanMode arguments, over the marker's; they were ignored."""
    result = _run(pytester, """
import pytest

@pytest.mark.commspan(run_id="marker")
@pytest.mark.parametrize("commspan_capture,want", [({"run_id": "a"}, "a"), ({}, "marker")],
                         indirect=["commspan_capture"])
def test_capture(commspan_capture, want):
    assert commspan_capture.mode.run_id == want

@pytest.mark.parametrize("commspan_mode", [{"run_id": "b"}], indirect=True)
def test_mode(commspan_mode):
    with commspan_mode:
        assert commspan_mode.run_id == "b"

@pytest.mark.parametrize("commspan_mode", [False], indirect=True)
def test_bad(commspan_mode):
    pass
""")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*commspan_mode parameter False is not valid; pass a dict*"])


def test_failed_test_reports_module_table(pytester: pytest.Pytester) -> None:
    """A failing test that used commspan_capture gets a "commspan modules" report section."""
    result = _run(pytester, """
import torch
from helpers import Reduce

def test_fails(commspan_fake_pg, commspan_capture):
    Reduce()(torch.ones(2))
    assert commspan_capture.counts("Reduce", "forward") == {}
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*commspan modules*",
        "Global",
        "  *forward: all_reduce 1",
        "  Reduce (Reduce)",
    ])


def test_passing_test_has_no_report_section(pytester: pytest.Pytester) -> None:
    """Passing tests (and tests without the fixture) get no extra section."""
    result = _run(pytester, """
def test_ok(commspan_capture):
    pass

def test_other_fails():
    assert False
""", "-rA")
    result.assert_outcomes(passed=1, failed=1)
    assert "commspan modules" not in result.stdout.str()


def test_mode_fixture_is_fresh_and_left_after_the_test(pytester: pytest.Pytester) -> None:
    """commspan_mode is a new, un-entered mode per test; one left entered is exited afterwards."""
    result = _run(pytester, """
import torch
from commspan import CommSpanMode

seen = []

def test_enter_and_forget(commspan_mode):
    assert isinstance(commspan_mode, CommSpanMode) and not commspan_mode.active
    commspan_mode.__enter__()
    torch.nn.ReLU()(torch.ones(1))
    seen.append(commspan_mode)

def test_previous_mode_was_left(commspan_mode):
    assert seen and not seen[0].active
    assert commspan_mode is not seen[0]
    with commspan_mode:
        torch.nn.ReLU()(torch.ones(1))
    assert commspan_mode.aggregator.modules() == ["ReLU"]
""")
    result.assert_outcomes(passed=2)


def test_marker_passes_mode_arguments(pytester: pytest.Pytester) -> None:
    """@pytest.mark.commspan(...) keyword arguments reach CommSpanMode, closest marker wins."""
    result = _run(pytester, """
import pytest
import torch

pytestmark = pytest.mark.commspan(record_params=True, run_id="module-level")

@pytest.mark.commspan(record_params=False)
def test_no_params(commspan_capture):
    torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert commspan_capture.aggregator.parameter_info() == {}
    assert commspan_capture.mode.run_id == "module-level"

def test_params(commspan_mode):
    with commspan_mode:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert commspan_mode.aggregator.parameter_info()["Linear"]["weight"]["shape"] == "2x2"
""")
    result.assert_outcomes(passed=2)


def test_marker_rejects_positional_arguments(pytester: pytest.Pytester) -> None:
    """A positional marker argument is an error at setup that says to pass keywords."""
    result = _run(pytester, """
import pytest

@pytest.mark.commspan(False)
def test_bad(commspan_capture):
    pass
""")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*TypeError: @pytest.mark.commspan(False,): pass CommSpanMode arguments by keyword*"]
    )


def test_marker_and_parameter_name_an_argument_the_mode_does_not_take(
    pytester: pytest.Pytester,
) -> None:
    """A misspelt mode argument raised CommSpanMode's own TypeError, naming neither the
    marker nor the parametrized fixture it came from."""
    result = _run(pytester, """
import pytest

@pytest.mark.commspan(record_param=False)
def test_marker(commspan_capture):
    pass

@pytest.mark.parametrize("commspan_mode", [{"samples": 2}], indirect=True)
def test_param(commspan_mode):
    pass
""")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines([
        "*TypeError: @pytest.mark.commspan(...): record_param=False is not an argument of "
        "CommSpanMode; did you mean record_params*",
        "*TypeError: commspan_mode parameter: samples=2 is not an argument of CommSpanMode; "
        "did you mean sample*",
    ], consecutive=False)


def test_plugin_is_registered_by_entry_point(pytester: pytest.Pytester) -> None:
    """A fresh pytest process finds the fixtures through the pytest11 entry point alone."""
    pytester.makepyfile(test_fresh="""
def test_fixture(commspan_capture):
    assert commspan_capture.mode.active
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=1)


def test_plugin_loads_by_its_entry_point_name_without_autoload(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the README says: with PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 the fixtures are missing
    until ``-p commspan`` loads the plugin by its entry point's name."""
    pytester.makepyfile(test_fresh="""
def test_fixture(commspan_capture):
    assert commspan_capture.mode.active
""")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(errors=1)
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "commspan").assert_outcomes(
        passed=1)
