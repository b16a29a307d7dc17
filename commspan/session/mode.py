"""CommSpanMode: the context manager that wires capture, spans and processors.

Flow of information (one direction)::

    nn.Module hooks ─┐                 ownership rules
                     ├─> SpanRecorder frames ─> ReadableSpan ─> processors
    dispatch mode ───┘                                          ├ Aggregator (in-process)
                                                                ├ ExportQueue ─> JSONL / OTLP
                                                                └ a TracerProvider's processors

The mode builds each stage and hands it the next one (the tracker gets the
recorder, the recorder gets the processors as its sink); no stage calls back
into the mode. Its settings are checked by :mod:`commspan.session.config`, the
resource is built by :mod:`commspan.session.resource`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from commspan import semconv
from commspan._errors import ErrorCounter, Once, seconds, whole_number
from commspan._fork import renew_after_fork
from commspan.analysis.counts import Aggregator
from commspan.capture import ModuleObserver
from commspan.capture.backward import graph_task_id, recomputing, recomputing_module
from commspan.capture.collectives import CollectiveInfo
from commspan.capture.dispatch import (
    CollectiveDispatchMode,
    OpCallback,
    OpRecordingDispatchMode,
    running_module,
)
from commspan.capture.gcwatch import GcWatch
from commspan.capture.groups import ProcessGroups
from commspan.capture.modules import ModuleTracker
from commspan.capture.parallel import ParallelModules
from commspan.capture.ranks import Ranks, process_ranks, ranks_known
from commspan.exporters.queue import ExportQueue
from commspan.ownership import (
    ACTIVATION_KEY,
    CollectiveRule,
    Issued,
    Ownership,
    counted_names,
    resolve,
    without_wrapper,
)
from commspan.ownership.ddp import DdpModules
from commspan.ownership.fsdp import FsdpUnits
from commspan.ownership.innermost import InnermostModule
from commspan.ownership.pipeline import PipelineStages
from commspan.semconv import Phase
from commspan.session.config import Sampler, mode_config
from commspan.session.hang import HangWatch
from commspan.session.resource import build_resource
from commspan.session.sampling import RankSample
from commspan.spans.frames import Frame, OpenSpan
from commspan.spans.recorder import SpanRecorder
from commspan.spans.timing import CollectiveLog, CollectiveTiming, add_timing
from commspan.spans.traces import TraceOpener

__all__ = ["CommSpanMode", "Sampler"]

_log = logging.getLogger(__name__)
_graph_task_id = graph_task_id
_OUTSIDE_RECOMPUTE = (None, Phase.BACKWARD)
"""Phases of the innermost span in which a collective that autograd runs while
checkpointing re-runs a forward is that recompute's (no recompute span is open)."""


def _enclosing_span(stack: list[Any], fqn: str) -> str:
    """The module of the innermost open span (the rank span aside) that is ``fqn`` or
    encloses it by name, else ``fqn``: the span a checkpointed method of module
    ``fqn`` ran in forward (a child's method called directly runs in its parent's
    span, which is open again while the backward it needs runs).

    Example:
        >>> class F: fqn = "Net.block"
        >>> _enclosing_span([F()], "Net.block.attn"), _enclosing_span([], "Net.x")
        ('Net.block', 'Net.x')
    """
    for frame in reversed(stack):
        span = frame.fqn
        if span == fqn or (fqn.startswith(span) and fqn[len(span):len(span) + 1] == "."):
            return span if span != semconv.GLOBAL_FQN else fqn
    return fqn


def _version() -> str:
    from commspan import __version__

    return __version__


_ENTERED: weakref.WeakSet[CommSpanMode] = weakref.WeakSet()
"""Modes entered and not left (``mode.__enter__()`` without its ``__exit__``)."""


def _leave_at_exit() -> None:
    """At interpreter exit, leave the modes the main thread (the one exit handlers run
    on) entered and never left: their open trace is closed and handed to the exporters,
    which the export queues' own exit handler (registered before this one, so run after
    it) then flushes. Without it the open step's spans, its rank span and its root among
    them, vanish uncounted."""
    me = threading.get_ident()
    for mode in list(_ENTERED):
        if mode._active and mode._owner == me:
            try:
                mode.__exit__(None, None, None)
            except Exception:  # nothing may stop the interpreter's exit
                _log.debug("commspan: leaving a mode at exit raised", exc_info=True)


_AT_EXIT = [False]  # _leave_at_exit registered


def _register_leave_at_exit() -> None:
    """Register :func:`_leave_at_exit` when a mode is first entered: after the export
    queues' handler (registered when commspan is imported) and after the handler of a
    ``tracer_provider`` made before the mode, so it runs before both (last in, first
    out)."""
    if not _AT_EXIT[0]:
        _AT_EXIT[0] = True
        atexit.register(_leave_at_exit)


def _each(*parts: Callable[[], object] | None) -> None:
    """Call each of ``parts`` (``None``: skipped), even after one raised; then raise the
    first error (an interrupt included)."""
    first: BaseException | None = None
    for part in parts:
        if part is None:
            continue
        try:
            part()
        except BaseException as error:  # noqa: PERF203 - each part must run
            if first is None:
                first = error
    if first is not None:
        raise first


def _leave_from_under(mode: Any) -> None:
    """Take ``mode`` off this thread's dispatch-mode stack from under the modes pushed
    after it (left out of order: the program's own mode entered after commspan's and
    still in), putting those back as they were: popping the top would remove the
    program's mode and leave commspan's recording."""
    from torch.utils._python_dispatch import (
        _get_current_dispatch_mode,
        _get_current_dispatch_mode_stack,
        _pop_mode,
        _push_mode,
    )

    if not any(m is mode for m in _get_current_dispatch_mode_stack()):
        return  # not on this thread's stack
    leave = mode.__exit__
    above: list[Any] = []
    while _get_current_dispatch_mode() is not mode:
        above.append(_pop_mode())
    try:
        leave(None, None, None)
    finally:
        for m in reversed(above):
            _push_mode(m)


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
            Text UTF-8 cannot encode is refused here; a variable holding
            bytes that are not UTF-8 gives a run id with them as ``\\xNN``
            escapes (with a warning).
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
            ``commspan.rank`` and ``commspan.world_size`` come from
            torch.distributed (or ``RANK``/``WORLD_SIZE``), ``commspan.local_rank``
            from ``LOCAL_RANK`` (left out when unset in a world of several
            ranks); only this argument can override them (e.g. to simulate
            ranks in one process), the environment and the provider cannot.
            ``commspan.run_id`` is set with ``run_id=``.
        export_queue_size: spans each exporter queue holds before dropping.
        flush_timeout_s: the most leaving the context waits for exporters, in
            seconds (``float("inf")``: until done); it does not wait for an
            exporter whose last export failed or timed out, until one succeeds again.
        record_exception_messages: when a user's exception crosses a span,
            put ``str(exception)`` in the span's status description and its
            ``exception`` event (default). ``False`` keeps the exception type
            only: messages can hold data (tensor values, paths, user input)
            that should not leave the process.
        module_observer: a :class:`~commspan.capture.ModuleObserver` told about
            every module event the mode records (forward and backward starts
            and ends), on top of the spans.
        time_collectives: record when each collective completes (default):
            its event gets ``commspan.collective.duration_ns``, ``algbw`` and
            ``busbw``, and module spans the ``commspan.comm_time_ns.<phase>``
            roll-ups. A span whose collectives have not completed when it
            closes is emitted once they have, at the end of its step at the
            latest (docs/design.md, "When collectives complete"). ``False``:
            events mark the issue only, as in commspan 0.1.
        hang_timeout_s: when a collective on this rank has not completed after
            this many seconds, write a ``commspan.hang`` record at once
            through the exporters and flush them (a watchdog thread does it,
            while the training thread is blocked in the collective). ``None``
            (default): no watchdog. Costs one thread waking every
            ``min(hang_timeout_s / 4, 1 s)``; nothing on the training thread.
            It watches the collectives of traced steps only: in a step
            ``sample=`` leaves out nothing is recorded, so a hang there writes
            no record (a dump or ``dump_signal`` does, saying the step is not
            traced).
        dump_signal: a signal (e.g. ``signal.SIGUSR1``) on which the rank
            writes a ``commspan.hang`` record, also while blocked inside a
            collective. Needs the mode entered on the main thread; the
            previous handler is restored when the mode is left. ``None``
            (default): no handler.
        ranks: which ranks trace, for big jobs: ``None`` (default, all), a set
            of ranks, a fraction (``0.125``: every 8th rank, rank 0 included) or
            a :class:`~commspan.session.sampling.RankSample`, e.g.
            ``RankSample.one_per_group(mesh, "tp")``. The other ranks run every
            step as a sampled-out step and record nothing (no hang records
            either); traced ranks name
            the rule in their resource (``commspan.sampling.ranks``).
        record_gc: record the pauses of Python's garbage collector during traces
            (default): each full collection, and each younger one of 1 ms or more,
            becomes a ``commspan.gc`` event on the rank span, with its generation,
            duration and the module the traced thread was in. ``commspan
            stragglers`` charges them to the late arrivals they explain. Costs a
            callback per collection (a few per step).

    Threads: a mode traces the thread that entered it (and the autograd work
    done for that thread's graphs); module calls on other threads are not
    recorded, and ``mode.step()`` called from another thread yields ``False``
    (untraced, logged once). Use one mode per thread to trace several threads.

    Raises:
        TypeError: an argument has the wrong type (the message says which).
        ValueError: ``resource_attributes`` sets ``commspan.run_id`` or leaves
            out (``None``) one of commspan's own keys, or UTF-8 cannot encode
            ``run_id`` (a lone surrogate).

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
        record_exception_messages: bool = True,
        module_observer: ModuleObserver | None = None,
        time_collectives: bool = True,
        hang_timeout_s: float | None = None,
        dump_signal: int | None = None,
        ranks: RankSample | Iterable[int] | float | None = None,
        record_gc: bool = True,
        _observer: ModuleObserver | None = None,
        _op_observer: OpCallback | None = None,
        _fresh_names: bool = False,
        _torch_names: bool = False,
    ) -> None:
        self._config = config = mode_config(
            tracer_provider=tracer_provider,
            exporters=exporters,
            aggregator=aggregator,
            run_id=run_id,
            sample=sample,
            record_params=record_params,
            resource_attributes=resource_attributes,
            export_queue_size=export_queue_size,
            flush_timeout_s=flush_timeout_s,
            record_exception_messages=record_exception_messages,
            # ``_observer=`` is the former, private name of ``module_observer=``
            module_observer=module_observer if module_observer is not None else _observer,
            time_collectives=time_collectives,
            hang_timeout_s=hang_timeout_s,
            dump_signal=dump_signal,
            ranks=ranks,
            record_gc=record_gc,
        )
        self.aggregator: Aggregator | None = config.aggregator
        self.run_id = run_id or ""
        self.resource: Resource | None = None
        self._queues = [
            ExportQueue(e, max_queue_size=config.export_queue_size) for e in config.exporters
        ]
        self._ownership = InnermostModule()
        # framework rules, tried before the position (docs/parallelisms.md)
        self._rules: tuple[CollectiveRule, ...] = (PipelineStages(), FsdpUnits(), DdpModules())
        self._parallel = ParallelModules()
        self._traces = TraceOpener()  # lives as long as the mode: session traces number on
        self._groups = ProcessGroups()
        self._op_observer = _op_observer
        # commspan.compat: each entry names modules as a new mode would (its classes'
        # contexts start from zero); otherwise names last as long as the mode
        self._fresh_names = bool(_fresh_names)
        # commspan.compat: modules inside activation-checkpointing wrappers named by
        # torch's paths (``layers.0._checkpoint_wrapped_module``), as torch's trackers
        self._torch_names = bool(_torch_names)
        self._processors: list[Callable[[ReadableSpan], None]] = []
        self._recorder: SpanRecorder | None = None
        self._tracker: ModuleTracker | None = None
        self._dispatch: CollectiveDispatchMode | None = None
        self._active = False
        self._entering = False  # a thread is inside __enter__ (under _enter_lock)
        self._shut_down = False  # shutdown() closed the exporters: no entry after it
        self._capturing = False  # the dispatch mode was pushed by _start_capture
        self._enter_lock = threading.Lock()
        renew_after_fork(self, "_enter_lock")
        self._owner = 0  # thread that entered the mode
        self._watch_errors = ErrorCounter(
            _log, "could not start the hang watchdog; this rank writes no hang records "
            "(training goes on)")
        self._identity_errors = ErrorCounter(
            _log, "could not take this rank's place in the process group that came up "
            "after the mode was entered; its spans go on saying rank 0 of 1 (training "
            "goes on)")
        self._warned = Once()
        self._in_step = False
        self._last_step: int | None = None  # highest step number so far (a repeat
        # shares its trace)
        self._untraced_step: int | None = None  # the step sample= leaves out, in it
        self._paused = False
        self._popped = False
        self._ranks = Ranks(0, 0, 1)
        self._guessed_ranks = False  # entered with no process group and no RANK
        self._rank_traced = True
        self._resource_key: tuple[Any, ...] | None = None
        self._processor_errors = ErrorCounter(
            _log,
            "a span processor raised; the span is lost for it (further errors are counted "
            "in mode.stats())",
        )
        self._stats = {"spans": 0, "collectives": 0, "steps_traced": 0, "steps_skipped": 0,
                       "hang_records": 0, "gc_pauses": 0, "gc_pauses_unrecorded": 0}
        self._gc: GcWatch | None = None
        self._log = CollectiveLog()
        self._watch: HangWatch | None = None
        self._untimed = 0  # collectives emitted without a completion, earlier recorders

    # ------------------------------------------------------------ context
    def __enter__(self) -> CommSpanMode:
        with self._enter_lock:  # two threads entering at once: one of them refused
            if self._active or self._entering:
                raise RuntimeError(
                    "this CommSpanMode is already active; leave it before entering it "
                    "again, or create a second CommSpanMode"
                )
            if self._shut_down:
                raise RuntimeError(
                    "this CommSpanMode was shut down (mode.shutdown() closed its "
                    "exporters, so everything it traced now would be dropped); create a "
                    "new CommSpanMode, and call shutdown() once, after its last use"
                )
            self._entering = True
        try:
            self._enter()
        except BaseException:
            # whatever was installed comes off again: no half-entered mode (its
            # hooks and dispatch mode left behind, every later entry refused)
            self._undo_enter()
            raise
        finally:
            self._entering = False
        return self

    def _undo_enter(self) -> None:
        try:
            if self._active:
                self.__exit__(None, None, None)
            elif self.aggregator is not None:
                self.aggregator.attach_live(None)
        except Exception:  # the original error is the one to see
            _log.debug("commspan: cleaning up a failed entry raised", exc_info=True)
        self._active = False

    def _identify(self) -> Ranks:
        """Where this process is (rank, world size), the run id and the resource that
        says both; a run id chosen while the ranks were a guess is chosen again."""
        config = self._config
        known = ranks_known()
        self._ranks = ranks = process_ranks()
        # a rank the rank sample leaves out runs every step as a sampled-out one
        self._rank_traced = config.ranks.traces(ranks.rank, ranks.world_size)
        if known and not self._rank_traced and ranks.rank == 0 and not config.ranks.chosen(
                ranks.world_size):
            _log.warning("commspan: ranks=%s names no rank of this world of %d: no rank "
                         "traces (ranks are numbered 0 to %d)", config.ranks.description,
                         ranks.world_size, ranks.world_size - 1)
        if not self.run_id or (known and self._guessed_ranks):
            from commspan.session.run_id import resolve_run_id

            self.run_id = resolve_run_id(config.run_id)
        self._guessed_ranks = not known
        key = (*ranks, self.run_id)
        if self.resource is None or self._resource_key != key:
            extra = dict(config.resource_attributes)
            if config.ranks.description != "all":
                extra.setdefault(semconv.SAMPLING_RANKS,
                                 config.ranks.describe(ranks.world_size))
            self.resource = build_resource(ranks, self.run_id, config.tracer_provider, extra)
            self._resource_key = key
        self._traces.identify(self.run_id, ranks.rank, ranks.world_size)
        return ranks

    def _learn_ranks(self) -> None:
        """The mode was entered before ``init_process_group`` with no ``RANK`` set
        (``with CommSpanMode(): main()`` under ``mp.spawn``): it guessed rank 0 of 1.
        Once the process group is up, at the next step, it takes the rank, the world
        size and a run id agreed with the other ranks, as if entered now."""
        spans_before = self._stats["spans"]
        was_traced = self._rank_traced
        ranks = self._identify()
        assert self._recorder is not None and self.resource is not None
        self._recorder.resource = self.resource
        if spans_before and self._warned.first("ranks guessed"):
            _log.warning(
                "commspan: the mode was entered before torch.distributed was initialised, "
                "with no RANK set: its %d spans recorded until now say rank 0 of 1 (and "
                "went to rank 0's file); from here on this rank is %d of %d. Enter the "
                "mode after init_process_group, or set RANK and WORLD_SIZE (torchrun "
                "does) (not logged again)", spans_before, ranks.rank, ranks.world_size)
        if was_traced and not self._rank_traced:
            self._stop_watch()  # the rank sample leaves this rank out
            self._pause()
        elif self._rank_traced and not was_traced:
            self._resume()
            self._start_watches()

    def _enter(self) -> None:
        config = self._config
        self._identify()
        assert self.resource is not None
        if self.aggregator is not None:
            self.aggregator.reset()
        self._owner = threading.get_ident()
        self._recorder = SpanRecorder(
            self._emit,
            self.resource,
            _version(),
            record_messages=config.record_exception_messages,
            traces=self._traces,
        )
        # One dispatch mode and one tracker for the mode's life: entering
        # again keeps what they learned (module names and attributes, process
        # groups, per-group sequence numbers; module names not with _fresh_names).
        if self._dispatch is None:
            if self._op_observer is None:
                self._dispatch = CollectiveDispatchMode(
                    self._on_collective, self._groups, timing=config.time_collectives
                )
            else:  # commspan.compat's CommDebugMode lists every op; nothing else pays for it
                self._dispatch = OpRecordingDispatchMode(
                    self._on_collective, self._op_observer, self._groups,
                    timing=config.time_collectives,
                )
        self._recorder.settled = self._dispatch.completions.settled
        self._log.pending = self._dispatch.completions.pending
        if self._tracker is None:
            self._tracker = ModuleTracker(
                self._recorder,
                observer=config.module_observer,
                record_params=config.record_params,
                groups=self._groups,
                parallel=self._parallel,
                torch_names=self._torch_names,
            )
        else:
            self._tracker.recorder = self._recorder
            if self._fresh_names:
                self._tracker.forget_names()
        self._processors = self._build_processors()
        if self.aggregator is not None:
            self.aggregator.attach_live(self._recorder.live_spans)
        self._active = True
        _ENTERED.add(self)
        _register_leave_at_exit()
        self._paused = False
        self._start_capture()
        self._parallel.pipeline.install()
        if self._rank_traced:
            self._start_watches()
        else:
            self._pause()  # nothing is recorded on this rank, in steps or between them

    def _start_watches(self) -> None:
        """The garbage-collector watch and the hang watchdog of a traced rank, as
        configured."""
        config = self._config
        assert self._recorder is not None
        if config.record_gc and self._gc is None:
            self._gc = GcWatch(self._gc_where)
            self._gc.install()
            self._recorder.before_root = self._record_gc
        if self._watch is None and (
                config.hang_timeout_s is not None or config.dump_signal is not None):
            watch = HangWatch(
                self._write_hang, self._log.not_completed, config.hang_timeout_s,
                config.dump_signal,
            )
            try:
                watch.start()
            except Exception:  # no thread, no descriptor for the signal: trace without it
                self._watch_errors.record()
                with contextlib.suppress(Exception):
                    watch.stop()
            else:
                self._watch = watch

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if not self._active:
            raise RuntimeError(
                "this CommSpanMode is not active (left already, or never entered); leave "
                "it once per `with mode:`")
        if threading.get_ident() != self._owner:
            raise RuntimeError(
                f"this CommSpanMode was entered on thread {self._owner} and is left on "
                f"thread {threading.get_ident()}: its dispatch mode is on the entering "
                "thread's stack; leave it on the thread that entered it (it stays active)")
        self._in_step = False
        try:
            # each part runs even if one before it raised or was interrupted (Ctrl-C
            # while the watchdog joins, while the trace closes): the mode never stays
            # half installed
            # (a generator holding the mode closed early: GeneratorExit, not an error)
            error = None if isinstance(exc, GeneratorExit) else exc
            _each(self._stop_watch, self._stop_capture, lambda: self._end_trace(error),
                  self._parallel.pipeline.uninstall,
                  self._tracker.uninstall if self._tracker is not None else None)
        finally:
            self._active = False
            _ENTERED.discard(self)
            if self._gc is not None:
                self._gc.remove()
                self._stats["gc_pauses_unrecorded"] += (
                    len(self._gc.take()) + self._gc.errors + self._gc.dropped
                )
                self._gc = None  # its counters are in the stats now
            if self._recorder is not None:
                self._untimed += self._recorder.forced
                self._recorder.forced = 0
            if self._dispatch is not None:
                self._dispatch.completions.clear()
            if self.aggregator is not None:
                self.aggregator.attach_live(None)
            self._flush_on_exit()

    def _stop_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()

    def _start_capture(self) -> None:
        assert self._tracker is not None and self._dispatch is not None
        self._tracker.install()
        self._dispatch.__enter__()
        self._capturing = True

    def _stop_capture(self) -> None:
        # (only a dispatch mode this mode pushed: popping one it never pushed, after a
        # failed entry, would take the program's own mode off the stack)
        if self._capturing and self._dispatch is not None and not (
                self._paused and self._popped):
            if self._dispatch.on_top():
                self._dispatch.__exit__(None, None, None)
            else:  # a dispatch mode of the program's entered after it, still in
                _leave_from_under(self._dispatch)
        self._capturing = False
        self._popped = False
        if self._tracker is not None:
            self._tracker.active = False

    # ------------------------------------------------------------ steps
    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[bool]:
        """Trace one training step as its own trace, shared by all ranks.

        Yields ``True`` when the step is traced, ``False`` when sampled out
        or called from a thread other than the one that entered the mode
        (such a step is not traced; the first one logs a warning).

        Raises:
            RuntimeError: used outside ``with mode:``, or inside another step
                on the same thread.
            TypeError: ``index`` is not a whole number (an ``int``, or an
                integer type with ``__index__`` such as ``numpy.int64``).
            ValueError: ``index`` does not fit a 64-bit int.

        Example:
            >>> from commspan import CommSpanMode
            >>> mode = CommSpanMode()
            >>> with mode:
            ...     for i in range(2):
            ...         with mode.step(i):
            ...             pass  # forward, backward, optimizer step
        """
        if type(index) is not int:  # a numpy or torch integer is one too
            whole = whole_number(index)
            if whole is None:
                raise TypeError(f"index={index!r} is not valid; pass the step number as an int")
            index = whole
        if not -(1 << 63) <= index < (1 << 63):
            raise ValueError(f"index={index!r} is not valid; OTLP carries a step number as a "
                             "64-bit int: pass one between -2**63 and 2**63 - 1")
        if not self._active:
            raise RuntimeError(
                "mode.step() was called outside the mode; use it inside `with mode:`"
            )
        if threading.get_ident() != self._owner:
            self._foreign_step(index)
            yield False
            return
        if self._in_step:
            raise RuntimeError(
                f"mode.step({index}) was entered inside another step; steps do not nest"
            )
        self._end_trace(None)
        if self._guessed_ranks and ranks_known():
            try:
                self._learn_ranks()
            except Exception:
                self._guessed_ranks = False  # (tried once)
                self._identity_errors.record()
        last = self._last_step
        if last is not None and index <= last and self._warned.first("step repeated"):
            _log.warning(
                "commspan: mode.step(%d) after mode.step(%d): a step number not above the "
                "highest so far; one used before shares that step's trace, and readers "
                "add the two up; pass a number that grows over the whole run (e.g. "
                "epoch * steps_per_epoch + i) (not logged again)", index, last)
        self._last_step = index if last is None else max(last, index)
        traced = bool(self._rank_traced and self._config.sampler(index))
        # from here on, what sets up the step is inside the try whose finally leaves it:
        # an interrupt (Ctrl-C) while the step is entered must not leave it entered
        self._in_step = True
        if not traced:
            self._stats["steps_skipped"] += 1
            self._untraced_step = index  # a hang record now says so
            try:
                if self._rank_traced:  # an untraced rank is paused from the start
                    self._pause()
                yield False
            finally:
                self._in_step = False
                self._untraced_step = None
                self._parallel.pipeline.reset_step()  # ops announced but never seen
                if self._rank_traced:
                    self._resume()
            return
        self._stats["steps_traced"] += 1
        assert self._recorder is not None
        error: BaseException | None = None
        try:
            if self._tracker is not None:  # (modules compiled in place since the last step)
                self._tracker.find_compiled_in_place()
            self._recorder.begin(self._traces.step(index))
            yield True
        except GeneratorExit:
            # a generator holding the step was closed (the caller broke out of its
            # loop): normal Python, not an error of the step
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._in_step = False
            self._end_trace(error)
            if self._tracker is not None:
                self._tracker.reset_step()
            if self._dispatch is not None:
                self._dispatch.clear_labels()
            self._parallel.pipeline.reset_step()

    def _foreign_step(self, index: int) -> None:
        if self._warned.first("foreign step"):
            _log.warning(
                "commspan: mode.step(%d) was called on thread %r, not on the thread that "
                "entered the mode; a mode traces only that thread, so this step is not "
                "traced (use one CommSpanMode per thread; further such steps are not logged)",
                index,
                threading.current_thread().name,
            )

    def _pause(self) -> None:
        """Stop capturing for an untraced step (hooks off, dispatch mode popped)."""
        self._paused = True
        if self._tracker is not None:
            self._tracker.pause()
        # The dispatch mode leaves the stack only when it is on top; under a
        # mode pushed later it stays, and its callback ignores what it sees.
        if self._dispatch is not None and self._dispatch.on_top():
            self._dispatch.__exit__(None, None, None)
            self._popped = True  # (after the pop: an interrupt before it pushes no second)
        else:
            self._popped = False
            if self._dispatch is not None:  # nor numbers what it sees meanwhile
                self._dispatch.recording = False

    def _resume(self) -> None:
        if self._active and self._paused:
            self._paused = False
            assert self._tracker is not None and self._dispatch is not None
            self._tracker.install()
            self._dispatch.recording = True
            if self._popped:
                self._dispatch.clear_labels()  # it saw no label exits while off the stack
                self._dispatch.__enter__()
                self._popped = False

    # ------------------------------------------------------------ traces
    def _end_trace(self, error: BaseException | None) -> None:
        """End the open trace (a step's or a session's), if any: the tracker
        accounts for what is still open, then the recorder closes it all."""
        rec = self._recorder
        if rec is None or rec.root is None:
            return
        if self._tracker is not None:
            self._tracker.unwind(error)
        rec.end(error)
        for queue in self._queues:
            # start exporting the trace now, without waiting for it: its spans are
            # dead sooner (the garbage collector's oldest generation never sees
            # them; docs/performance.md, "Stalls") and reach the backend sooner
            queue.flush(0.0)
        if self._dispatch is not None and self._dispatch.completions.outputs:
            # outputs never waited were given up with their trace: forget them, so
            # that the next spans know at once that nothing is outstanding
            self._dispatch.completions.sweep()

    # ------------------------------------------------------------ garbage collector
    def _gc_where(self) -> tuple[int, str | None, str | None] | None:
        """Where the traced thread is, for a collection (any thread may ask)."""
        rec = self._recorder
        if rec is None or self._paused or rec.root is None:
            return None
        stack = rec.stack
        top = stack[-1] if len(stack) > 1 else None
        if top is None:
            return rec.trace_id, None, None
        return rec.trace_id, top.fqn, top.phase.value if top.phase is not None else None

    def _record_gc(self, root: Frame) -> None:
        """The recorder is about to build ``root``, the rank frame of the trace ending:
        the trace's collections become its events (those that ran while its other
        spans were closing included: the rank span's end moves past them). Those
        noted later (while the rank span itself was built) carry an earlier trace
        and are counted as unrecorded."""
        watch, rec = self._gc, self._recorder
        if watch is None or rec is None:
            return
        try:
            self._attach_gc(watch, rec, root)
        except Exception:  # never into the recorder
            self._stats["gc_pauses_unrecorded"] += 1

    def _attach_gc(self, watch: GcWatch, rec: SpanRecorder, root: Frame) -> None:
        # (a pause is noted once it ended: none ends after now, but a wall clock set
        # back while it ran dates it later; the rank span may not end after the step)
        now = time.time_ns()
        for p in watch.take():
            if p.trace_id != rec.trace_id:
                self._stats["gc_pauses_unrecorded"] += 1
                continue
            attrs: dict[str, Any] = {
                semconv.GC_GENERATION: p.generation,
                semconv.GC_DURATION_NS: p.duration_ns,
                semconv.GC_COLLECTED: p.collected,
            }
            if p.fqn is not None:
                attrs[semconv.MODULE_FQN] = p.fqn
            if p.phase is not None:
                attrs[semconv.PHASE] = p.phase
            rec.add_plain_event(root, semconv.EVENT_GC, attrs, at=min(p.start_ns, now))
            root.end = max(root.end, min(p.start_ns + p.duration_ns, now))
            self._stats["gc_pauses"] += 1

    # ------------------------------------------------------------ capture
    def _on_collective(
        self, info: CollectiveInfo, attrs: dict[str, Any]
    ) -> CollectiveTiming | None:
        """Attach a collective to the span open now; charge it to its owner. Returns the
        record of its completion to fill in, when collectives are timed."""
        rec = self._recorder
        if rec is None or self._paused:
            return None
        tracker = self._tracker
        if tracker is not None and tracker.unwound is not None:
            tracker.close_unwound()  # (a module caught a RecursionError: not its frames)
        rec.ensure_trace()
        top = rec.stack[-1]
        in_autograd = _graph_task_id() != -1
        attrs[semconv.MODULE_FQN] = top.fqn  # where it was issued: the timeline
        owner = None
        parallel = self._parallel
        dispatch = self._dispatch
        if parallel.has_fsdp or parallel.has_ddp or parallel.has_pipeline or top.phase is None:
            labels = dispatch.labels() if dispatch is not None else ()
            tensor = dispatch.p2p_tensor() if dispatch is not None else None
            issued = Issued(info.name, attrs, top.fqn, top.phase, in_autograd, labels,
                            self._open_fqns, tensor)
            owner = resolve(issued, parallel, self._rules)
        if owner is None and dispatch is not None:
            owner = self._compiled_owner(dispatch, in_autograd, top.fqn)
        counted: tuple[str, ...] = ()
        if owner is None:
            # a checkpointed function's own collective, re-run with no recompute span
            # open: in the backward span that needed its activations, or the rank span
            rerun = in_autograd and top.phase in _OUTSIDE_RECOMPUTE and recomputing(False)
            owner = self._ownership.owner(top.fqn, top.phase, in_autograd, rerun)
            if rerun and tracker is not None:
                # owned by the module whose forward ran it (as in forward: the
                # innermost open span around the method's module, whose method it is
                # or a child's), not by the backward span that needed the activations
                module = recomputing_module()
                name = tracker.fqn(module) if module is not None else None
                if name is not None:
                    name = _enclosing_span(rec.stack, name)
                if name is not None and name != owner.fqn:
                    owner = owner._replace(fqn=name)
                    counted = counted_names(name, tracker.ran)
        else:
            if owner.kind:
                attrs[semconv.OWNER_KIND] = owner.kind
            if owner.attributes:
                attrs.update(owner.attributes)
            assert self._tracker is not None
            counted = counted_names(owner.fqn, self._tracker.ran)
        phase = owner.phase.value
        attrs[semconv.OWNER_FQN] = owner.fqn
        attrs[semconv.OWNER_SOURCE] = owner.source
        attrs[semconv.PHASE] = phase
        self._stats["collectives"] += 1
        if not self._config.time_collectives:
            rec.add_event(info.name, info.name, phase, attrs, counted)
            return None
        timing = CollectiveTiming(attrs, phase, info.name)
        # (its issue time is set by the dispatch mode right before the op runs: until
        # then the watchdog leaves it alone, CollectiveLog.not_completed)
        rec.add_event(info.name, info.name, phase, attrs, counted, timing)
        self._log.add(timing)
        return timing

    def _compiled_owner(self, dispatch: Any, in_autograd: bool, span: str) -> Ownership | None:
        """In a compiled region run node by node (aot_eager): the submodule of the
        graph node issuing the collective, and its pass.

        Dynamo runs the graph it traced on one module for every module of that
        class (torch.compile on each block: one graph; a block's own frame,
        compiled on its own after a graph break; a compiled function called with
        each block), and the graph names the modules of the one it traced. In
        forward a node is found under the module the graph runs for: the compiled
        frame's ``self`` (or argument), on the stack (:func:`running_module`). In
        backward (no such frame) a node whose module is not inside the span open
        now (the compiled module's, or a block's Dynamo called eagerly) is found by
        its path under the span's module instead (``Net.layers.1`` + ``attn``),
        when a module of that name exists. A backward node of a graph whose module
        (the frame's local) is neither the span's nor found there ran for a module
        that only the forward's frame knew (one whose call Dynamo traced, with no
        span of its own): which module of its class that was is unknown, so
        ``None`` (the span open around the call owns it), never the module the
        graph was traced on."""
        compiled = dispatch.compiled_module()
        tracker = self._tracker
        if compiled is None or tracker is None:
            return None
        forward = compiled[1] and not in_autograd
        fqn = None
        if forward:
            source = dispatch.compiled_source()
            if source is not None:
                module = running_module(*source)
                if module is not None:
                    fqn = tracker.fqn(module)
        if fqn is None:
            fqn = self._traced_owner(dispatch, tracker, compiled, span)
            if fqn is None:
                return None
        phase = Phase.FORWARD if forward else (
            Phase.RECOMPUTE if compiled[1] else Phase.BACKWARD)
        return Ownership(fqn, phase, semconv.SOURCE_COMPILE)

    @staticmethod
    def _traced_owner(dispatch: Any, tracker: ModuleTracker,
                      compiled: tuple[int, bool, str | None], span: str) -> str | None:
        """:meth:`_compiled_owner` from the graph node's module (the module the graph
        was traced on) and the span open now, or ``None``."""
        fqn = tracker.fqn_of_id(compiled[0])
        path = compiled[2]
        if path is None and fqn is not None:
            source = dispatch.compiled_source()
            if source is not None:
                # under another local of the compiled frame (a compiled function's
                # argument): its module only if it is the span's, the one running
                under = source[1]
                root = fqn if not under else (
                    fqn[:-len(under) - 1] if fqn.endswith("." + under) else None)
                return fqn if root == span else None
        if path and not tracker.torch_names and ACTIVATION_KEY in path:
            # a compiled activation-checkpointing wrapper (torchtitan's block): the
            # modules it wraps are named as under the wrapper
            path = without_wrapper(path, ACTIVATION_KEY)
        if path is not None:
            here = f"{span}.{path}" if path else span
            # the module the graph was traced on, from the node's: ``Net.layers.0``
            root = None if fqn is None else fqn if not path else (
                fqn[:-len(path) - 1] if fqn.endswith("." + path) else None)
            if root is not None:
                if root != span:
                    if span == semconv.GLOBAL_FQN or root.startswith(span + ".") or (
                            not tracker.knows_name(here)):
                        return None
                    fqn = here
            elif span != semconv.GLOBAL_FQN and (
                    fqn is None or (fqn != span and not fqn.startswith(span + "."))):
                if tracker.knows_name(here):
                    fqn = here
        return fqn

    # ------------------------------------------------------------ hang records
    def dump(self, timeout_s: float | None = None) -> bool:
        """Write a ``commspan.hang`` record now: what this rank is doing.

        The record (a ``commspan.hang`` span, see docs/debugging.md) holds the
        open module spans, outermost first, and the rank's recent collectives
        per process group with their state (``issued`` or ``completed``). It
        goes through the exporters at once, after the spans that closed before
        it and are ready, and the exporters are flushed; spans still waiting
        for a collective's completion wait on (a timeout or signal record
        writes them at once, in case the job is stopped), so a dump on a
        healthy run keeps every duration. Safe to call from any thread, e.g. a
        watchdog of your own.

        Args:
            timeout_s: the most to wait for the exporters, in seconds; default
                ``flush_timeout_s``.

        Returns:
            ``True`` if every exporter had written everything in time (on a rank
            that ``ranks=`` leaves out, which writes no record: ``True``).

        Raises:
            RuntimeError: the mode is not entered.

        Example:
            >>> from commspan import CommSpanMode
            >>> mode = CommSpanMode()
            >>> with mode:
            ...     mode.dump()
            True
            >>> mode.stats()["hang_records"]
            1
        """
        if not self._active:
            raise RuntimeError(
                "mode.dump() was called outside the mode; call it inside `with mode:`"
            )
        return self._write_hang(semconv.HANG_REASON_DUMP, timeout_s)

    def _write_hang(self, reason: str, timeout_s: float | None = None) -> bool:
        rec = self._recorder
        if rec is None:
            return False
        if not self._rank_traced:
            return True  # a rank the rank sample leaves out records nothing, hangs neither
        timeout = self._config.flush_timeout_s if timeout_s is None else seconds(
            "timeout_s", timeout_s, zero=True)
        collectives = self._log.snapshot()
        untraced = self._untraced_step
        rec.emit_hang(rec.hang_span(reason, collectives, self._config.hang_timeout_s,
                                    untraced_step=untraced),
                      emit_waiting=reason != semconv.HANG_REASON_DUMP)
        self._stats["hang_records"] += 1
        if reason != semconv.HANG_REASON_DUMP:
            # the latest one not completed: where this rank waits now
            waiting = self._log.not_completed()
            stuck = waiting[-1] if waiting else None
            _log.warning(
                "commspan: rank %d wrote a hang record (%s)%s", self._ranks.rank, reason,
                f" in step {untraced}, which sample= does not trace: where the rank waits "
                "is not known (trace every step to see it)" if untraced is not None else
                _describe_stuck(stuck) if stuck is not None else "",
            )
        return self._flush_queues(timeout, wait_if_unhealthy=True)

    def _open_fqns(self) -> list[str]:
        rec = self._recorder
        return [f.fqn for f in rec.stack] if rec is not None else []

    def _emit(self, span: ReadableSpan) -> None:
        self._stats["spans"] += 1
        interrupted: BaseException | None = None
        for on_end in self._processors:
            try:
                on_end(span)
            except Exception:
                self._processor_errors.record()
            except BaseException as exc:  # an interrupt (Ctrl-C) in one of them: the
                # others still get the span (it is counted), then the interrupt goes on
                if interrupted is None:
                    interrupted = exc
        if interrupted is not None:
            raise interrupted

    def _build_processors(self) -> list[Callable[[ReadableSpan], None]]:
        procs: list[Callable[[ReadableSpan], None]] = []
        if self.aggregator is not None:
            procs.append(self.aggregator.on_end)
        procs.extend(q.on_end for q in self._queues)
        if self._config.tracer_provider is not None:
            active: SpanProcessor | None = getattr(
                self._config.tracer_provider, "_active_span_processor", None
            )
            if active is not None:
                on_end = active.on_end

                def user_on_end(span: ReadableSpan) -> None:
                    add_timing(span)  # the user's processors see a finished span
                    on_end(span)

                procs.append(user_on_end)
        return procs

    # ------------------------------------------------------------ public extras
    @property
    def active(self) -> bool:
        """Whether the mode is entered."""
        return self._active

    @property
    def rank(self) -> int:
        """The rank the mode recorded on entry."""
        return self._ranks.rank

    def open_spans(self) -> tuple[OpenSpan, ...]:
        """The spans open right now, outermost (the rank span) first; empty
        outside ``with mode:`` or outside a trace.

        Each is a read-only :class:`~commspan.spans.OpenSpan` copy: module
        name, attributes so far, the collectives of its subtree so far, and
        whether the capture layer has finished with it.

        Example:
            >>> import torch
            >>> from commspan import CommSpanMode
            >>> mode = CommSpanMode()
            >>> class Peek(torch.nn.Module):
            ...     def forward(self, x):
            ...         self.seen = [s.fqn for s in mode.open_spans()]
            ...         return x
            >>> peek = Peek()
            >>> with mode:
            ...     _ = peek(torch.ones(1))
            >>> peek.seen
            ['Global', 'Peek']
        """
        rec = self._recorder
        if rec is None or not self._active:
            return ()
        return rec.open_spans()

    def watch_pipeline(self, schedule: Any) -> None:
        """Attribute a pipeline's point-to-point ops to its stages, per microbatch.

        For each stage of ``schedule`` (``torch.distributed.pipelining``), while
        the mode is entered: its sends and receives are owned by the stage
        module, phase forward for activations and backward for gradients, and
        name the microbatch, the direction and the peer stage
        (``commspan.pp.*``); the module spans of a microbatch carry its index.
        The ops the stages exchange before their first microbatch (tensor
        shapes) are phase ``setup``. commspan sets wrappers on the stage
        objects' own methods (``get_*_ops``, ``*_one_chunk``) when the mode is
        entered and removes them when it is left; nothing else changes. See
        docs/parallelisms.md.

        Args:
            schedule: the schedule you call ``step()`` on (``ScheduleGPipe``,
                ``Schedule1F1B``, ...), or one of its ``PipelineStage`` objects.

        Raises:
            TypeError: ``schedule`` is neither a pipeline schedule nor a stage.

        Example:
            ``mode.watch_pipeline(schedule)`` once, then ``with mode.step(i):
            schedule.step(x, target=y)`` on every rank.
        """
        from commspan.capture.pipeline import stages_of

        self._parallel.pipeline.watch(*stages_of(schedule))

    def module_name(self, module: torch.nn.Module) -> str | None:
        """The name spans give ``module`` (e.g. ``"Net.blocks.0"``), once the mode
        has seen it or a module containing it run; ``None`` before.

        Example:
            >>> import torch
            >>> from commspan import CommSpanMode
            >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
            >>> mode = CommSpanMode()
            >>> with mode:
            ...     _ = net(torch.ones(1, 2))
            >>> mode.module_name(net[0])
            'Sequential.0'
        """
        return self._tracker.fqn(module) if self._tracker is not None else None

    def stats(self) -> dict[str, Any]:
        """Counters: spans, collectives, steps traced/skipped, errors, and what export did.

        ``gc_pauses`` counts the garbage-collector pauses written as ``commspan.gc``
        events; ``gc_pauses_unrecorded`` those noted but not written (more than
        1,000 in one trace, or noted after their trace's rank span was built).

        ``exporters`` holds one dict per exporter (see
        :class:`commspan.exporters.queue.ExportStats`): ``handed`` (spans given to it),
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
        if self._gc is not None:  # pauses the watch could not hold or place, so far
            out["gc_pauses_unrecorded"] += self._gc.errors + self._gc.dropped
        out["collectives_untimed"] = self._untimed + (
            self._recorder.forced if self._recorder is not None else 0
        ) + (self._dispatch.completions.failed if self._dispatch is not None else 0)
        out["processor_errors"] = self._processor_errors.count
        out["internal_errors"] = (self._tracker.internal_errors if self._tracker else 0) + (
            self._dispatch.errors if self._dispatch else 0
        ) + self._watch_errors.count + self._identity_errors.count
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
        timeout = self._config.flush_timeout_s if timeout_s is None else seconds(
            "timeout_s", timeout_s, zero=True)
        return self._flush_queues(timeout, wait_if_unhealthy=True)

    def _flush_on_exit(self) -> None:
        """Leaving the mode waits (up to ``flush_timeout_s``) for healthy exporters
        only: one whose last export failed or whose last flush timed out is asked
        to flush in the background, so a dead backend does not add
        ``flush_timeout_s`` to every ``with mode:`` block."""
        self._flush_queues(self._config.flush_timeout_s, wait_if_unhealthy=False)

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

        The mode cannot be entered again afterwards (its exporters are closed).
        """
        timeout = self._config.flush_timeout_s if timeout_s is None else seconds(
            "timeout_s", timeout_s, zero=True)
        if self._queues:  # its exporters are closed: a later entry would drop everything
            self._shut_down = True
        deadline = time.monotonic() + timeout
        for q in self._queues:  # start every exporter now: a hung one delays no other
            q.flush(0.0)
        for q in self._queues:
            q.shutdown(max(0.0, deadline - time.monotonic()))


def _describe_stuck(timing: CollectiveTiming) -> str:
    """``: all_reduce on group 0 (seq 11) in `Net.blocks.2` forward, issued 2.0 s ago``."""
    a = timing.attrs
    waited = (time.perf_counter_ns() - timing.issued) / 1e9
    if semconv.P2P_SEQ in a:  # ``: send to rank 2 on group 0 (#3) ...``, as check says it
        peer = a.get(semconv.COLL_PEER, "?")
        what = f"{a.get(semconv.COLL_OP)} {'to' if a.get(semconv.COLL_OP) == 'send' else 'from'}" \
               f" rank {peer}"
        number = f"#{a.get(semconv.P2P_SEQ)}"
    else:
        what, number = str(a.get(semconv.COLL_OP)), f"seq {a.get(semconv.COLL_SEQ, '?')}"
    return (
        f": {what} on group {a.get(semconv.PG_NAME, '?')} "
        f"({number}) in `{a.get(semconv.MODULE_FQN)}` "
        f"{a.get(semconv.PHASE)} has not completed after {waited:.1f} s"
    )

