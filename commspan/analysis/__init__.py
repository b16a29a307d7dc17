"""Analyses over finished spans or span records: pure functions, no torch.

``commspan.analysis.timeline`` turns the span records of a run into per-rank,
per-step timelines of module spans and collectives (what the HTML report and
the Chrome trace draw).
"""

__all__: list[str] = []
