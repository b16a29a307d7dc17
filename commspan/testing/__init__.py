"""Helpers for asserting on the collectives a piece of code issues, in tests.

:func:`capture` runs a block under a fresh :class:`~commspan.CommSpanMode` and
yields a :class:`CommCapture` to assert on afterwards (the way structlog's
``capture_logs`` yields the log entries). The ``assert_*`` helpers check the
common properties and, when they fail, show the whole module table, so the
failure says what *did* happen.

Example:
    >>> import torch
    >>> from commspan.testing import assert_no_comm, capture
    >>> model = torch.nn.Linear(4, 4)
    >>> with capture() as cap:
    ...     model(torch.ones(2, 4)).sum().backward()
    >>> assert_no_comm(cap, phase=None)
    >>> cap.aggregator.modules()
    ['Linear']

With pytest, the ``commspan_capture`` fixture (registered by the plugin that
ships with commspan, :mod:`commspan.testing.plugin`) does the same without the
``with`` block. :func:`assert_well_formed`, :class:`SpanTree` and the
``span_*`` accessors (:mod:`commspan.testing.spans`) look at the spans
themselves; :mod:`commspan.testing.models` has toy models to trace.

Module names are checked: a name that is neither ``Global`` nor a module that
ran (misspelt, or a module that was never called) is an ``AssertionError`` in
the ``assert_*`` helpers (the expectation names something that did not happen)
and a ``ValueError`` in :meth:`CommCapture.counts` (a query with a bad
argument); both messages list the closest names that did run. A module that ran
but issued no collectives is known: asserting that it is silent passes.
Phases are checked too: ``assert_counts`` and ``assert_no_comm`` with a phase fail
when the module never ran in it (or, for ``Global``, when modules ran but none in
it): a test that forgot ``loss.backward()``, or ran it outside the capture, fails
instead of asserting on a backward pass that never happened. What is not caught:
``assert_no_comm(cap)`` with neither a module nor a phase on a capture in which
nothing ran at all (the model called after the ``with`` block), since code
outside every module may issue no collectives; name the module.

Also here: :func:`assert_matches_golden` (a model's communication kept in a
reviewable golden file, :mod:`commspan.testing.golden`) and
:func:`fake_process_group` / :func:`fake_mesh` (torch's fake process group
without private imports, :mod:`commspan.testing.distributed`).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

from opentelemetry.sdk.trace import ReadableSpan

from commspan import semconv
from commspan.analysis.counts import Aggregator, CollectiveSummary
from commspan.session.mode import CommSpanMode
from commspan.spans.timing import add_timing
from commspan.testing.distributed import fake_mesh, fake_process_group
from commspan.testing.golden import assert_matches_golden, golden_text
from commspan.testing.spans import (
    SpanTree,
    assert_well_formed,
    collective_events,
    span_counts,
    span_fqn,
    span_phase,
)

__all__ = [
    "AggregatorLike",
    "CommCapture",
    "SpanTree",
    "assert_counts",
    "assert_matches_golden",
    "assert_no_comm",
    "assert_placements",
    "assert_well_formed",
    "capture",
    "collective_events",
    "fake_mesh",
    "fake_process_group",
    "fresh_mode",
    "golden_text",
    "span_counts",
    "span_fqn",
    "span_phase",
]

_PHASES = tuple(p.value for p in semconv.Phase)


class _RecordingAggregator(Aggregator):
    """An :class:`Aggregator` that also keeps every finished span, in order."""

    def reset(self) -> None:
        super().reset()
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)
        super().on_end(span)


class CommCapture:
    """What :func:`capture` yields: the mode, its aggregator and its finished spans.

    The counts stay readable after the ``with`` block ends, and the
    ``assert_*`` helpers of this module accept the capture itself.

    Attributes:
        mode: the :class:`~commspan.CommSpanMode` the block ran under.
        aggregator: its :class:`~commspan.Aggregator`.

    Example:
        >>> from commspan.testing import capture
        >>> with capture() as cap:
        ...     pass
        >>> cap.counts("Global", "forward")
        {}
    """

    def __init__(self, mode: CommSpanMode, aggregator: _RecordingAggregator) -> None:
        self.mode = mode
        self.aggregator: Aggregator = aggregator
        self._recording = aggregator

    @property
    def spans(self) -> list[ReadableSpan]:
        """Every span the mode finished, in the order they ended (children first)."""
        spans = list(self._recording.spans)
        for span in spans:  # the timing attributes the recorder held back
            add_timing(span)
        return spans

    def counts(self, fqn: str = semconv.GLOBAL_FQN, phase: str | None = None) -> dict[str, int]:
        """``{op: count}`` of module ``fqn`` (subtree-inclusive), one phase or all summed.

        Args:
            fqn: a module that ran, e.g. ``"MLP.net2"``, or ``"Global"`` (the whole rank).
            phase: ``"forward"``, ``"backward"``, ``"recompute"`` or ``None`` for all.

        Returns:
            ``{op: count}``, empty if the module issued no collectives.

        Raises:
            ValueError: ``phase`` is not a phase, or no module named ``fqn`` ran
                (the message lists the closest names that did).
            TypeError: ``fqn`` is not a str.

        Example:
            ``cap.counts("MLP.net2", "forward") == {"all_reduce": 1}``
        """
        ph = _check_phase(phase, allow_none=True)
        unknown = _unknown_module(self.aggregator, fqn)
        if unknown:
            raise ValueError(f"fqn={fqn!r} is not valid: {unknown}")
        return _counts(self.aggregator, fqn, ph)

    def table(self, noise_level: int = 1) -> str:
        """The module table (see :meth:`commspan.Aggregator.table`)."""
        return self.aggregator.table(noise_level=noise_level)

    def assert_counts(self, fqn: str, phase: str, expected: Mapping[str, int]) -> None:
        """Same as :func:`assert_counts` on this capture."""
        assert_counts(self, fqn, phase, expected)

    def assert_no_comm(self, phase: str | None = "forward", fqn: str | None = None) -> None:
        """Same as :func:`assert_no_comm` on this capture."""
        assert_no_comm(self, phase=phase, fqn=fqn)

    def assert_placements(
        self, fqn: str, op: str, src: Any, dst: Any, phase: str | None = None
    ) -> None:
        """Same as :func:`assert_placements` on this capture."""
        assert_placements(self, fqn, op, src, dst, phase=phase)

    def __repr__(self) -> str:
        return (
            f"CommCapture(modules={len(self.aggregator.modules())}, "
            f"collectives={self.aggregator.total_count()}, spans={len(self._recording.spans)})"
        )


AggregatorLike = Union[Aggregator, CommSpanMode, CommCapture]  # noqa: UP007 (a runtime alias on 3.10)
"""What the ``assert_*`` helpers accept: an aggregator, a mode that has one, or a capture."""


@contextlib.contextmanager
def capture(**mode_kwargs: Any) -> Iterator[CommCapture]:
    """Run the block under a fresh ``CommSpanMode`` and yield what it recorded.

    Args:
        mode_kwargs: passed to :class:`~commspan.CommSpanMode` (e.g.
            ``record_params=False``, ``exporters=[...]``); ``aggregator`` is
            not accepted, the capture brings its own.

    Yields:
        A :class:`CommCapture`, filled while the block runs and readable after.
        When the block ends the mode is left and its exporters shut down.

    Raises:
        TypeError: ``aggregator`` was passed, or ``CommSpanMode`` rejects an argument.

    Example:
        >>> import torch
        >>> from commspan.testing import capture
        >>> with capture(record_params=False) as cap:
        ...     _ = torch.nn.ReLU()(torch.ones(2))
        >>> [s.name for s in cap.spans]
        ['ReLU forward', 'commspan.rank', 'commspan.session']
    """
    if "aggregator" in mode_kwargs:
        raise TypeError(
            f"aggregator={mode_kwargs['aggregator']!r} is not accepted by capture(); "
            "it brings its own aggregator (use cap.aggregator)"
        )
    aggregator = _RecordingAggregator()
    mode = CommSpanMode(aggregator=aggregator, **mode_kwargs)
    cap = CommCapture(mode, aggregator)
    mode.__enter__()
    try:
        yield cap
    except BaseException:
        if mode.active:  # (the block may have left the mode itself)
            mode.__exit__(*sys.exc_info())
        raise
    else:
        # (not sys.exc_info(): inside a caller's `except`, that is the caller's
        # exception, already handled, which the spans would record as an error)
        if mode.active:
            mode.__exit__(None, None, None)
    finally:
        mode.shutdown()


@contextlib.contextmanager
def fresh_mode(shutdown_timeout_s: float = 5.0, **mode_kwargs: Any) -> Iterator[CommSpanMode]:
    """Yield a new ``CommSpanMode`` (not entered); clean up after the block.

    On the way out the mode is left if the block left it entered, and its
    exporters are shut down (bounded by ``shutdown_timeout_s``), so no export
    thread outlives the test. This is what the ``commspan_mode`` fixture uses.

    Args:
        shutdown_timeout_s: bound on the exporters' final flush, in seconds.
        mode_kwargs: passed to :class:`~commspan.CommSpanMode`.

    Example:
        >>> from commspan.testing import fresh_mode
        >>> with fresh_mode() as mode:
        ...     with mode:
        ...         pass
        >>> mode.active
        False
    """
    mode = CommSpanMode(**mode_kwargs)
    try:
        yield mode
    finally:
        if mode.active:
            mode.__exit__(None, None, None)
        mode.shutdown(timeout_s=shutdown_timeout_s)


# ------------------------------------------------------------------ assertions
def assert_counts(
    agg: AggregatorLike, fqn: str, phase: str, expected: Mapping[str, int]
) -> None:
    """Assert the collectives of module ``fqn`` in ``phase`` are exactly ``expected``.

    Counts are subtree-inclusive (a module counts what its children issue),
    as in :meth:`commspan.Aggregator.module_counts`. An op missing from
    ``expected`` must not occur; an op expected with ``0`` must not occur.

    Args:
        agg: an :class:`~commspan.Aggregator`, a ``CommSpanMode`` or a :class:`CommCapture`.
        fqn: module name, e.g. ``"MLP.net2"``, or ``"Global"`` for the whole rank.
        phase: ``"forward"``, ``"backward"`` or ``"recompute"``.
        expected: ``{op: count}``, e.g. ``{"all_reduce": 1}``; an op is its
            canonical name or torch's packet or overload of it (the keys of torch's
            CommDebugMode, ``{c10d_functional.all_reduce: 1}``; several of one op
            add up), or its name as a string (``"c10d.allreduce_"``), which means the
            same on every torch version, whether it has that op or not.

    Raises:
        AssertionError: the counts differ (the message shows both and the module
            table), no module named ``fqn`` ran (the message lists the
            closest names that did), or it never ran in ``phase`` (for ``Global``:
            modules ran, none in ``phase``), whatever ``expected`` says.
        ValueError: ``phase`` is not a phase, a count is negative, or an op is not
            a collective (the message suggests the closest names).
        TypeError: ``fqn`` is not a str.

    Example:
        >>> from commspan.testing import assert_counts, capture
        >>> with capture() as cap:
        ...     pass
        >>> assert_counts(cap, "Global", "forward", {})
    """
    aggregator = _aggregator(agg)
    ph = _check_phase(phase, allow_none=False)
    if not isinstance(expected, Mapping):
        raise TypeError(f"expected={expected!r} is not valid; pass {{op: count}}, e.g. "
                        "{'all_reduce': 1} ({} for none)")
    _assert_traced(agg, f"collectives of {fqn!r} in {ph}", every_step=False)
    want: dict[str, int] = {}
    for op, n in expected.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"expected[{op!r}]={n!r} is not valid; counts are ints >= 0")
        name = _op_name(op, f"expected key {op!r}")
        if n:  # (torch's packets of one op, c10d and functional, add up as commspan's do)
            want[name] = want.get(name, 0) + n
    _assert_known(aggregator, fqn, f"collectives of {fqn!r} in {ph}")
    assert ph is not None
    _assert_phase_ran(aggregator, fqn, ph, f"collectives of {fqn!r} in {ph}")
    got = _counts(aggregator, fqn, ph)
    if got == want:
        return
    diff = ", ".join(
        f"{op}: expected {want.get(op, 0)}, got {got.get(op, 0)}"
        for op in sorted(set(want) | set(got))
        if want.get(op, 0) != got.get(op, 0)
    )
    raise AssertionError(
        f"collectives of {fqn!r} in {ph}: expected {want}, got {got} ({diff})"
        f"\n{_table(aggregator)}"
    )


def assert_no_comm(
    agg: AggregatorLike, phase: str | None = "forward", fqn: str | None = None
) -> None:
    """Assert no collective was issued in ``phase`` (inside ``fqn``, or anywhere).

    Args:
        agg: an :class:`~commspan.Aggregator`, a ``CommSpanMode`` or a :class:`CommCapture`.
        phase: the phase to check; ``None`` checks every phase.
        fqn: a module whose subtree must be silent; ``None`` means the whole rank.
            It must have run, in ``phase`` when one is given (a module that ran
            without collectives passes).

    Raises:
        AssertionError: some collective was issued (the message lists them and
            shows the module table), no module named ``fqn`` ran (the
            message lists the closest names that did), or it never ran in
            ``phase`` (for the whole rank: modules ran, none in ``phase``; a
            forward without backward, a model without activation checkpointing
            asked about ``recompute``).
        ValueError: ``phase`` is not a phase.
        TypeError: ``fqn`` is not a str.

    Example:
        >>> import torch
        >>> from commspan.testing import assert_no_comm, capture
        >>> with capture() as cap:
        ...     _ = torch.nn.Linear(2, 2)(torch.ones(1, 2))
        >>> assert_no_comm(cap, "forward", fqn="Linear")
    """
    aggregator = _aggregator(agg)
    ph = _check_phase(phase, allow_none=True)
    where = fqn if fqn is not None else semconv.GLOBAL_FQN
    _assert_traced(agg, f"expected no collectives inside {where!r}", every_step=True)
    _assert_known(aggregator, where, f"expected no collectives inside {where!r}")
    if ph is not None:
        _assert_phase_ran(aggregator, where, ph, f"expected no collectives inside {where!r}")
    got = _counts(aggregator, where, ph)
    if not got:
        return
    issued = [
        f"{s.fqn} {s.phase} {s.op} x{s.count}"
        + (f" ({s.src} -> {s.dst})" if s.src or s.dst else "")
        for s in aggregator.collectives(phase=ph)
        if fqn is None or s.fqn == fqn or s.fqn.startswith(fqn + ".")
    ]
    scope = f"inside {fqn!r}" if fqn is not None else "on this rank"
    raise AssertionError(
        f"expected no collectives in {ph or 'any phase'} {scope}, got {got}"
        + (f"; issued by: {'; '.join(issued)}" if issued else "")
        + f"\n{_table(aggregator)}"
    )


def assert_placements(
    agg: AggregatorLike,
    fqn: str,
    op: str,
    src: str | Sequence[Any],
    dst: str | Sequence[Any],
    phase: str | None = None,
) -> None:
    """Assert module ``fqn`` issued ``op``, and always for a ``src -> dst`` redistribution.

    Only the collectives the module issued itself count (not its children's).
    Placements are written the way commspan records them: ``"P(sum)"``,
    ``"R"``, ``"S(0)"``, comma-joined on a multi-dimensional mesh
    (``"S(0),R"``); a sequence of DTensor placements is converted.

    Args:
        agg: an :class:`~commspan.Aggregator`, a ``CommSpanMode`` or a :class:`CommCapture`.
        fqn: the issuing module, e.g. ``"MLP.net2"``.
        op: canonical op name, e.g. ``"all_reduce"`` (or torch's packet of it).
        src: placements before the redistribution, e.g. ``"P(sum)"`` or ``[Partial()]``.
        dst: placements after it, e.g. ``"R"`` or ``[Replicate()]``.
        phase: only collectives of this phase; ``None`` for every phase.

    Raises:
        AssertionError: the module issued no ``op`` (in ``phase``), or some of
            them had other placements (the message lists what was seen and
            shows the module table), or no module named ``fqn`` ran (the
            message lists the closest names that did).
        ValueError: ``phase`` is not a phase, or ``op`` is not a collective.
        TypeError: ``fqn`` is not a str.

    Example:
        ``assert_placements(cap, "MLP.net2", "all_reduce", "P(sum)", "R", phase="forward")``
    """
    aggregator = _aggregator(agg)
    ph = _check_phase(phase, allow_none=True)
    for name, value in (("src", src), ("dst", dst)):
        if not isinstance(value, (str, Sequence)):
            raise TypeError(f"{name}={value!r} is not valid; pass placements as a str "
                            "('P(sum)', 'S(0),R') or a sequence of DTensor placements")
    want = (_placements(src), _placements(dst))
    op = _op_name(op, f"op={op!r}")
    _assert_traced(agg, f"{op} of {fqn!r}", every_step=False)
    _assert_known(aggregator, fqn, f"{op} of {fqn!r}")
    seen: list[CollectiveSummary] = aggregator.collectives(fqn=fqn, phase=ph, op=op)
    wrong = [s for s in seen if (s.src, s.dst) != want]
    if seen and not wrong:
        return
    where = f"{fqn!r}" + (f" in {ph}" if ph else "")
    if not seen:
        others = sorted({f"{s.phase} {s.op}" for s in aggregator.collectives(fqn=fqn)})
        detail = f"{where} issued no {op}" + (
            f" (it issued: {', '.join(others)})" if others else " (it issued no collectives)"
        )
    else:
        found = "; ".join(
            f"{s.phase} {s.src or '?'} -> {s.dst or '?'} x{s.count}" for s in seen
        )
        detail = f"{op} of {where}: expected every one {want[0]} -> {want[1]}, got {found}"
    raise AssertionError(f"{detail}\n{_table(aggregator)}")


# ------------------------------------------------------------------ helpers
def _aggregator(agg: AggregatorLike) -> Aggregator:
    if isinstance(agg, Aggregator):
        return agg
    if isinstance(agg, CommCapture):
        return agg.aggregator
    if isinstance(agg, CommSpanMode):
        if agg.aggregator is None:
            raise ValueError(
                "agg is a CommSpanMode created with aggregator=False; it counts nothing "
                "to assert on (create it with aggregator=True)"
            )
        return agg.aggregator
    if isinstance(agg, (str, os.PathLike)):  # (the files of a run: read them first)
        raise TypeError(
            f"agg={agg!r} is a path, not an Aggregator; pass Aggregator.from_jsonl({agg!r}) "
            "(commspan.Aggregator) to assert on the files of a run")
    raise TypeError(
        f"agg={agg!r} is not valid; pass an Aggregator, a CommSpanMode or a CommCapture"
    )


def _assert_traced(agg: AggregatorLike, what: str, *, every_step: bool) -> None:
    """Refuse to assert on a mode that traced nothing (its rank left out by ``ranks=``,
    every step sampled out by ``sample=``): its counts are empty, and an assertion of
    absence would pass whatever ran. With ``every_step``, refuse when any step was
    sampled out (absence cannot be shown from the steps traced)."""
    mode = agg.mode if isinstance(agg, CommCapture) else agg
    if not isinstance(mode, CommSpanMode):
        return  # an Aggregator: what it was fed is all there is
    if mode.resource is None:  # (set on the first entry)
        raise AssertionError(
            f"{what}: this CommSpanMode was never entered, so nothing was recorded to "
            "assert on (run the code under `with mode:`; the commspan_mode fixture is "
            "not entered for the test, commspan_capture is)")
    if not mode._rank_traced:
        raise AssertionError(
            f"{what}: this rank ({mode.rank}) is not traced: ranks= leaves it out, so "
            "nothing was recorded to assert on (drop ranks= from capture() or the "
            "commspan marker)")
    stats = mode.stats()
    skipped, traced = stats["steps_skipped"], stats["steps_traced"]
    if skipped and (every_step or not traced):
        raise AssertionError(
            f"{what}: sample= left {skipped} of {skipped + traced} steps untraced, so "
            + ("no step was recorded to assert on" if not traced else
               "collectives in those steps were not seen")
            + " (drop sample= from capture() or the commspan marker)")


def _assert_phase_ran(aggregator: Aggregator, fqn: str, phase: str, what: str) -> None:
    """Refuse to assert on a phase that never ran: a module (or, for ``Global``, every
    module) with no span in ``phase`` issued nothing there, whatever the code would do
    (a test that forgot ``loss.backward()``, or called it outside the capture)."""
    ran = aggregator.module_phases()
    if not ran:
        return  # no module ran (code outside modules), or phases not known (old digests)
    if fqn == semconv.GLOBAL_FQN:
        if any(phase in phases for phases in ran.values()) or aggregator.comm_counts(phase):
            return
        raise AssertionError(
            f"{what}: no module ran in {phase} in what was recorded, so no collective of "
            f"it could be seen ({_phase_hint(phase)})\n{_table(aggregator)}")
    phases = ran.get(fqn, [])
    if phase in phases:
        return
    raise AssertionError(
        f"{what}: {fqn!r} never ran in {phase} in what was recorded (it ran in "
        f"{', '.join(phases) or 'no phase of its own'}), so no collective of it could be "
        f"seen there ({_phase_hint(phase)})\n{_table(aggregator)}")


def _phase_hint(phase: str) -> str:
    if phase == semconv.Phase.BACKWARD.value:
        return ("run the backward pass inside the capture, e.g. model(x).sum().backward(); "
                "a module none of whose outputs needed a gradient has no backward")
    if phase == semconv.Phase.RECOMPUTE.value:
        return ("recompute runs in the backward pass of activation-checkpointed modules: "
                "checkpoint the module and run the backward pass inside the capture")
    return f"run the code that does the {phase} inside the capture"


def _op_name(op: Any, what: str) -> str:
    """The canonical name of ``op``: a canonical name (``"all_reduce"``), or torch's
    spelling of it, as a torch op packet or overload (``c10d_functional.all_reduce``,
    the keys of torch's CommDebugMode) or its name (``"c10d.allreduce_"``: commspan's
    table says what it is, whether the installed torch has that op or not)."""
    import torch

    from commspan.capture.collectives import canonical_name, canonical_names

    name = canonical_name(op)
    if name is None and isinstance(op, str):
        name = canonical_name(op.removeprefix("torch.ops."))
    if name is not None:
        return name
    known = canonical_names()
    close = difflib.get_close_matches(str(op).rsplit(".", 1)[-1].strip("_"), known, n=2)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise ValueError(
        f"{what} is not valid: not a collective commspan knows (torch {torch.__version__} "
        f"installed); {hint}use a canonical op name ({', '.join(known)}), which holds on "
        "every torch version, or a torch op packet such as "
        "torch.ops.c10d_functional.all_reduce")


def _check_phase(phase: Any, *, allow_none: bool) -> str | None:
    if phase is None and allow_none:
        return None
    value = getattr(phase, "value", phase)
    if value not in _PHASES:
        allowed = ", ".join(repr(p) for p in _PHASES) + (" or None" if allow_none else "")
        raise ValueError(f"phase={phase!r} is not valid; use {allowed}")
    return str(value)


def _counts(aggregator: Aggregator, fqn: str, phase: str | None) -> dict[str, int]:
    per_phase = aggregator.module_counts().get(fqn, {})
    out: dict[str, int] = {}
    for ph, ops in per_phase.items():
        if phase is not None and ph != phase:
            continue
        for op, n in ops.items():
            if n:
                out[op] = out.get(op, 0) + n
    return out


def _placements(value: str | Sequence[Any]) -> str:
    if isinstance(value, str):
        return value.replace(" ", "")
    from commspan.capture.dtensor import placements_str

    return placements_str(list(value))


_MAX_LISTED = 20  # module names an error lists before saying how many more ran


def _unknown_module(aggregator: Aggregator, fqn: object) -> str | None:
    """``None`` if ``fqn`` is ``Global`` or a module that ran, else what to say about it."""
    if not isinstance(fqn, str):
        raise TypeError(
            f"fqn={fqn!r} is not valid; pass the module's name as a str, e.g. 'MLP.net2' "
            f"(see cap.aggregator.modules()), or {semconv.GLOBAL_FQN!r} for the whole rank"
        )
    modules = aggregator.modules()
    if fqn == semconv.GLOBAL_FQN or fqn in modules:
        return None
    close = _closest(fqn, modules)
    listed = ", ".join(modules[:_MAX_LISTED]) or "none"
    if len(modules) > _MAX_LISTED:
        listed += f", ... ({len(modules) - _MAX_LISTED} more)"
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"no module named {fqn!r} ran{hint} (modules that ran: {listed})"


def _closest(fqn: str, modules: list[str]) -> list[str]:
    """Up to three names near ``fqn``: same last parts first, then by spelling (any case)."""
    suffix = [m for m in modules if m.endswith("." + fqn)]
    by_lower: dict[str, str] = {}
    for m in [semconv.GLOBAL_FQN, *modules]:
        by_lower.setdefault(m.lower(), m)
    spelled = [by_lower[c] for c in difflib.get_close_matches(fqn.lower(), list(by_lower), n=3)]
    return list(dict.fromkeys(suffix + spelled))[:3]


def _assert_known(aggregator: Aggregator, fqn: str, what: str) -> None:
    unknown = _unknown_module(aggregator, fqn)
    if unknown:
        raise AssertionError(f"{what}: {unknown}\n{_table(aggregator)}")


def _table(aggregator: Aggregator) -> str:
    return "module table (noise_level=1):\n" + aggregator.table(noise_level=1)
