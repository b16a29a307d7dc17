"""The resource of commspan's spans: the user's attributes win over detected ones,
``None`` leaves an attribute out, and commspan's own ids stay correct."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from commspan import CommSpanMode
from commspan.exporters import JsonlSpanExporter, read_spans


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No resource variables from the machine running the tests."""
    for name in ("OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME",
                 "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS"):
        monkeypatch.delenv(name, raising=False)


def _world() -> int:
    """The world size commspan sees (other tests may have set up a fake process group)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _resource(**mode_kwargs: Any) -> dict[str, Any]:
    """The resource attributes of the spans one traced module call produces."""
    mode = CommSpanMode(**mode_kwargs)
    with mode:
        torch.nn.ReLU()(torch.ones(1))
    assert mode.resource is not None
    return dict(mode.resource.attributes)


def test_detected_defaults() -> None:
    """Without configuration: service commspan, instance = rank, this host and process."""
    res = _resource(run_id="r1")
    assert res["service.name"] == "commspan"
    assert res["service.instance.id"] == "0"
    assert res["host.name"] == socket.gethostname()
    assert res["process.pid"] == os.getpid()
    ids = (res["commspan.rank"], res["commspan.world_size"], res["commspan.run_id"])
    assert ids == (0, _world(), "r1")


def test_environment_wins_over_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_RESOURCE_ATTRIBUTES' host.name/process.pid/service.* replace the detected ones."""
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "host.name=anon-host,process.pid=1,service.instance.id=trainer-a,deployment.environment=ci",
    )
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-train")
    res = _resource()
    assert res["host.name"] == "anon-host"
    assert res["process.pid"] == "1"  # the variable's values are strings
    assert res["service.instance.id"] == "trainer-a"
    assert res["service.name"] == "llm-train"
    assert res["deployment.environment"] == "ci"


def test_provider_resource_wins_over_detected_and_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tracer_provider's own attributes win over the environment and detection."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "host.name=from-env")
    provider = TracerProvider(resource=Resource({"host.name": "from-provider",
                                                 "service.name": "svc"}))
    res = _resource(tracer_provider=provider)
    assert res["host.name"] == "from-provider"
    assert res["service.name"] == "svc"
    assert res["service.instance.id"] == "0"


def test_default_provider_keeps_commspan_names() -> None:
    """A TracerProvider() nobody configured does not replace service.name/instance with the
    SDK's placeholders (unknown_service..., a random instance id)."""
    res = _resource(tracer_provider=TracerProvider())
    assert res["service.name"] == "commspan"
    assert res["service.instance.id"] == "0"


def test_argument_wins_over_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """resource_attributes= beats the environment and the provider."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "host.name=from-env")
    provider = TracerProvider(resource=Resource({"host.name": "from-provider"}))
    res = _resource(tracer_provider=provider, resource_attributes={"host.name": "from-arg"})
    assert res["host.name"] == "from-arg"


def test_none_leaves_host_and_process_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """resource_attributes={key: None} omits the key, also from what reaches the files."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "process.pid=1")
    exporter = JsonlSpanExporter(tmp_path / "spans.jsonl")
    res = _resource(exporters=[exporter],
                    resource_attributes={"host.name": None, "process.pid": None})
    assert "host.name" not in res and "process.pid" not in res
    assert res["commspan.rank"] == 0
    exporter.shutdown()
    spans = read_spans(tmp_path / "spans.jsonl")
    assert spans
    for span in spans:
        assert "host.name" not in span.resource and "process.pid" not in span.resource
    assert socket.gethostname() not in (tmp_path / "spans.jsonl").read_text()


def test_commspan_ids_ignore_environment_and_provider(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """commspan.rank/run_id from the environment or a provider are ignored, with one warning."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "commspan.rank=7,commspan.run_id=x")
    provider = TracerProvider(resource=Resource({"commspan.world_size": 64}))
    with caplog.at_level(logging.WARNING, logger="commspan.session"):
        res = _resource(run_id="real", tracer_provider=provider)
    assert (res["commspan.rank"], res["commspan.world_size"], res["commspan.run_id"]) == (
        0, _world(), "real")
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("commspan.session")]
    assert len(warnings) == 1
    assert "commspan.rank, commspan.run_id, commspan.world_size" in warnings[0]


def test_local_rank_comes_from_LOCAL_RANK_or_is_left_out(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """commspan.local_rank is LOCAL_RANK (torchrun's); without it, 0 for a lone process and
    absent in a world of several ranks (mp.spawn, srun), not a 0 on every rank."""
    from commspan.testing import fake_process_group

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    if _world() == 1:
        assert _resource()["commspan.local_rank"] == 0
    with fake_process_group(world_size=4, rank=0):  # (the session-wide one, if any)
        assert "commspan.local_rank" not in _resource()
        monkeypatch.setenv("LOCAL_RANK", "1")
        assert _resource()["commspan.local_rank"] == 1
        monkeypatch.delenv("LOCAL_RANK")
        # resource_attributes= may set it, or leave it out
        assert _resource(resource_attributes={"commspan.local_rank": 3})[
            "commspan.local_rank"] == 3
        monkeypatch.setenv("LOCAL_RANK", "1")
        assert "commspan.local_rank" not in _resource(
            resource_attributes={"commspan.local_rank": None})


def test_rank_variables_holding_no_int_are_warned_about_and_count_as_unset(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """LOCAL_RANK=gpu0 (read even with a process group) and, without one, RANK and
    WORLD_SIZE holding no int: `with mode:` works (it raised a bare ValueError), the
    values count as unset, and one warning names each variable and its value."""
    from commspan.capture.ranks import Ranks, process_ranks
    from commspan.testing import fake_process_group

    monkeypatch.setenv("LOCAL_RANK", "gpu0")
    with caplog.at_level(logging.WARNING, logger="commspan"):
        # (rank 0 of 4: the session's fake group, if an earlier test set it up)
        with fake_process_group(world_size=4, rank=0):
            res = _resource()
            assert "commspan.local_rank" not in res and res["commspan.world_size"] == 4
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
        monkeypatch.setenv("RANK", "%r")
        monkeypatch.setenv("WORLD_SIZE", "two")
        assert process_ranks() == Ranks(0, 0, 1) == process_ranks()
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("commspan")]
    for name, value in (("LOCAL_RANK", "gpu0"), ("RANK", "%r"), ("WORLD_SIZE", "two")):
        about = [m for m in logged if m.startswith(f"commspan: {name}={value!r} ")]
        assert len(about) == 1, logged
        assert "is not a whole number" in about[0] and f"set {name} to" in about[0]


def test_argument_may_override_the_rank_to_simulate_ranks() -> None:
    """resource_attributes= may set commspan.rank (one process writing several ranks' files)."""
    assert _resource(resource_attributes={"commspan.rank": 3})["commspan.rank"] == 3


def test_argument_rejects_run_id_and_omitting_commspan_ids() -> None:
    """commspan.run_id belongs to run_id=; None for a commspan id is refused; so is a non-dict."""
    with pytest.raises(ValueError, match=r"resource_attributes\['commspan.run_id'\]='x' is not "
                       r"accepted; pass run_id='x'"):
        CommSpanMode(resource_attributes={"commspan.run_id": "x"})
    with pytest.raises(ValueError, match=r"resource_attributes\['commspan.rank'\]=None"):
        CommSpanMode(resource_attributes={"commspan.rank": None})
    with pytest.raises(TypeError, match="resource_attributes=.*pass a dict"):
        CommSpanMode(resource_attributes=[("host.name", "h")])  # type: ignore[arg-type]


_ENTERED_BEFORE_THE_GROUP = """
import sys
import torch
import torch.distributed as dist
from commspan import CommSpanMode
from commspan.exporters import JsonlSpanExporter
from commspan.testing import fake_process_group

out = sys.argv[1]
model = torch.nn.Linear(4, 4)
mode = CommSpanMode(exporters=[JsonlSpanExporter(out)], aggregator=False)
with mode:
    model(torch.ones(4))  # before the process group: rank 0 of 1, a guess
    assert mode.flush()
    with fake_process_group(world_size=4, rank=2):
        for i in range(2):
            with mode.step(i):
                t = model(torch.ones(4)).detach()
                dist.all_reduce(t)
mode.shutdown()
"""


def _without_ranks(script: str, out: Path) -> subprocess.CompletedProcess[str]:
    """``script`` run with ``out`` in a process of no ``RANK``, ``WORLD_SIZE`` or run id
    (``mp.spawn``'s); it must exit 0."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "COMMSPAN_RUN_ID",
                        "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_mode_entered_before_the_process_group_learns_its_rank_at_the_next_step(
    tmp_path: Path,
) -> None:
    """Entered with no process group and no ``RANK``, the mode guesses rank 0 of 1; once
    the group is up, its next step's spans say rank 2 of 4 and go to rank 2's file (they
    went on as rank 0 of 1, into rank 0's file, which every rank of an ``mp.spawn`` job
    then shared); the spans recorded before are said to be guessed, once."""
    proc = _without_ranks(_ENTERED_BEFORE_THE_GROUP, tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "commspan-rank0.jsonl", "commspan-rank2.jsonl"]
    before = list(read_spans(tmp_path / "commspan-rank0.jsonl"))
    after = list(read_spans(tmp_path / "commspan-rank2.jsonl"))
    assert [s.name for s in before].count("Linear forward") == 1  # the guessed call
    assert [s.name for s in after].count("Linear forward") == 2  # one per step
    assert {(s.resource["commspan.rank"], s.resource["commspan.world_size"])
            for s in before} == {(0, 1)}
    assert {(s.resource["commspan.rank"], s.resource["commspan.world_size"])
            for s in after} == {(2, 4)}
    assert sum(1 for s in after for _name, attrs in s.events
               if "commspan.collective.op" in attrs) == 2
    assert proc.stderr.count("entered before torch.distributed was initialised") == 1


_SAMPLED_BEFORE_THE_GROUP = """
import signal, sys
import torch
import torch.distributed as dist
from commspan import CommSpanMode
from commspan.exporters import JsonlSpanExporter
from commspan.testing import fake_process_group

model = torch.nn.Linear(4, 4)
mode = CommSpanMode(exporters=[JsonlSpanExporter(sys.argv[1])], aggregator=False, ranks=[2],
                    dump_signal=signal.SIGUSR1)
with mode:
    model(torch.ones(4))  # a guess, rank 0: not among the ranks traced
    print("handler before:", signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL)
    with fake_process_group(world_size=4, rank=2):
        with mode.step(0):
            model(torch.ones(4))
            print("handler after:", signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL)
mode.shutdown()
"""


def test_a_rank_sampled_in_once_it_learns_its_rank_gets_its_watches(tmp_path: Path) -> None:
    """``ranks=[2]`` and the mode entered before the process group: while it guesses
    rank 0 it traces nothing (and says nothing about the sample naming no rank of a
    world of one); once it knows it is rank 2 it traces, with the hang watchdog (here
    its dump signal) it would have had entered after the group (it had none: a hang
    on that rank left no record)."""
    proc = _without_ranks(_SAMPLED_BEFORE_THE_GROUP, tmp_path)
    assert proc.stdout.split("\n")[:2] == ["handler before: False", "handler after: True"]
    assert "names no rank" not in proc.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["commspan-rank2.jsonl"]
    spans = list(read_spans(tmp_path / "commspan-rank2.jsonl"))
    assert [s.name for s in spans].count("Linear forward") == 1  # the step's call only
