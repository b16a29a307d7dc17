"""The loss invariant, as one assertion the fault tests share.

Every span handed to an exporter's queue is exported, dropped or failed, each
counted; after ``shutdown()`` nothing is pending or in flight. See
``docs/design.md`` ("Nothing lost silently") and ``commspan.exporters.queue``.
"""

from __future__ import annotations

from typing import Any

from commspan import CommSpanMode

_TOTALS = {
    "spans_exported": "exported",
    "spans_dropped": "dropped",
    "spans_failed": "failed",
    "spans_in_flight": "in_flight",
}


def assert_nothing_lost(mode: CommSpanMode, *, shut_down: bool = True) -> dict[str, Any]:
    """Assert the loss invariant on ``mode.stats()`` and return the stats.

    For every exporter: it was handed every span the mode emitted (none were
    lost to a raising processor), and ``handed == exported + dropped + failed
    + pending + in_flight``. With ``shut_down`` (the mode's ``shutdown()`` has
    returned), also ``pending == in_flight == 0``, so
    ``handed == exported + dropped + failed``. The mode's totals are the sums
    over its exporters.
    """
    st = mode.stats()
    assert st["exporters"], "the mode has no exporter to check"
    assert st["processor_errors"] == 0, st
    for exp in st["exporters"]:
        assert exp["handed"] == st["spans"], (exp, st["spans"])
        accounted = (
            exp["exported"] + exp["dropped"] + exp["failed"] + exp["pending"] + exp["in_flight"]
        )
        assert exp["handed"] == accounted, exp
        assert 0 <= exp["abandoned"] <= exp["failed"], exp
        if shut_down:
            assert exp["pending"] == 0 and exp["in_flight"] == 0, exp
            assert exp["handed"] == exp["exported"] + exp["dropped"] + exp["failed"], exp
    for total, key in _TOTALS.items():
        assert st[total] == sum(e[key] for e in st["exporters"]), (total, st)
    if shut_down:
        assert st["spans_in_flight"] == 0, st
    return st
