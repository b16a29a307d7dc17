"""The settings of a :class:`~commspan.CommSpanMode`, checked once.

:func:`mode_config` validates every constructor argument (each error names
the argument, the value and the fix) and returns a frozen :class:`ModeConfig`;
the mode keeps that and nothing else of its arguments.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from commspan import semconv
from commspan._errors import positive_int, seconds
from commspan._errors import whole_number as _whole
from commspan.analysis.counts import Aggregator
from commspan.capture import ModuleObserver
from commspan.session.sampling import RankSample, rank_sample

_log = logging.getLogger(__name__)

__all__ = ["ModeConfig", "Sampler", "mode_config"]

Sampler = Callable[[int], bool]
"""Decides, from the step index, whether a step is traced."""

# Resource keys commspan owns; resource_attributes= may override all but the run id.
_OWN_RESOURCE_KEYS = (semconv.RANK, semconv.LOCAL_RANK, semconv.WORLD_SIZE, semconv.RUN_ID)


@dataclass(frozen=True)
class ModeConfig:
    """Checked settings of one mode (see :class:`~commspan.CommSpanMode` for each)."""

    tracer_provider: TracerProvider | None
    exporters: tuple[SpanExporter, ...]
    aggregator: Aggregator | None
    run_id: str | None
    sampler: Sampler
    record_params: bool
    resource_attributes: Mapping[str, Any]
    export_queue_size: int
    flush_timeout_s: float
    record_exception_messages: bool
    module_observer: ModuleObserver | None
    time_collectives: bool = True
    hang_timeout_s: float | None = None
    dump_signal: int | None = None
    ranks: RankSample = RankSample.all()
    record_gc: bool = True


def mode_config(
    *,
    tracer_provider: TracerProvider | None,
    exporters: Sequence[SpanExporter],
    aggregator: bool | Aggregator,
    run_id: str | None,
    sample: int | Iterable[int] | Sampler | None,
    record_params: bool,
    resource_attributes: Mapping[str, Any] | None,
    export_queue_size: int,
    flush_timeout_s: float,
    record_exception_messages: bool,
    module_observer: ModuleObserver | None,
    time_collectives: bool = True,
    hang_timeout_s: float | None = None,
    dump_signal: int | None = None,
    ranks: RankSample | Iterable[int] | float | None = None,
    record_gc: bool = True,
) -> ModeConfig:
    """Check the arguments of ``CommSpanMode(...)``.

    Raises:
        TypeError: an argument has the wrong type (the message says which).
        ValueError: a value is out of range, or ``resource_attributes`` sets
            ``commspan.run_id`` or leaves out one of commspan's own keys.
    """
    if tracer_provider is not None and not isinstance(tracer_provider, TracerProvider):
        raise TypeError(
            f"tracer_provider={tracer_provider!r} is not an "
            "opentelemetry.sdk.trace.TracerProvider; pass an SDK TracerProvider "
            "or use exporters=[...]"
        )
    positive_int("export_queue_size", export_queue_size, "pass a positive int")
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise TypeError(f"run_id={run_id!r} is not valid; pass a non-empty str")
    if run_id is not None:
        _utf8_text("run_id", run_id)
    flush_timeout_s = seconds("flush_timeout_s", flush_timeout_s)
    if not isinstance(record_exception_messages, bool):
        raise TypeError(
            f"record_exception_messages={record_exception_messages!r} is not valid; "
            "pass True (type and message) or False (exception type only)"
        )
    if not isinstance(time_collectives, bool):
        raise TypeError(
            f"time_collectives={time_collectives!r} is not valid; pass True (time every "
            "collective) or False"
        )
    if not isinstance(record_gc, bool):
        raise TypeError(
            f"record_gc={record_gc!r} is not valid; pass True (record the garbage "
            "collector's long pauses) or False"
        )
    if not isinstance(record_params, bool):
        raise TypeError(
            f"record_params={record_params!r} is not valid; pass True (parameter names, "
            "shapes and placements on forward spans) or False"
        )
    if module_observer is not None and not all(
            callable(getattr(module_observer, name, None))
            for name in ("pre_fw", "post_fw", "pre_bw", "post_bw")):
        raise TypeError(
            f"module_observer={module_observer!r} is not valid; pass an object with "
            "pre_fw, post_fw, pre_bw and post_bw methods (commspan.capture.ModuleObserver)"
        )
    hang = _hang_timeout(hang_timeout_s, time_collectives)
    return ModeConfig(
        tracer_provider=tracer_provider,
        exporters=_exporters(exporters),
        aggregator=_aggregator(aggregator),
        run_id=run_id,
        sampler=_sampler(sample),
        record_params=record_params,
        resource_attributes=_resource_attributes(resource_attributes),
        export_queue_size=export_queue_size,
        flush_timeout_s=flush_timeout_s,
        record_exception_messages=record_exception_messages,
        module_observer=module_observer,
        time_collectives=time_collectives,
        hang_timeout_s=hang,
        dump_signal=_dump_signal(dump_signal),
        ranks=rank_sample(ranks),
        record_gc=record_gc,
    )


def _hang_timeout(value: float | None, time_collectives: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            f"hang_timeout_s={value!r} is not valid; pass the seconds a collective may take "
            "before this rank writes a hang record (a number > 0), or None for no watchdog"
        )
    if not time_collectives:
        raise ValueError(
            f"hang_timeout_s={value!r} needs time_collectives=True: a collective is stuck "
            "when its completion is not seen, and only timed collectives are watched"
        )
    return float(value)


def _dump_signal(value: int | None) -> int | None:
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        signum = signal.Signals(value)
    except (ValueError, TypeError):
        raise ValueError(
            f"dump_signal={value!r} is not a signal; pass e.g. signal.SIGUSR1, or None"
        ) from None
    if signum in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"dump_signal={signum.name} cannot be caught; pass e.g. signal.SIGUSR1")
    return int(signum)


def _exporters(exporters: Sequence[SpanExporter]) -> tuple[SpanExporter, ...]:
    try:
        exporter_list = list(exporters)
    except TypeError:
        exporter_list = [exporters]  # type: ignore[list-item]
    if isinstance(exporters, SpanExporter) or not all(
        isinstance(e, SpanExporter) for e in exporter_list
    ):
        if isinstance(exporters, SpanExporter):  # (the commonest slip: one, unlisted)
            fix = "put it in a list: exporters=[exporter]"
        elif any(isinstance(e, (str, os.PathLike)) for e in exporter_list):
            fix = ("a path is not an exporter: pass exporters=[JsonlSpanExporter(path)] "
                   "(from commspan.exporters)")
        else:
            fix = 'e.g. exporters=[JsonlSpanExporter("commspan-out/")]'
        raise TypeError(
            f"exporters={exporters!r} must be a list of "
            f"opentelemetry.sdk.trace.export.SpanExporter instances; {fix}"
        )
    seen: set[int] = set()
    for e in exporter_list:
        if id(e) in seen:
            raise ValueError(
                f"exporters={exporters!r} is not valid: {e!r} is listed twice, so every "
                "span would be written twice; list each exporter once")
        seen.add(id(e))
    return tuple(exporter_list)


def _aggregator(aggregator: bool | Aggregator) -> Aggregator | None:
    if isinstance(aggregator, Aggregator):
        return aggregator
    if aggregator is True:
        return Aggregator()
    if aggregator is False or aggregator is None:
        return None
    raise TypeError(f"aggregator={aggregator!r} is not valid; pass True, False or an Aggregator")


def _utf8_text(name: str, value: str) -> None:
    """Raise ValueError if UTF-8 cannot encode ``value`` (a lone surrogate, as
    ``os.environ`` and ``os.listdir`` give for bytes that are not UTF-8)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        from commspan.session.run_id import escape_non_utf8

        raise ValueError(
            f"{name}={value!r} is not valid: UTF-8 cannot encode {value[exc.start]!r} at "
            f"index {exc.start} (a byte that is not UTF-8, decoded with surrogateescape); "
            f"pass UTF-8 text, e.g. {name}={escape_non_utf8(value)!r}") from None


def _resource_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Copy ``resource_attributes=``; reject what would make commspan's ids wrong."""
    if attributes is None:
        return {}
    if not isinstance(attributes, Mapping):
        raise TypeError(
            f"resource_attributes={attributes!r} is not valid; pass a dict of "
            "attribute name -> value (None to leave an attribute out)"
        )
    out = dict(attributes)
    if semconv.RUN_ID in out:
        raise ValueError(
            f"resource_attributes[{semconv.RUN_ID!r}]={out[semconv.RUN_ID]!r} is not "
            f"accepted; pass run_id={out[semconv.RUN_ID]!r} instead (the trace ids of "
            "every rank derive from it)"
        )
    for key in _OWN_RESOURCE_KEYS:
        if key == semconv.LOCAL_RANK and key in out and out[key] is None:
            continue  # may be left out, as commspan does when it is unknown
        if key in out and out[key] is None:
            raise ValueError(
                f"resource_attributes[{key!r}]=None is not accepted; readers need "
                f"{key} to tell ranks apart (leave it out of resource_attributes)"
            )
        if key in out and key != semconv.RUN_ID:
            least = 1 if key == semconv.WORLD_SIZE else 0
            n = _whole(out[key])
            if n is None or n < least:
                raise ValueError(
                    f"resource_attributes[{key!r}]={out[key]!r} is not valid; pass an int "
                    f">= {least} (or leave it out: commspan reads it from "
                    + ("LOCAL_RANK)" if key == semconv.LOCAL_RANK else "torch.distributed)")
                )
            out[key] = n
    rank, world = out.get(semconv.RANK), out.get(semconv.WORLD_SIZE)
    if rank is not None and world is not None and rank >= world:
        raise ValueError(
            f"resource_attributes[{semconv.RANK!r}]={rank} is not a rank of a world of "
            f"{world} (ranks are 0 to {world - 1}); fix one of them, or leave them out "
            "(commspan reads both from torch.distributed)"
        )
    return out


def _checked_sampler(sample: Sampler) -> Sampler:
    """A callable ``sample=``: refused now if it cannot take a step number; at each step,
    an error it raises, or a value that is not a truth value, names ``sample=``."""
    import inspect

    fix = "a callable sample= takes the step number and returns True to trace the step"
    try:
        inspect.signature(sample).bind(0)
    except TypeError as e:
        raise TypeError(f"sample={sample!r} is not valid: it cannot be called with a step "
                        f"number ({e}); {fix}") from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass

    def checked(index: int) -> bool:
        try:
            value = sample(index)
        except Exception as e:  # the user's own error, kept as it is, said where it came from
            if hasattr(e, "add_note"):  # Python 3.11+
                e.add_note(f"(raised by commspan's sample={sample!r} for step {index})")
            raise
        try:
            return bool(value)
        except Exception as e:
            raise TypeError(f"sample={sample!r} returned {value!r} for step {index}, which is "
                            f"not True or False ({e}); {fix}") from None

    return checked


def _sampler(sample: int | Iterable[int] | Sampler | None) -> Sampler:
    if sample is None:
        return lambda i: True
    if isinstance(sample, bool):
        raise TypeError(f"sample={sample!r} is not valid; pass N, a set of steps or a callable")
    # an int, or numpy's (not a one-element tensor or array: a set of steps)
    whole = _whole(sample) if isinstance(sample, Integral) else None
    if whole is not None:
        if whole < 1:
            raise ValueError(f"sample={sample!r} is not valid; every Nth step needs N >= 1")
        n = whole
        return lambda i: i % n == 0
    if callable(sample):
        return _checked_sampler(sample)
    fix = "pass N, a collection of step ints or a callable"
    if isinstance(sample, (str, bytes)):  # would be its characters, as steps
        raise TypeError(f"sample={sample!r} is not valid; {fix}")
    try:
        items = list(sample)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"sample={sample!r} is not valid; {fix}") from None
    numbers = [_whole(s) for s in items]
    for item, step in zip(items, numbers):
        if step is None or step < 0:
            raise ValueError(f"sample={sample!r} is not valid: {item!r} is not a step "
                             f"number (an int >= 0); {fix}")
    steps = frozenset(numbers)
    if not steps:
        _log.warning("commspan: sample=%r names no step: no step is traced (to trace every "
                     "step, leave sample out)", sample)
    return lambda i: i in steps
