"""Algorithm and bus bandwidth of one collective (NCCL-tests conventions).

The functions live in :mod:`commspan._bandwidth`, low in the flow, because the
capture side computes ``commspan.collective.algbw`` / ``busbw`` with them when
a collective completes; the analysis re-exports them here.

Example:
    >>> from commspan.analysis.bandwidth import bandwidth
    >>> bandwidth("all_reduce", nbytes=4_000_000, duration_ns=1_000_000, group_size=4)
    Bandwidth(algbw=4.0, busbw=6.0)
"""

from __future__ import annotations

from commspan._bandwidth import Bandwidth, bandwidth, bus_factor, operation_bytes

__all__ = ["Bandwidth", "bandwidth", "bus_factor", "operation_bytes"]
