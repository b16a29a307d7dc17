"""The pipeline watch on its own: wrappers set on a stage object and removed,
ops tagged by their tensor object, the microbatch of spans, and nothing kept
across steps (sampled-out ones included). A stand-in stage replaces
``PipelineStage``: only its method names matter to the watch."""

from __future__ import annotations

from typing import Any

import torch

from commspan import semconv
from commspan.capture.pipeline import PipelineWatch


class Op:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class FakeStage:
    """The methods a schedule calls on a PipelineStage, and a submodule."""

    def __init__(self, index: int = 1) -> None:
        self.stage_index = index
        self.submod = torch.nn.Linear(2, 2)
        self.ran: list[tuple[str, int]] = []

    def get_fwd_recv_ops(self, chunk: int) -> list[Op]:
        return [Op(torch.zeros(2))]

    def get_fwd_send_ops(self, chunk: int) -> list[Op]:
        return [Op(torch.zeros(2))]

    def get_bwd_recv_ops(self, chunk: int) -> list[Op]:
        return [Op(torch.zeros(2))]

    def get_bwd_send_ops(self, chunk: int) -> list[Op]:
        return [Op(torch.zeros(2))]

    def forward_one_chunk(self, chunk: int, *args: Any) -> Any:
        self.ran.append(("forward", chunk))
        return self.submod(torch.ones(1, 2))

    def backward_one_chunk(self, chunk: int, **kwargs: Any) -> None:
        self.ran.append(("backward", chunk))


def test_wrappers_are_instance_attributes_removed_on_uninstall() -> None:
    """Installing sets the stage's own attributes only; uninstalling deletes them,
    so the class's methods show through again."""
    watch, stage, other = PipelineWatch(), FakeStage(), FakeStage()
    watch.namer = lambda m, root: "Stage"
    watch.watch(stage)
    watch.install()
    assert "get_fwd_recv_ops" in vars(stage) and "forward_one_chunk" in vars(stage)
    assert not any(k.endswith(("_ops", "_one_chunk")) for k in vars(other))
    watch.uninstall()
    assert not any(k.endswith(("_ops", "_one_chunk")) for k in vars(stage))


def test_ops_are_tagged_by_their_tensor_once() -> None:
    """An op announced for a microbatch is found by its tensor object (not an equal
    tensor), once; the peer is the stage before for activations in."""
    watch, stage = PipelineWatch(), FakeStage(index=1)
    watch.namer = lambda m, root: "Stage"
    watch.watch(stage)
    watch.install()
    (op,) = stage.get_fwd_recv_ops(3)
    assert watch.tag(torch.zeros(2)) is None  # equal values, another object
    tag = watch.tag(op.tensor)
    assert tag == ("Stage", 1, 3, semconv.OWNER_KIND_ACTIVATION_RECV, 0)
    assert watch.tag(op.tensor) is None  # forgotten once its op was seen
    (grad,) = stage.get_bwd_recv_ops(3)
    assert watch.tag(grad.tensor).peer_stage == 2  # gradients come from the next stage


def test_microbatch_attributes_while_a_chunk_runs() -> None:
    """While forward_one_chunk(m) runs, frames get the stage and microbatch; after it,
    nothing; an op issued before the first chunk of a step is the stage's setup."""
    watch, stage = PipelineWatch(), FakeStage(index=1)
    seen: list[Any] = []
    watch.namer = lambda m, root: "Stage"
    watch.on_microbatch = seen.append
    watch.watch(stage)
    watch.install()
    assert watch.setup_stage() == "Stage"
    stage.forward_one_chunk(2)
    assert seen == [{semconv.PP_STAGE: 1, semconv.PP_MICROBATCH: 2}, None]
    assert watch.setup_stage() is None  # the step has started its microbatches
    watch.reset_step()
    assert watch.setup_stage() == "Stage"


def test_mode_spans_carry_the_microbatch_and_nothing_outlives_a_step() -> None:
    """Under a mode, module spans of a chunk carry the stage and microbatch; ops
    announced but never issued are forgotten at the end of every step, traced or
    sampled out; the wrappers are gone when the mode is left."""
    from commspan.testing import capture

    stage = FakeStage(index=0)
    with capture(sample={0}) as cap:  # step 1 is sampled out
        cap.mode._parallel.pipeline.watch(stage)  # what watch_pipeline() does for a stage
        for i in range(2):
            with cap.mode.step(i):
                stage.forward_one_chunk(i)
                stage.get_fwd_send_ops(i)  # announced, never sent
            assert cap.mode._parallel.pipeline._tags == {}
    assert not any(k.endswith(("_ops", "_one_chunk")) for k in vars(stage))
    (span,) = [s for s in cap.spans if s.name == "Linear forward"]
    assert (span.attributes[semconv.PP_STAGE], span.attributes[semconv.PP_MICROBATCH]) == (0, 0)
