"""The CUDA path of collective timing: CUDA events around the collective, read once the
second has completed. Skipped without a GPU (the CPU and gloo paths are tested in
tests/test_capture_timing.py and tests/test_timing_gloo.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commspan import semconv
from commspan.testing import capture
from commspan.testing.spans import collective_events

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("fake_pg"),
]


def test_elapsed_time_of_cuda_events_is_read_once_the_end_has_completed() -> None:
    """_elapsed_ns answers None while the end event is pending, the device time after."""
    from commspan.capture.completion import _elapsed_ns

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)  # keeps the stream busy for a while
    end.record()
    assert _elapsed_ns(start, end) is None
    torch.cuda.synchronize()
    elapsed = _elapsed_ns(start, end)
    assert elapsed is not None and elapsed > 0


def test_functional_collective_on_cuda_tensors_gets_a_device_duration() -> None:
    """A functional all_reduce of a CUDA tensor, waited: its event carries a duration
    from the CUDA events (the span waits for the end event, or the step end)."""

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD)) + 1

    with capture() as cap:
        with cap.mode.step(0):
            Net()(torch.ones(1024, device="cuda"))
            torch.cuda.synchronize()
    (event,) = [e for s in cap.spans for e in collective_events(s)]
    assert event.attributes[semconv.COLL_DURATION_NS] >= 0
