"""pytest plugin: commspan's fixtures, registered through the ``pytest11`` entry point.

This module only wires :mod:`commspan.testing` into pytest; the behaviour lives
there. Fixtures:

* ``commspan_capture``: the test body runs under a fresh, entered
  ``CommSpanMode``; yields a :class:`commspan.testing.CommCapture` to assert on.
  When a test using it fails, the report gets a "commspan modules" section
  with the module table.
* ``commspan_mode``: a fresh ``CommSpanMode``, not entered (``with
  commspan_mode:`` in the test); left and shut down after the test.

Both take ``CommSpanMode`` arguments from a marker::

    @pytest.mark.commspan(record_params=False)
    def test_tp_forward(commspan_capture):
        model(x)
        commspan_capture.assert_counts("MLP.net2", "forward", {"all_reduce": 1})

commspan itself is imported only when a fixture is used.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from commspan import CommSpanMode
    from commspan.testing import CommCapture

_MARKER = "commspan"
_SECTION = "commspan modules"


def pytest_configure(config: pytest.Config) -> None:
    """Declare the ``commspan`` marker (so ``--strict-markers`` accepts it)."""
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(**kwargs): CommSpanMode arguments for the commspan_capture and "
        "commspan_mode fixtures",
    )


def _mode_kwargs(request: pytest.FixtureRequest) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers(_MARKER))):  # closest wins
        if marker.args:
            raise TypeError(
                f"@pytest.mark.{_MARKER}{marker.args!r}: pass CommSpanMode arguments "
                "by keyword, e.g. @pytest.mark.commspan(record_params=False)"
            )
        kwargs.update(marker.kwargs)
    return kwargs


@pytest.fixture
def commspan_capture(request: pytest.FixtureRequest) -> Iterator[CommCapture]:
    """The test runs under a fresh, entered ``CommSpanMode``; assert on what it recorded."""
    from commspan.testing import capture

    with capture(**_mode_kwargs(request)) as cap:
        yield cap


@pytest.fixture
def commspan_mode(request: pytest.FixtureRequest) -> Iterator[CommSpanMode]:
    """A fresh ``CommSpanMode``, not entered; left and shut down after the test."""
    from commspan.testing import fresh_mode

    with fresh_mode(**_mode_kwargs(request)) as mode:
        yield mode


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
