"""Views of a recorded run: a self-contained HTML report and a Chrome/Perfetto trace.

- :func:`commspan.render.html.write_html_report`: one HTML file, no network
  needed to open it: the module tree with collective counts, bytes and time per
  phase, redistributions with their placements, a per-rank timeline of any step,
  and findings of cross-rank checks when given.
- :func:`commspan.render.perfetto.write_chrome_trace`: the Chrome Trace Event
  Format that ui.perfetto.dev and chrome://tracing open: one process per rank,
  module spans and collectives as slices, flow arrows joining each collective
  across ranks.
- :func:`~commspan.render.findings.format_check` and
  :func:`~commspan.render.findings.format_stragglers`: the terminal text of
  ``check`` and ``stragglers`` results (their JSON comes from the results'
  ``to_dict``).

Both read the JSONL files written by ``JsonlSpanExporter`` (or span records
already read); see ``docs/views.md``.
"""

from commspan.render.findings import format_check, format_stragglers
from commspan.render.html import html_report, write_html_report
from commspan.render.perfetto import chrome_trace, write_chrome_trace

__all__ = [
    "chrome_trace",
    "format_check",
    "format_stragglers",
    "html_report",
    "write_chrome_trace",
    "write_html_report",
]
