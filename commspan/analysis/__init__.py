"""Analyses of finished runs: pure functions over span records, no torch.

- :func:`check_run`: cross-rank consistency, missing ranks and hangs
  (``commspan check``);
- :func:`stragglers`: who arrives last at each collective, the wait it causes,
  and where each rank's step goes (``commspan stragglers``);
- :func:`bandwidth`: algorithm and bus bandwidth of one collective;
- :mod:`commspan.analysis.timeline`: per-rank, per-step timelines of module
  spans and collectives (what the HTML report and the Chrome trace draw).

Loading (:mod:`commspan.analysis.records`), matching (one module per question)
and rendering (:mod:`commspan.render.findings`) are kept apart.

Example:
    >>> from commspan.analysis import bandwidth
    >>> bandwidth("all_reduce", nbytes=2_000_000, duration_ns=1_000_000, group_size=2)
    Bandwidth(algbw=2.0, busbw=2.0)
"""

from commspan.analysis.bandwidth import Bandwidth, bandwidth, bus_factor
from commspan.analysis.check import CheckResult, Finding, check, check_run
from commspan.analysis.records import (
    CollectiveRecord,
    GcRecord,
    HangRecord,
    Run,
    build_run,
    load_run,
)
from commspan.analysis.stragglers import StepTime, StragglerResult, StragglerRow, stragglers

__all__ = [
    "Bandwidth",
    "CheckResult",
    "CollectiveRecord",
    "Finding",
    "GcRecord",
    "HangRecord",
    "Run",
    "StepTime",
    "StragglerResult",
    "StragglerRow",
    "bandwidth",
    "build_run",
    "bus_factor",
    "check",
    "check_run",
    "load_run",
    "stragglers",
]
