"""Algorithm and bus bandwidth of one collective, with the NCCL-tests conventions.

``algbw = S / t`` where ``S`` is the size of the whole operation; ``busbw =
algbw x factor``, the factor depending on the op and the group size ``n``, so
that bus bandwidths of different ops and group sizes compare with the
hardware's link speed:

========================================================  ===========
op                                                         factor
========================================================  ===========
``all_reduce``, ``all_reduce_coalesced``                   2(n-1)/n
``all_gather*``, ``reduce_scatter*``, ``all_to_all*``,     (n-1)/n
``shard_dim_alltoall``, ``gather``, ``scatter``
``broadcast``, ``reduce``, ``send``, ``recv``, others      1
========================================================  ===========

``S`` is ``commspan.tensor.bytes`` (the bytes of the rank's inputs), except
for ``all_gather*``, ``gather`` and ``scatter``, whose tensors described are one
rank's share (``scatter``'s output): there ``S`` is that times ``n``. Bandwidths
are in GB/s (10^9 bytes per second).

Example:
    >>> from commspan._bandwidth import bandwidth, bus_factor
    >>> bus_factor("all_reduce", 4)
    1.5
    >>> bandwidth("all_reduce", nbytes=4_000_000, duration_ns=1_000_000, group_size=4)
    Bandwidth(algbw=4.0, busbw=6.0)
    >>> bandwidth("all_gather_into_tensor", nbytes=1_000_000, duration_ns=1_000_000, group_size=4)
    Bandwidth(algbw=4.0, busbw=3.0)
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Bandwidth", "bandwidth", "bus_factor", "operation_bytes"]

_TWICE = frozenset({"all_reduce", "all_reduce_coalesced"})
_ONCE = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "all_to_all",
        "all_to_all_single",
        "shard_dim_alltoall",
        "gather",
        "scatter",
    }
)
_PER_RANK_INPUT = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "gather",
        "scatter",
    }
)


class Bandwidth(NamedTuple):
    """Algorithm and bus bandwidth of one collective, GB/s."""

    algbw: float
    busbw: float


def _check_size(group_size: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(
            f"group_size={group_size!r} is not valid; pass the group size, an int >= 1"
        )


def bus_factor(op: str, group_size: int) -> float:
    """The NCCL-tests factor from algorithm to bus bandwidth for ``op`` on ``group_size`` ranks.

    Args:
        op: canonical op name (``commspan.collective.op``).
        group_size: number of ranks in the process group.

    Returns:
        ``2(n-1)/n``, ``(n-1)/n`` or ``1`` (see the module docstring).

    Raises:
        ValueError: ``group_size`` is not an int >= 1.
    """
    _check_size(group_size)
    n = group_size
    if op in _TWICE:
        return 2 * (n - 1) / n
    if op in _ONCE:
        return (n - 1) / n
    return 1.0


def operation_bytes(op: str, nbytes: int, group_size: int) -> int:
    """``S``, the size of the whole operation, from one rank's input bytes.

    Raises:
        ValueError: ``group_size`` is not an int >= 1.
    """
    _check_size(group_size)
    return nbytes * group_size if op in _PER_RANK_INPUT else nbytes


def bandwidth(op: str, *, nbytes: int, duration_ns: int, group_size: int) -> Bandwidth | None:
    """Algorithm and bus bandwidth (GB/s) of one collective.

    Args:
        op: canonical op name.
        nbytes: ``commspan.tensor.bytes`` of the event (the rank's input bytes).
        duration_ns: ``commspan.collective.duration_ns``, issue to completion.
        group_size: ``commspan.pg.size``.

    Returns:
        The two bandwidths, or ``None`` when the duration or the size is not
        positive (nothing meaningful to divide).

    Raises:
        ValueError: ``group_size`` is not an int >= 1.
    """
    factor = bus_factor(op, group_size)
    if duration_ns <= 0 or nbytes <= 0:
        return None
    algbw = operation_bytes(op, nbytes, group_size) / duration_ns  # bytes/ns == GB/s
    return Bandwidth(algbw, algbw * factor)
