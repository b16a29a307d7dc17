"""pytest plugin: commspan's fixtures, registered through the ``pytest11`` entry point.

This module only wires :mod:`commspan.testing` into pytest; the behaviour lives
there. Fixtures:

* ``commspan_capture``: the test body runs under a fresh, entered
  ``CommSpanMode``; yields a :class:`commspan.testing.CommCapture` to assert on.
  Fixtures set up after it run under the mode too: list a model-building
  fixture before it (``def test(tp_model, commspan_capture)``).
  When a test using it fails, the report gets a "commspan modules" section
  with the module table.
* ``commspan_mode``: a fresh ``CommSpanMode``, not entered (``with
  commspan_mode:`` in the test); left and shut down after the test.
* ``commspan_fake_pg``: torch's fake process group as the default group for
  the test (:func:`commspan.testing.fake_process_group`), 4 ranks of which
  this process is rank 0 unless ``@pytest.mark.commspan_fake_pg(world_size=8,
  rank=3)`` says otherwise; yields the world group. To run a test at several
  sizes, parametrize the fixture itself:
  ``@pytest.mark.parametrize("commspan_fake_pg", [2, 4, 8], indirect=True)``
  (a world size, or a dict of arguments such as ``{"world_size": 8, "rank": 3}``;
  it overrides the marker's).

The first two take ``CommSpanMode`` arguments from a marker (or, parametrized
indirectly, from a dict per case, over the marker's)::

    @pytest.mark.commspan(record_params=False)
    def test_tp_forward(commspan_capture):
        model(x)
        commspan_capture.assert_counts("MLP.net2", "forward", {"all_reduce": 1})

Option ``--commspan-update-golden``: :func:`commspan.testing.assert_matches_golden`
writes the golden files instead of comparing them; the files written are
listed at the end of the run.

commspan itself is imported only when a fixture or the option is used.

The entry point is named ``commspan``: ``-p no:commspan`` disables the plugin, and
with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` ``-p commspan`` loads it. Naming this
module as well (``-p commspan.testing.plugin``, ``pytest_plugins``) while the entry
point loads it makes pytest stop ("Plugin already registered under a different name").
"""

from __future__ import annotations

import sys
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from commspan import CommSpanMode
    from commspan.testing import CommCapture

_MARKER = "commspan"
_PG_MARKER = "commspan_fake_pg"
_SECTION = "commspan modules"
_UPDATE_OPTION = "--commspan-update-golden"
_GOLDEN = pytest.StashKey[tuple[Any, list[Any]]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--commspan-update-golden``."""
    parser.getgroup("commspan").addoption(
        _UPDATE_OPTION,
        action="store_true",
        default=False,
        help="write commspan golden files (commspan.testing.assert_matches_golden) "
             "instead of comparing them",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Declare the markers (so ``--strict-markers`` accepts them); with
    ``--commspan-update-golden``, switch golden files to update mode for the run."""
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(**kwargs): CommSpanMode arguments for the commspan_capture and "
        "commspan_mode fixtures",
    )
    config.addinivalue_line(
        "markers",
        f"{_PG_MARKER}(world_size=4, rank=0): size of the commspan_fake_pg fixture's "
        "fake process group and the rank this process plays",
    )
    if config.getoption(_UPDATE_OPTION, default=False):
        from commspan.testing.golden import update_golden

        updating = update_golden()
        config.stash[_GOLDEN] = (updating, updating.__enter__())


def pytest_sessionstart(session: pytest.Session) -> None:
    """A new run for golden files: forget the texts an earlier session of this process
    gave them (``COMMSPAN_UPDATE_GOLDEN=1``: pytest run twice in one process would take
    the second run's new text for a second test sharing the file)."""
    # commspan.testing.golden, if imported (not imported: nothing to forget)
    golden = sys.modules.get(__name__.rpartition(".")[0] + ".golden")
    if golden is not None:
        golden._new_run()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave golden update mode (if this run entered it)."""
    entry = config.stash.get(_GOLDEN, None)
    if entry is not None:
        del config.stash[_GOLDEN]
        entry[0].__exit__(None, None, None)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """With ``--commspan-update-golden``: the golden files written (or that none changed)."""
    entry = config.stash.get(_GOLDEN, None)
    if entry is None:
        return
    written = entry[1]
    if not written:
        terminalreporter.write_line("commspan: golden files up to date, none written")
        return
    noun = "file" if len(written) == 1 else "files"
    terminalreporter.write_line(
        f"commspan: wrote {len(written)} golden {noun}: review and commit them"
    )
    for path in written:
        terminalreporter.write_line(f"  {path}")


def _mode_kwargs(request: pytest.FixtureRequest) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers(_MARKER))):  # closest wins
        if marker.args:
            raise TypeError(
                f"@pytest.mark.{_MARKER}{marker.args!r}: pass CommSpanMode arguments "
                "by keyword, e.g. @pytest.mark.commspan(record_params=False)"
            )
        kwargs.update(marker.kwargs)
        _known_arguments(marker.kwargs, f"@pytest.mark.{_MARKER}(...)")
    if hasattr(request, "param"):  # parametrize("commspan_capture", [{...}], indirect=True)
        if not isinstance(request.param, dict):
            raise TypeError(
                f"{request.fixturename} parameter {request.param!r} is not valid; pass a "
                "dict of CommSpanMode arguments, e.g. parametrize('commspan_capture', "
                "[{'record_params': False}], indirect=True)")
        _known_arguments(request.param, f"{request.fixturename} parameter")
        kwargs.update(request.param)
    return kwargs


def _known_arguments(given: dict[str, Any], where: str) -> None:
    """A name ``CommSpanMode`` does not take is a ``TypeError`` naming ``where`` it was
    given (the mode's own error, raised later, named neither the marker nor the test's
    parameter), with the closest argument names."""
    import difflib
    import inspect

    from commspan import CommSpanMode

    params = inspect.signature(CommSpanMode.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    taken = set(params) - {"self"}
    for name in given:
        if name not in taken and name != "shutdown_timeout_s":
            close = difflib.get_close_matches(name, sorted(taken), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise TypeError(
                f"{where}: {name}={given[name]!r} is not an argument of CommSpanMode"
                f"{hint} (its arguments: docs/api.md)")


@pytest.fixture
def commspan_capture(request: pytest.FixtureRequest) -> Iterator[CommCapture]:
    """The test runs under a fresh, entered ``CommSpanMode``; assert on what it recorded.
    A test that also asks for ``commspan_fake_pg`` gets its process group first,
    whatever the order of its arguments (the mode takes its rank when entered).
    The mode is entered when this fixture is set up: fixtures pytest sets up after
    it (the test's arguments listed after it) run under the mode, and what they
    issue (a model's construction: DTensor's broadcasts) is recorded, counted as
    ``Global`` forward. List fixtures that build the model before it."""
    from commspan.testing import capture

    _fake_pg_first(request)
    with capture(**_mode_kwargs(request)) as cap:
        yield cap


@pytest.fixture
def commspan_mode(request: pytest.FixtureRequest) -> Iterator[CommSpanMode]:
    """A fresh ``CommSpanMode``, not entered; left and shut down after the test."""
    from commspan.testing import fresh_mode

    _fake_pg_first(request)
    with fresh_mode(**_mode_kwargs(request)) as mode:
        yield mode


def _fake_pg_first(request: pytest.FixtureRequest) -> None:
    """Set up ``commspan_fake_pg`` first when the test asks for it, whatever the order of
    its arguments: a mode takes its rank when entered, and the group outlives it."""
    if "commspan_fake_pg" in request.fixturenames:
        request.getfixturevalue("commspan_fake_pg")


@pytest.fixture
def commspan_fake_pg(request: pytest.FixtureRequest) -> Iterator[Any]:
    """torch's fake process group for the test (4 ranks, this process rank 0, unless the
    ``commspan_fake_pg`` marker or an indirect parameter says otherwise: a world size or
    a dict of :func:`~commspan.testing.fake_process_group` arguments); destroyed after
    the test."""
    from commspan.testing import fake_process_group

    kwargs: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers(_PG_MARKER))):  # closest wins
        if len(marker.args) > 2:
            raise TypeError(f"@pytest.mark.{_PG_MARKER}{marker.args!r}: pass world_size and "
                            "rank, e.g. @pytest.mark.commspan_fake_pg(world_size=8, rank=3)")
        kwargs.update(zip(("world_size", "rank"), marker.args))
        kwargs.update(marker.kwargs)
    if hasattr(request, "param"):  # parametrize("commspan_fake_pg", [2, 8], indirect=True)
        param = request.param
        if isinstance(param, int) and not isinstance(param, bool):
            kwargs["world_size"] = param
        elif isinstance(param, dict):
            kwargs.update(param)
        else:
            raise TypeError(
                f"commspan_fake_pg parameter {param!r} is not valid; pass a world size "
                "(int) or a dict of fake_process_group arguments, e.g. "
                "parametrize('commspan_fake_pg', [2, {'world_size': 8, 'rank': 3}], "
                "indirect=True)")
    with fake_process_group(**kwargs) as group:
        yield group


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Add the module table to the report of a failed test that used ``commspan_capture``."""
    report = yield
    if call.when == "call" and report.failed:
        cap = getattr(item, "funcargs", {}).get("commspan_capture")
        if cap is not None:
            try:
                report.sections.append((_SECTION, cap.table(noise_level=1)))
            except Exception:  # noqa: BLE001, S110 - the report must not break on our account
                pass
    return report
