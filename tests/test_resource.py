"""The resource of commspan's spans: the user's attributes win over detected ones,
``None`` leaves an attribute out, and commspan's own ids stay correct."""

from __future__ import annotations

import logging
import os
import socket
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
