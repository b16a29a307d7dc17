"""session/config.py: a bad constructor argument is an error naming the parameter."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from commspan import CommSpanMode


@pytest.mark.parametrize(
    ("kwargs", "error", "parameter"),
    [
        ({"exporters": object()}, TypeError, "exporters"),
        ({"exporters": [object()]}, TypeError, "exporters"),
        ({"tracer_provider": object()}, TypeError, "tracer_provider"),
        ({"sample": 0}, ValueError, "sample"),
        ({"sample": True}, TypeError, "sample"),
        ({"flush_timeout_s": 0}, ValueError, "flush_timeout_s"),
        ({"export_queue_size": 0}, ValueError, "export_queue_size"),
        ({"run_id": ""}, TypeError, "run_id"),
        ({"aggregator": "yes"}, TypeError, "aggregator"),
        ({"flush_timeout_s": float("nan")}, ValueError, "flush_timeout_s"),
        ({"flush_timeout_s": True}, ValueError, "flush_timeout_s"),
        ({"flush_timeout_s": "5"}, ValueError, "flush_timeout_s"),
        ({"flush_timeout_s": None}, ValueError, "flush_timeout_s"),
        ({"sample": "12"}, TypeError, "sample"),
        ({"sample": [1.5]}, ValueError, "sample"),
        ({"sample": ["x"]}, ValueError, "sample"),
        ({"sample": [-1]}, ValueError, "sample"),
        ({"record_params": "no"}, TypeError, "record_params"),
        ({"record_params": None}, TypeError, "record_params"),
        ({"module_observer": 5}, TypeError, "module_observer"),
        ({"resource_attributes": {"commspan.rank": "x"}}, ValueError, "resource_attributes"),
        ({"resource_attributes": {"commspan.world_size": -2}}, ValueError,
         "resource_attributes"),
        ({"resource_attributes": {"commspan.rank": 5, "commspan.world_size": 2}}, ValueError,
         "resource_attributes"),
    ],
    ids=[
        "exporters-object",
        "exporters-list-of-object",
        "tracer_provider",
        "sample-0",
        "sample-bool",
        "flush_timeout_s",
        "export_queue_size",
        "run_id-empty",
        "aggregator-str",
        "flush_timeout_s-nan",
        "flush_timeout_s-bool",
        "flush_timeout_s-str",
        "flush_timeout_s-None",
        "sample-str",
        "sample-float-step",
        "sample-str-step",
        "sample-negative-step",
        "record_params-str",
        "record_params-None",
        "module_observer-int",
        "resource-rank-str",
        "resource-world-negative",
        "resource-rank-outside-world",
    ],
)
def test_bad_constructor_arguments(
    kwargs: dict[str, Any], error: type[Exception], parameter: str
) -> None:
    """A bad constructor argument raises a clear error naming the parameter."""
    with pytest.raises(error, match=rf"\b{parameter}(\[[^]]*\])?="):
        CommSpanMode(**kwargs)


def test_exporters_errors_say_how_to_pass_them(tmp_path: Any) -> None:
    """The commonest slips, one exporter not in a list and a path for an exporter, are
    told what to write instead (the message named the type only)."""
    from commspan.exporters import JsonlSpanExporter

    one = JsonlSpanExporter(tmp_path)
    for value, fix in ((one, "put it in a list: exporters=[exporter]"),
                       (["commspan-out/"], "a path is not an exporter: pass "
                        "exporters=[JsonlSpanExporter(path)] (from commspan.exporters)"),
                       ([object()], 'e.g. exporters=[JsonlSpanExporter("commspan-out/")]')):
        with pytest.raises(TypeError, match=r"^exporters=.* must be a list of "
                           r"opentelemetry.sdk.trace.export.SpanExporter instances; ") as info:
            CommSpanMode(exporters=value)
        assert str(info.value).endswith(fix)
    one.shutdown()


def test_export_queue_size_checked_with_exporters() -> None:
    """export_queue_size=0 with an exporter raises ValueError naming export_queue_size."""
    with pytest.raises(ValueError, match=r"\bexport_queue_size="):
        CommSpanMode(exporters=[InMemorySpanExporter()], export_queue_size=0)


class _Slow(InMemorySpanExporter):
    """An exporter that takes a while per batch."""

    def export(self, spans: Any) -> Any:
        import time

        time.sleep(0.05)
        return super().export(spans)


def test_infinite_timeouts_mean_no_limit() -> None:
    """flush_timeout_s=inf, and inf given to flush/dump/shutdown, wait until done
    (they used to raise OverflowError out of leaving the mode)."""
    import torch

    exporter = _Slow()
    mode = CommSpanMode(exporters=[exporter], flush_timeout_s=float("inf"))
    with mode:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert len(exporter.get_finished_spans()) == mode.stats()["spans_exported"] > 0
    assert mode.flush(float("inf")) is True
    mode.shutdown(float("inf"))
    assert mode.stats()["spans_dropped"] == mode.stats()["spans_failed"] == 0


@pytest.mark.parametrize("value", [float("nan"), -1, "1", True])
def test_bad_timeouts_of_the_calls_name_timeout_s(value: Any) -> None:
    mode = CommSpanMode(exporters=[InMemorySpanExporter()])
    with mode:
        for call in (mode.flush, mode.dump):
            with pytest.raises(ValueError, match=r"\btimeout_s="):
                call(value)
    with pytest.raises(ValueError, match=r"\btimeout_s="):
        mode.shutdown(value)


@pytest.mark.parametrize("value", [-1, 0, "5", float("nan")])
def test_otlp_timeout_is_checked_when_the_exporter_is_made(value: Any) -> None:
    from commspan.exporters import otlp_exporter

    with pytest.raises(ValueError, match=r"\btimeout_s="):
        otlp_exporter(endpoint="http://127.0.0.1:4318/v1/traces", timeout_s=value)


def test_ranks_naming_no_rank_of_the_world_warn(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks past the world's last: nothing traces, and the log says why. (The world
    is the fake process group another test left initialized, or, run alone, rank 0 of
    one process, as the launcher's ``RANK`` and ``WORLD_SIZE`` say: a guessed world
    warns nothing.)"""
    import torch.distributed as dist

    if not dist.is_initialized():
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
    world = dist.get_world_size() if dist.is_initialized() else 1
    mode = CommSpanMode(ranks=[world, world + 3])
    with caplog.at_level("WARNING", logger="commspan"), mode:
        pass
    assert f"names no rank of this world of {world}" in caplog.text


def test_numpy_step_numbers_and_world_size_zero() -> None:
    import numpy as np

    CommSpanMode(sample=np.arange(0, 100, 10))  # numpy ints are step numbers
    CommSpanMode(resource_attributes={"commspan.rank": np.int64(3)})
    with pytest.raises(ValueError, match=r"resource_attributes\['commspan.world_size'\]=0"):
        CommSpanMode(resource_attributes={"commspan.world_size": 0})


def test_numpy_numbers_are_numbers_everywhere() -> None:
    """numpy's ints and floats are taken where ints and seconds are (ranks from
    np.arange, every Nth step as np.int64, a timeout as np.float32): the mode traces
    the ranks and steps they name, and waits as long as they say."""
    import numpy as np
    import torch

    exporter = InMemorySpanExporter()
    mode = CommSpanMode(exporters=[exporter], ranks=np.arange(0, 8, 2), sample=np.int64(2),
                        flush_timeout_s=np.float32(1.0))
    with mode:
        for i in range(4):
            with mode.step(i):
                torch.nn.Linear(2, 2)(torch.ones(1, 2))
    mode.shutdown()
    assert mode.stats()["steps_traced"] == 2  # steps 0 and 2; this process is rank 0
    assert len(exporter.get_finished_spans()) == mode.stats()["spans"] > 0


@pytest.mark.parametrize(
    ("make", "parameter"),
    [
        (lambda: __import__("commspan.exporters", fromlist=["JsonlSpanExporter"])
         .JsonlSpanExporter("x.jsonl", fsync="no"), "fsync"),
        (lambda: __import__("commspan.exporters.queue", fromlist=["ExportQueue"])
         .ExportQueue(InMemorySpanExporter(), max_queue_size=True), "max_queue_size"),
        (lambda: CommSpanMode(ranks=[0, 1.5]), "ranks"),
        (lambda: CommSpanMode(ranks=[True]), "ranks"),
    ],
    ids=["fsync-str", "max_queue_size-bool", "ranks-float", "ranks-bool"],
)
def test_flags_and_sizes_of_the_wrong_type_are_refused(make: Any, parameter: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{parameter}"):
        make()


def test_a_one_element_tensor_of_steps_is_a_set_of_steps() -> None:
    """sample=torch.tensor([5]) names step 5, as np.array([5]) and [5] do; only a whole
    number (an int, numpy's) means every Nth step."""
    import numpy as np
    import torch

    for sample in (torch.tensor([5]), np.array([5]), [5]):
        mode = CommSpanMode(sample=sample)
        with mode:
            for i in range(11):
                with mode.step(i):
                    pass
        assert mode.stats()["steps_traced"] == 1, sample


def test_a_sample_callable_that_fails_names_sample_and_leaves_the_step() -> None:
    """A vectorised rule by mistake (an array for a step): the error names sample=, and
    the mode is not left inside a step (every later step used to say "steps do not
    nest"). A callable that cannot take a step number is refused when the mode is made."""
    import numpy as np

    from commspan import CommSpanMode

    mode = CommSpanMode(sample=lambda i: np.array([i % 2 == 0, True]), aggregator=False)
    with mode:
        for i in range(2):
            with pytest.raises(TypeError, match=r"sample=.* returned array\(.*for step "
                                                f"{i}, which is not True or False"):
                with mode.step(i):
                    pass
    with pytest.raises(TypeError, match=r"sample=.* cannot be called with a step number"):
        CommSpanMode(sample=lambda: True)


def test_an_exporter_listed_twice_is_refused() -> None:
    """The same exporter twice would write every span twice (and be shut down twice)."""
    from commspan import CommSpanMode
    from commspan.exporters import JsonlSpanExporter

    exporter = JsonlSpanExporter("/tmp/commspan-never-written")
    with pytest.raises(ValueError, match="is listed twice, so every span would be written "
                                         "twice; list each exporter once"):
        CommSpanMode(exporters=[exporter, exporter])
