"""CommSpanMode: the context manager that wires capture, spans and processors.

Flow of information (one direction)::

    nn.Module hooks ─┐
                     ├─> SpanRecorder frames ─> ReadableSpan ─> processors
    dispatch mode ───┘                                          ├ Aggregator (in-process)
                                                                ├ ExportQueue ─> JSONL / OTLP
                                                                └ a TracerProvider's processors
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from commspan import semconv
from commspan.aggregate import Aggregator
from commspan.collectives import CollectiveInfo
from commspan.dispatch import CollectiveDispatchMode, OpCallback, OpRecordingDispatchMode
from commspan.export import ExportQueue
from commspan.module_tracker import ModuleHooks, ModuleTracker
from commspan.spans import Frame, SpanRecorder, derive_ids

__all__ = ["CommSpanMode", "Sampler"]

_log = logging.getLogger(__name__)
_graph_task_id = torch._C._current_graph_task_id

Sampler = Callable[[int], bool]
"""Decides, from the step index, whether a step is traced."""


def _version() -> str:
    from commspan import __version__

    return __version__


def _dist_info() -> tuple[int, int, int]:
    """(rank, local rank, world size); (0, 0, 1) without torch.distributed."""
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), local, dist.get_world_size()
    except Exception:
        pass
    rank = int(os.environ.get("RANK", "0") or 0)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return rank, local, world


class CommSpanMode:
    """Record module calls as spans and collectives as span events.

    Wrap a training step (or a whole loop) in ``with CommSpanMode():``. Every
    ``nn.Module`` call becomes a span per phase (forward, backward, recompute),
    nested as the modules nest; every collective the dispatch mode observes
    becomes an event on the innermost module span. ``with mode.step(i):``
    inside the context makes one trace per step, shared by all ranks.

    Args:
        tracer_provider: an SDK ``TracerProvider`` whose span processors also
            receive commspan's spans (its resource is merged into commspan's).
            commspan never sets the global provider.
        exporters: ``SpanExporter`` instances (e.g. ``JsonlSpanExporter``,
            ``otlp_exporter()``); each gets its own background export queue.
        aggregator: ``True`` (default) for a built-in :class:`Aggregator`, an
            ``Aggregator`` instance to use, or ``False`` for none.
        run_id: identifier shared by all ranks of the run; default from
            ``COMMSPAN_RUN_ID``, then ``TORCHELASTIC_RUN_ID``, then random.
        sample: which steps to trace: ``None`` (all), an int ``N`` (every Nth
            step: 0, N, 2N, …), a collection of step indices, or a callable
            ``step -> bool``. Untraced steps record and export nothing.
        record_params: put parameter names, shapes and placements on forward spans.
        resource_attributes: resource attributes for every span. They win over
            everything else: over ``OTEL_RESOURCE_ATTRIBUTES`` /
            ``OTEL_SERVICE_NAME`` and the ``tracer_provider``'s resource, which
            in turn win over what commspan detects (``service.name`` =
            ``commspan``, ``service.instance.id`` = the rank, ``host.name``,
            ``process.pid``). A value of ``None`` leaves the key out, e.g.
            ``{"host.name": None, "process.pid": None}`` to send neither.
            ``commspan.rank``, ``commspan.local_rank`` and ``commspan.world_size``
            come from torch.distributed (or ``RANK``/``LOCAL_RANK``/
            ``WORLD_SIZE``); only this argument can override them (e.g. to
            simulate ranks in one process), the environment and the provider
            cannot. ``commspan.run_id`` is set with ``run_id=``.
        export_queue_size: spans each exporter queue holds before dropping.
        flush_timeout_s: the most leaving the context waits for exporters, in
            seconds; it does not wait for an exporter whose last export failed
            or timed out, until one succeeds again.

    Raises:
        TypeError: an argument has the wrong type (the message says which).
        ValueError: ``resource_attributes`` sets ``commspan.run_id`` or leaves
            out (``None``) one of commspan's own keys.

    Example:
        >>> import torch
        >>> from commspan import CommSpanMode
        >>> model = torch.nn.Linear(4, 4)
        >>> mode = CommSpanMode()
        >>> with mode:
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> mode.aggregator.modules()
        ['Linear']
        >>> mode.aggregator.total_count()
        0
    """

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        exporters: Sequence[SpanExporter] = (),
        aggregator: bool | Aggregator = True,
        run_id: str | None = None,
        sample: int | Iterable[int] | Sampler | None = None,
        record_params: bool = True,
        resource_attributes: Mapping[str, Any] | None = None,
        export_queue_size: int = 65536,
        flush_timeout_s: float = 5.0,
        _observer: ModuleHooks | None = None,
        _op_observer: OpCallback | None = None,
    ) -> None:
        if tracer_provider is not None and not isinstance(tracer_provider, TracerProvider):
            raise TypeError(
                f"tracer_provider={tracer_provider!r} is not an "
                "opentelemetry.sdk.trace.TracerProvider; pass an SDK TracerProvider "
                "or use exporters=[...]"
            )
        try:
            exporter_list = list(exporters)
        except TypeError:
            exporter_list = [exporters]  # type: ignore[list-item]
        if isinstance(exporters, SpanExporter) or not all(
            isinstance(e, SpanExporter) for e in exporter_list
        ):
            raise TypeError(
                f"exporters={exporters!r} must be a list of "
                "opentelemetry.sdk.trace.export.SpanExporter instances"
            )
        if (
            not isinstance(export_queue_size, int)
            or isinstance(export_queue_size, bool)
            or export_queue_size < 1
        ):
            raise ValueError(
                f"export_queue_size={export_queue_size!r} is not valid; pass a positive int"
            )
        if isinstance(aggregator, Aggregator):
            self.aggregator: Aggregator | None = aggregator
        elif aggregator is True:
            self.aggregator = Aggregator()
        elif aggregator is False or aggregator is None:
            self.aggregator = None
        else:
            raise TypeError(
                f"aggregator={aggregator!r} is not valid; pass True, False or an Aggregator"
            )
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise TypeError(f"run_id={run_id!r} is not valid; pass a non-empty str")
        if flush_timeout_s <= 0:
            raise ValueError(f"flush_timeout_s={flush_timeout_s!r} must be > 0 seconds")
        self._sampler = _make_sampler(sample)
        self._tracer_provider = tracer_provider
        self._queues = [
            ExportQueue(e, max_queue_size=export_queue_size) for e in exporter_list
        ]
        self._user_run_id = run_id
        self.run_id = run_id or ""
        self._record_params = record_params
        self._extra_resource = _check_resource_attributes(resource_attributes)
        self._flush_timeout = flush_timeout_s
        self._observer = _observer
        self._op_observer = _op_observer

        self._processors: list[Callable[[ReadableSpan], None]] = []
        self._recorder: SpanRecorder | None = None
        self._tracker: ModuleTracker | None = None
        self._dispatch: CollectiveDispatchMode | None = None
        self._active = False
        self._in_step = False
        self._paused = False
        self._popped = False
        self._rank, self._local_rank, self._world = 0, 0, 1
        self._root_key: str | None = None
        self._root_start = 0
        self._root_attrs: dict[str, Any] = {}
        self._sessions = 0
        self.resource: Resource | None = None
        self._resource_key: tuple[Any, ...] | None = None
        self._stats = {
            "spans": 0,
            "collectives": 0,
            "steps_traced": 0,
            "steps_skipped": 0,
            "processor_errors": 0,
        }

    # ------------------------------------------------------------ context
    def __enter__(self) -> CommSpanMode:
        if self._active:
            raise RuntimeError(
                "this CommSpanMode is already active; leave it before entering it "
                "again, or create a second CommSpanMode"
            )
        self._rank, self._local_rank, self._world = _dist_info()
        if not self.run_id:
            from commspan.run_id import resolve_run_id

            self.run_id = resolve_run_id(self._user_run_id)
        key = (self._rank, self._local_rank, self._world, self.run_id)
        if self.resource is None or self._resource_key != key:
            self.resource = self._build_resource()
            self._resource_key = key
        if self.aggregator is not None:
            self.aggregator.reset()
        self._recorder = SpanRecorder(self._emit, self.resource, _version())
        self._recorder.on_empty = self._ensure_root
        # One dispatch mode and one tracker for the mode's life: entering
        # again keeps what they learned (module names and attributes, process
        # groups, per-group sequence numbers).
        if self._dispatch is None:
            if self._op_observer is None:
                self._dispatch = CollectiveDispatchMode(self._on_collective)
            else:  # commspan.compat's CommDebugMode lists every op; nothing else pays for it
                self._dispatch = OpRecordingDispatchMode(self._on_collective, self._op_observer)
        if self._tracker is None:
            self._tracker = ModuleTracker(
                self._recorder,
                observer=self._observer,
                record_params=self._record_params,
                on_mesh=self._dispatch.groups.add_mesh,
            )
        else:
            self._tracker.recorder = self._recorder
        self._processors = self._build_processors()
        if self.aggregator is not None:
            self.aggregator.attach_live(self._live)
        self._active = True
        self._paused = False
        self._start_capture()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if self._in_step:
                self._in_step = False
            self._stop_capture()
            self._end_root(exc)
            if self._tracker is not None:
                self._tracker.uninstall()
        finally:
            self._active = False
            if self.aggregator is not None:
                self.aggregator.attach_live(None)
            self._flush_on_exit()

    def _start_capture(self) -> None:
        assert self._tracker is not None and self._dispatch is not None
        self._tracker.install()
        self._dispatch.__enter__()

    def _stop_capture(self) -> None:
        if self._dispatch is not None and not (self._paused and self._popped):
            self._dispatch.__exit__(None, None, None)
        self._popped = False
        if self._tracker is not None:
            self._tracker.active = False

    # ------------------------------------------------------------ steps
    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[bool]:
        """Trace one training step as its own trace, shared by all ranks.

        Yields ``True`` when the step is traced, ``False`` when sampled out.

        Raises:
            RuntimeError: used outside ``with mode:`` or inside another step.
            TypeError: ``index`` is not an int.

        Example:
            >>> from commspan import CommSpanMode
            >>> mode = CommSpanMode()
            >>> with mode:
            ...     for i in range(2):
            ...         with mode.step(i):
            ...             pass  # forward, backward, optimizer step
        """
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"index={index!r} is not valid; pass the step number as an int")
        if not self._active:
            raise RuntimeError(
                "mode.step() was called outside the mode; use it inside `with mode:`"
            )
        if self._in_step:
            raise RuntimeError(
                f"mode.step({index}) was entered inside another step; steps do not nest"
            )
        self._end_root(None)
        traced = self._sampler(index)
        self._in_step = True
        if not traced:
            self._stats["steps_skipped"] += 1
            self._pause()
            try:
                yield False
            finally:
                self._in_step = False
                self._resume()
            return
        self._stats["steps_traced"] += 1
        self._begin_root(f"step/{index}", semconv.SPAN_STEP, {semconv.STEP: index})
        error: BaseException | None = None
        try:
            yield True
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._in_step = False
            self._end_root(error)
            if self._tracker is not None:
                self._tracker.reset_step()

    def _pause(self) -> None:
        """Stop capturing for an untraced step (hooks off, dispatch mode popped)."""
        self._paused = True
        if self._tracker is not None:
            self._tracker.pause()
        # The dispatch mode leaves the stack only when it is on top; under a
        # mode pushed later it stays, and its callback ignores what it sees.
        self._popped = _top_dispatch_mode() is self._dispatch
        if self._popped and self._dispatch is not None:
            self._dispatch.__exit__(None, None, None)

    def _resume(self) -> None:
        if self._active and self._paused:
            self._paused = False
            assert self._tracker is not None and self._dispatch is not None
            self._tracker.install()
            if self._popped:
                self._dispatch.__enter__()
                self._popped = False

    # ------------------------------------------------------------ roots
    def _begin_root(self, key: str, root_name: str, attrs: dict[str, Any]) -> Frame:
        assert self._recorder is not None
        trace_id, root_span_id = derive_ids(self.run_id, key)
        self._root_key = key
        self._root_start = time.time_ns()
        self._root_attrs = {semconv.RUN_ID: self.run_id, **attrs}
        self._root_name = root_name
        rank_attrs = {
            semconv.MODULE_FQN: semconv.GLOBAL_FQN,
            semconv.RANK: self._rank,
            semconv.WORLD_SIZE: self._world,
            semconv.RUN_ID: self.run_id,
            semconv.SCHEMA: semconv.SCHEMA_VERSION,
            **attrs,
        }
        return self._recorder.begin(trace_id, root_span_id, rank_attrs)

    def _ensure_root(self) -> None:
        """Open a session trace for activity outside any step."""
        if self._recorder is not None and self._recorder.root is None:
            self._sessions += 1
            self._begin_root(f"session/{self._sessions}", semconv.SPAN_SESSION, {})

    def _end_root(self, error: BaseException | None) -> None:
        rec = self._recorder
        if rec is None or rec.root is None:
            return
        rec.end(error)
        if self._rank == 0 and self._root_key is not None:
            _, root_span_id = derive_ids(self.run_id, self._root_key)
            rec.emit_span(
                self._root_name,
                root_span_id,
                None,
                self._root_start,
                time.time_ns(),
                {**self._root_attrs, semconv.WORLD_SIZE: self._world},
                error,
            )
        self._root_key = None

    # ------------------------------------------------------------ capture
    def _on_collective(self, info: CollectiveInfo, attrs: dict[str, Any]) -> None:
        rec = self._recorder
        if rec is None or self._paused:
            return
        if rec.root is None:
            self._ensure_root()
        top = rec.stack[-1]
        if top.phase is not None:
            phase = top.phase.value
        else:
            phase = "backward" if _graph_task_id() != -1 else "forward"
        attrs[semconv.MODULE_FQN] = top.fqn
        attrs[semconv.PHASE] = phase
        self._stats["collectives"] += 1
        rec.add_event(info.name, info.name, phase, attrs)

    def _emit(self, span: ReadableSpan) -> None:
        self._stats["spans"] += 1
        for on_end in self._processors:
            try:
                on_end(span)
            except Exception:
                self._stats["processor_errors"] += 1
                if self._stats["processor_errors"] == 1:
                    _log.warning(
                        "commspan: a span processor raised; the span is lost for it "
                        "(further errors are counted in mode.stats())",
                        exc_info=True,
                    )

    def _live(self) -> Iterator[tuple[str, Mapping[str, Any], Mapping[tuple[str, str], int]]]:
        rec = self._recorder
        if rec is None or not self._active:
            return
        for frame in list(rec.stack):
            yield frame.fqn, frame.attrs, dict(frame.counts)

    def _build_processors(self) -> list[Callable[[ReadableSpan], None]]:
        procs: list[Callable[[ReadableSpan], None]] = []
        if self.aggregator is not None:
            procs.append(self.aggregator.on_end)
        procs.extend(q.on_end for q in self._queues)
        if self._tracer_provider is not None:
            active: SpanProcessor | None = getattr(
                self._tracer_provider, "_active_span_processor", None
            )
            if active is not None:
                procs.append(active.on_end)
        return procs

    def _build_resource(self) -> Resource:
        """The resource of every span. Lowest precedence first:

        1. what the SDK detects (``telemetry.sdk.*``, its random
           ``service.instance.id``, the detectors ``OTEL_EXPERIMENTAL_RESOURCE_DETECTORS``
           names);
        2. what commspan detects: ``service.name`` ``commspan``,
           ``service.instance.id`` (the rank), ``host.name``, ``process.pid``;
        3. ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME``;
        4. the tracer_provider's resource, less what the SDK put there by itself
           (the placeholder ``service.name`` ``unknown_service…``, its
           ``service.instance.id``);
        5. ``resource_attributes=`` (``None`` leaves a key out).

        commspan's own ids (rank, local rank, world size, run id) are set after
        3 and 4, so neither the environment nor a provider can change them.
        """
        sdk = Resource.create()
        automatic = dict(sdk.attributes)
        attrs: dict[str, Any] = dict(automatic)
        attrs.update({
            semconv.SERVICE_NAME: "commspan",
            semconv.SERVICE_INSTANCE_ID: str(self._rank),
            semconv.HOST_NAME: socket.gethostname(),
            semconv.PROCESS_PID: os.getpid(),
        })
        attrs.update(OTELResourceDetector().detect().attributes)
        schema_url = sdk.schema_url
        if self._tracer_provider is not None:
            provided = self._tracer_provider.resource
            for key, value in provided.attributes.items():
                if key in automatic and automatic[key] == value:
                    continue  # the SDK's own value, not a choice of the user's
                if key == semconv.SERVICE_NAME and str(value).startswith("unknown_service"):
                    continue
                attrs[key] = value
            schema_url = schema_url or provided.schema_url
        own: dict[str, Any] = {
            semconv.RANK: self._rank,
            semconv.LOCAL_RANK: self._local_rank,
            semconv.WORLD_SIZE: self._world,
            semconv.RUN_ID: self.run_id,
        }
        ignored = sorted(k for k, v in own.items() if k in attrs and attrs[k] != v)
        if ignored:
            _log.warning(
                "commspan: resource attributes %s from OTEL_RESOURCE_ATTRIBUTES or the "
                "tracer_provider's resource are ignored; commspan sets them (run_id= sets "
                "the run id)", ", ".join(ignored),
            )
        attrs.update(own)
        for key, value in self._extra_resource.items():
            if value is None:
                attrs.pop(key, None)
            else:
                attrs[key] = value
        return Resource(attrs, schema_url)

    # ------------------------------------------------------------ public extras
    @property
    def active(self) -> bool:
        """Whether the mode is entered."""
        return self._active

    @property
    def rank(self) -> int:
        """The rank the mode recorded on entry."""
        return self._rank

    def stats(self) -> dict[str, Any]:
        """Counters: spans, collectives, steps traced/skipped, errors, and what export did.

        ``exporters`` holds one dict per exporter (see
        :class:`commspan.export.ExportStats`): ``handed`` (spans given to it),
        ``exported``, ``dropped``, ``failed``, ``pending``, ``in_flight``,
        ``abandoned`` and ``healthy``. For each,
        ``handed == exported + dropped + failed + pending + in_flight``; after
        :meth:`shutdown`, ``pending`` and ``in_flight`` are 0, so every span is
        exported or counted as lost. ``spans_exported``, ``spans_dropped``,
        ``spans_failed`` and ``spans_in_flight`` are the sums over exporters.

        Example:
            >>> from commspan import CommSpanMode
            >>> CommSpanMode().stats()["spans_dropped"]
            0
        """
        out: dict[str, Any] = dict(self._stats)
        out["internal_errors"] = (self._tracker.internal_errors if self._tracker else 0) + (
            self._dispatch.errors if self._dispatch else 0
        )
        exporters = [q.stats() for q in self._queues]
        out["exporters"] = exporters
        for total, key in (("spans_exported", "exported"), ("spans_dropped", "dropped"),
                           ("spans_failed", "failed"), ("spans_in_flight", "in_flight")):
            out[total] = sum(e[key] for e in exporters)
        return out

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every span queued so far has been through an ``export`` call, at
        most ``timeout_s`` in total.

        Unlike leaving the mode, this waits for unhealthy exporters too.

        Args:
            timeout_s: bound on the whole wait, in seconds; default ``flush_timeout_s``.

        Returns:
            ``True`` if every exporter's queue was flushed in time.
        """
        timeout = self._flush_timeout if timeout_s is None else timeout_s
        return self._flush_queues(timeout, wait_if_unhealthy=True)

    def _flush_on_exit(self) -> None:
        """Leaving the mode waits (up to ``flush_timeout_s``) for healthy exporters
        only: one whose last export failed or whose last flush timed out is asked
        to flush in the background, so a dead backend does not add
        ``flush_timeout_s`` to every ``with mode:`` block."""
        self._flush_queues(self._flush_timeout, wait_if_unhealthy=False)

    def _flush_queues(self, timeout_s: float, wait_if_unhealthy: bool) -> bool:
        deadline = time.monotonic() + timeout_s
        for q in self._queues:  # start every exporter now, then wait for each
            q.flush(0.0)
        ok = True
        for q in self._queues:
            left = max(0.0, deadline - time.monotonic())
            ok = q.flush(left, wait_if_unhealthy=wait_if_unhealthy) and ok
        return ok

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Flush and close every exporter, all within ``timeout_s`` seconds.

        Afterwards nothing is pending or in flight: what could not be sent in
        time is counted as dropped (still queued) or failed (inside an export
        call that did not return), and logged once per exporter.

        Args:
            timeout_s: bound on the whole shutdown, in seconds; default ``flush_timeout_s``.
        """
        timeout = self._flush_timeout if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        for q in self._queues:  # start every exporter now: a hung one delays no other
            q.flush(0.0)
        for q in self._queues:
            q.shutdown(max(0.0, deadline - time.monotonic()))


def _top_dispatch_mode() -> Any:
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        return _get_current_dispatch_mode()
    except Exception:  # pragma: no cover
        return None


# Resource keys commspan owns; resource_attributes= may override all but the run id.
_OWN_RESOURCE_KEYS = (semconv.RANK, semconv.LOCAL_RANK, semconv.WORLD_SIZE, semconv.RUN_ID)


def _check_resource_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
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
        if key in out and out[key] is None:
            raise ValueError(
                f"resource_attributes[{key!r}]=None is not accepted; readers need "
                f"{key} to tell ranks apart (leave it out of resource_attributes)"
            )
    return out


def _make_sampler(sample: int | Iterable[int] | Sampler | None) -> Sampler:
    if sample is None:
        return lambda i: True
    if isinstance(sample, bool):
        raise TypeError(f"sample={sample!r} is not valid; pass N, a set of steps or a callable")
    if isinstance(sample, int):
        if sample < 1:
            raise ValueError(f"sample={sample!r} is not valid; every Nth step needs N >= 1")
        n = sample
        return lambda i: i % n == 0
    if callable(sample):
        return sample
    try:
        steps = frozenset(int(s) for s in sample)
    except TypeError:
        raise TypeError(
            f"sample={sample!r} is not valid; pass N, a collection of step ints or a callable"
        ) from None
    return lambda i: i in steps
