"""The ownership rules on their own, and how an owned collective is counted.

The FSDP2 and DDP rules read an ``Issued`` collective and the facts the capture
layer gathered; here the facts are plain stand-ins, so each rule's decisions
are checked without a process group. The counting tests drive a
``SpanRecorder`` directly and read its spans with the ``Aggregator``.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan

from commspan import Aggregator, semconv
from commspan.ownership import DdpBucket, FsdpUnit, Issued, PipelineTag, counted_names, resolve
from commspan.ownership.ddp import DDP_FORWARD_LABEL, DdpModules
from commspan.ownership.fsdp import FsdpUnits, parse_labels
from commspan.ownership.pipeline import PipelineStages
from commspan.semconv import Phase
from commspan.spans.recorder import SpanRecorder
from commspan.spans.traces import TraceOpener


@dataclass
class Facts:
    """A stand-in for the capture layer's ParallelModules."""

    units: dict[str, list[FsdpUnit]] = field(default_factory=dict)
    on_stack: FsdpUnit | None = None
    bucket: DdpBucket | None = None
    # numel -> the bucket the reducer launches next when it has that size
    launching: dict[int, DdpBucket] = field(default_factory=dict)
    asked_numel: list[int | None] = field(default_factory=list)
    ddps: set[str] = field(default_factory=set)
    constructing: str | None = None
    asked_stack: int = 0
    tags: dict[int, PipelineTag] = field(default_factory=dict)
    setup_stage: str | None = None

    @property
    def has_fsdp(self) -> bool:
        return bool(self.units)

    @property
    def has_ddp(self) -> bool:
        return bool(self.ddps)

    def fsdp_units(self, relative: str) -> Sequence[FsdpUnit]:
        return self.units.get(relative, [])

    def fsdp_unit_on_stack(self) -> FsdpUnit | None:
        self.asked_stack += 1
        return self.on_stack

    def ddp_bucket_now(self, numel: int | None = None) -> DdpBucket | None:
        self.asked_numel.append(numel)
        if numel is not None and self.bucket is not None:
            return self.launching.get(numel, self.bucket)
        return self.bucket

    def ddp_fqns(self) -> Container[str]:
        return self.ddps

    def ddp_constructing(self) -> str | None:
        return self.constructing

    @property
    def has_pipeline(self) -> bool:
        return bool(self.tags) or self.setup_stage is not None

    def pipeline_tag(self, tensor: Any) -> PipelineTag | None:
        return self.tags.pop(id(tensor), None)

    def pipeline_setup(self) -> str | None:
        return self.setup_stage


def _issued(
    op: str,
    labels: tuple[str, ...] = (),
    *,
    fqn: str = "Net",
    phase: Phase | None = Phase.FORWARD,
    in_autograd: bool = False,
    attrs: dict[str, Any] | None = None,
    open_fqns: tuple[str, ...] = ("Global", "Net"),
    tensor: Any = None,
) -> Issued:
    base = {semconv.TENSOR_BYTES: 40, semconv.PG_SIZE: 4}
    return Issued(op, {**base, **(attrs or {})}, fqn, phase, in_autograd, labels,
                  lambda: open_fqns, tensor)


UNITS = {"": [FsdpUnit("FSDPNet", 4)], "blocks.0": [FsdpUnit("FSDPNet.blocks.0", 2)]}


# ------------------------------------------------------------------ FSDP labels
def test_parse_labels_reads_unit_kind_prefetch_and_hook() -> None:
    """The innermost unshard/reduce label names the unit; prefetch and hook labels
    around it say why; the root has no unit suffix; a [pg=N] suffix is ignored."""
    assert parse_labels(("FSDP::pre_forward", "FSDP::all_gather")) == (
        "", "unshard", None, "pre_forward")
    assert parse_labels(("FSDP::post_backward_reduce (blocks.0) [pg=2]",)) == (
        "blocks.0", "reduce_grad", None, "")
    assert parse_labels(("FSDP::forward_prefetch for blocks.1", "FSDP::all_gather (blocks.1)"))[
        2] == "forward"
    assert parse_labels(("my label", "FSDP::pre_backward (blocks.0)")) is None
    assert parse_labels(()) is None


@pytest.mark.parametrize(
    ("labels", "in_autograd", "phase", "prefetch"),
    [
        (("FSDP::pre_forward (blocks.0)", "FSDP::all_gather (blocks.0)"), False, "forward", False),
        (("FSDP::pre_backward", "FSDP::backward_prefetch for blocks.0",
          "FSDP::all_gather (blocks.0)"), True, "backward", True),
        (("FSDP::pre_backward (blocks.0)", "FSDP::all_gather (blocks.0)"), True, "backward",
         False),
        # a forward hook while autograd runs: a checkpointed re-run
        (("FSDP::pre_forward (blocks.0)", "FSDP::all_gather (blocks.0)"), True, "recompute",
         False),
        # FSDPModule.unshard() called by the user
        (("FSDP::all_gather (blocks.0)",), False, "forward", False),
        # set_modules_to_forward_prefetch: the unit before gathers blocks.0
        (("FSDP::pre_forward (stem)", "FSDP::forward_prefetch for blocks.0",
          "FSDP::all_gather (blocks.0)"), False, "forward", True),
        # ... and again when a checkpoint re-runs that unit in backward
        (("FSDP::pre_forward (stem)", "FSDP::forward_prefetch for blocks.0",
          "FSDP::all_gather (blocks.0)"), True, "recompute", True),
    ],
    ids=["pre-forward", "backward-prefetch", "pre-backward", "recompute", "explicit",
         "forward-prefetch", "forward-prefetch-in-recompute"],
)
def test_fsdp_unshard_phase(
    labels: tuple[str, ...], in_autograd: bool, phase: str, prefetch: bool
) -> None:
    """An unshard serves the pass it was gathered for; bytes are the gathered output."""
    owner = FsdpUnits().owner(
        _issued("all_gather_into_tensor", labels, in_autograd=in_autograd), Facts(UNITS)
    )
    assert owner is not None
    assert (owner.fqn, owner.phase.value, owner.source, owner.kind) == (
        "FSDPNet.blocks.0", phase, "fsdp", "unshard")
    assert owner.attributes == {semconv.OWNER_PARAMS: 2, semconv.OWNER_BYTES: 160,
                                semconv.OWNER_PREFETCH: prefetch}


def test_fsdp_gradient_reduction_kinds() -> None:
    """Inside post_backward_reduce a reduce-scatter is reduce_grad and an all-reduce
    is HSDP's all_reduce; both serve backward and carry their input's bytes."""
    labels = ("FSDP::post_backward_reduce (blocks.0)",)
    rule, facts = FsdpUnits(), Facts(UNITS)
    rs = rule.owner(_issued("reduce_scatter_tensor", labels, in_autograd=True), facts)
    ar = rule.owner(_issued("all_reduce", labels, in_autograd=True), facts)
    assert rs is not None and ar is not None
    assert (rs.kind, rs.phase, rs.attributes) == (
        "reduce_grad", Phase.BACKWARD, {semconv.OWNER_PARAMS: 2, semconv.OWNER_BYTES: 40})
    assert (ar.kind, ar.phase) == ("all_reduce", Phase.BACKWARD)


@pytest.mark.parametrize("label", ["post_backward_reshard", "post_backward_accumulate"])
def test_fsdp_gradient_redistribution_is_the_units(label: str) -> None:
    """Where FSDP collects (or accumulates) a unit's gradients, DTensor may redistribute
    a tensor-parallel partial gradient: the unit's, in backward, with the gradient's
    bytes, the root's too (FSDP's final callback, no unit suffix)."""
    rule, facts = FsdpUnits(), Facts(UNITS)
    block = rule.owner(_issued("all_reduce", (f"FSDP::{label} (blocks.0)",),
                               in_autograd=True), facts)
    root = rule.owner(_issued("all_reduce", ("FSDP::root_post_backward_callback",
                                             f"FSDP::{label}"), in_autograd=True), facts)
    assert block is not None and root is not None
    assert (block.fqn, block.phase, block.source, block.kind, block.attributes) == (
        "FSDPNet.blocks.0", Phase.BACKWARD, "fsdp", "redistribute_grad",
        {semconv.OWNER_BYTES: 40})
    assert (root.fqn, root.kind) == ("FSDPNet", "redistribute_grad")


def test_fsdp_same_relative_name_asks_the_stack() -> None:
    """Two FSDP roots both named "": the parameter group on the stack decides; if it
    names neither, the rule gives up (the position owns it)."""
    a, b = FsdpUnit("Net.blocks.0", 2), FsdpUnit("Net.blocks.1", 2)
    facts = Facts({"": [a, b]}, on_stack=b)
    issued = _issued("all_gather_into_tensor", ("FSDP::all_gather",))
    owner = FsdpUnits().owner(issued, facts)
    assert owner is not None and owner.fqn == "Net.blocks.1"
    facts.on_stack = FsdpUnit("Other", 1)
    assert FsdpUnits().owner(issued, facts) is None
    facts.on_stack = None
    assert FsdpUnits().owner(issued, facts) is None


def test_fsdp_rule_ignores_other_collectives_cheaply() -> None:
    """No FSDP label, an unknown unit, or no FSDP at all: not the FSDP rule's; the
    stack is never walked for an unambiguous unit."""
    rule, facts = FsdpUnits(), Facts(UNITS)
    assert rule.owner(_issued("all_reduce", ("Optimizer.step#SGD.step",)), facts) is None
    assert rule.owner(_issued("all_gather_into_tensor", ("FSDP::all_gather (x)",)), facts) is None
    assert rule.owner(_issued("all_reduce", ("FSDP::all_gather (blocks.0)",)), Facts()) is None
    rule.owner(_issued("all_gather_into_tensor", ("FSDP::all_gather (blocks.0)",)), facts)
    assert facts.asked_stack == 0


# ------------------------------------------------------------------ DDP
BUCKET = DdpBucket(1, 1056, 2, ("DDP.module.l2.0",), "DDP.module.l2.0", "DDP", True,
                   ddp_params=12)


def test_ddp_bucket_all_reduce() -> None:
    """The bucket of the parameter whose hook runs owns the all-reduce, with its index,
    parameter count, modules and bytes."""
    attrs = {semconv.TENSOR_SHAPE: [1056], semconv.TENSOR_COUNT: 1,
             semconv.TENSOR_DTYPE: "float32", semconv.TENSOR_BYTES: 4224}
    owner = DdpModules().owner(
        _issued("all_reduce", in_autograd=True, attrs=attrs), Facts(bucket=BUCKET, ddps={"DDP"})
    )
    assert owner is not None
    assert (owner.fqn, owner.phase, owner.kind) == ("DDP.module.l2.0", Phase.BACKWARD, "bucket")
    assert owner.attributes == {
        semconv.DDP_BUCKET_INDEX: 1, semconv.OWNER_PARAMS: 2,
        semconv.DDP_BUCKET_MODULES: ["DDP.module.l2.0"], semconv.OWNER_BYTES: 4224,
    }


def test_ddp_unused_map_is_the_ddp_modules() -> None:
    """With find_unused_parameters, an int32 all-reduce of one element per parameter of
    the DDP module (12) from the same hook is the used-parameter map, owned by the DDP
    module, even when a bucket (BUCKET_2) has 12 elements too; a comm hook's own
    integer all-reduce of another size is its bucket's."""
    attrs = {semconv.TENSOR_SHAPE: [12], semconv.TENSOR_COUNT: 1, semconv.TENSOR_DTYPE: "int32"}
    facts = Facts(bucket=BUCKET, ddps={"DDP"}, launching={12: BUCKET_2})
    owner = DdpModules().owner(_issued("all_reduce", in_autograd=True, attrs=attrs), facts)
    assert owner is not None and (owner.fqn, owner.kind) == ("DDP", "unused_map")
    assert facts.asked_numel == [None]  # the map does not count as a launched bucket
    attrs = {**attrs, semconv.TENSOR_SHAPE: [1056]}  # e.g. a quantizing hook's payload
    owner = DdpModules().owner(_issued("all_reduce", in_autograd=True, attrs=attrs),
                               Facts(bucket=BUCKET, ddps={"DDP"}))
    assert owner is not None and (owner.fqn, owner.kind) == ("DDP.module.l2.0", "bucket")


BUCKET_2 = DdpBucket(2, 12, 1, ("DDP.module.l3",), "DDP.module.l3", "DDP", True)


def test_ddp_bucket_launched_from_another_parameters_hook() -> None:
    """A bucket all-reduce is charged to the bucket the capture layer says is being
    launched for the collective's size (buckets launched in cascade from one hook),
    not to the bucket of the parameter whose hook runs."""
    attrs = {semconv.TENSOR_SHAPE: [12], semconv.TENSOR_COUNT: 1,
             semconv.TENSOR_DTYPE: "float32", semconv.TENSOR_BYTES: 48}
    facts = Facts(bucket=BUCKET, ddps={"DDP"}, launching={12: BUCKET_2})
    owner = DdpModules().owner(_issued("all_reduce", in_autograd=True, attrs=attrs), facts)
    assert owner is not None and owner.attributes is not None
    assert (owner.fqn, owner.attributes[semconv.DDP_BUCKET_INDEX]) == ("DDP.module.l3", 2)
    assert facts.asked_numel == [12]


def test_ddp_forward_sync_and_construction() -> None:
    """A broadcast inside DDP's forward label belongs to the innermost open DDP module;
    one issued by DDP's constructor outside every module is its setup."""
    rule = DdpModules()
    forward = rule.owner(
        _issued("broadcast", ("DistributedDataParallel.forward",), fqn="DDP", phase=Phase.FORWARD,
                open_fqns=("Global", "DDP")),
        Facts(ddps={"DDP"}),
    )
    assert forward is not None
    assert (forward.fqn, forward.phase, forward.kind) == ("DDP", Phase.FORWARD, "forward_sync")
    assert DDP_FORWARD_LABEL == "DistributedDataParallel.forward"
    setup = rule.owner(_issued("broadcast", fqn="Global", phase=None),
                       Facts(constructing="DistributedDataParallel"))
    assert setup is not None
    assert (setup.fqn, setup.phase, setup.kind) == (
        "DistributedDataParallel", Phase.SETUP, "init_sync")
    # an all_reduce at Global is not DDP's construction; nor is anything in a module
    assert rule.owner(_issued("all_reduce", fqn="Global", phase=None),
                      Facts(constructing="DDP")) is None
    assert rule.owner(_issued("broadcast"), Facts(constructing="DDP")) is None


# ------------------------------------------------------------------ pipelining
def test_pipeline_ops_are_owned_by_their_stage_for_their_microbatch() -> None:
    """An announced send/recv is owned by the stage module: activations serve forward,
    gradients backward; the event names stage, microbatch and peer stage."""
    activations, gradients = object(), object()
    facts = Facts(tags={
        id(activations): PipelineTag("Sequential", 1, 2, "activation_recv", 0),
        id(gradients): PipelineTag("Sequential", 1, 2, "gradient_send", 0),
    })
    rule = PipelineStages()
    recv = rule.owner(_issued("recv", fqn="Global", phase=None, tensor=activations), facts)
    send = rule.owner(_issued("send", fqn="Global", phase=None, tensor=gradients), facts)
    assert recv is not None and send is not None
    assert (recv.fqn, recv.phase, recv.source, recv.kind) == (
        "Sequential", Phase.FORWARD, "pipeline", "activation_recv")
    assert recv.attributes == {semconv.PP_STAGE: 1, semconv.PP_MICROBATCH: 2,
                               semconv.PP_PEER_STAGE: 0}
    assert (send.phase, send.kind) == (Phase.BACKWARD, "gradient_send")


def test_pipeline_unannounced_p2p_is_setup_or_not_the_rules() -> None:
    """A send/recv nobody announced is the stage's setup when the capture layer says
    so (before the step's first microbatch), else not the pipeline rule's; other
    ops are never the pipeline rule's."""
    rule = PipelineStages()
    setup = rule.owner(_issued("send", tensor=object()), Facts(setup_stage="Sequential"))
    assert setup is not None
    assert (setup.fqn, setup.phase, setup.kind) == ("Sequential", Phase.SETUP, "stage_setup")
    assert rule.owner(_issued("send", tensor=object()), Facts(tags={1: PipelineTag(
        "S", 0, 0, "activation_send", 1)})) is None
    assert rule.owner(_issued("all_reduce"), Facts(setup_stage="Sequential")) is None


def test_watch_pipeline_rejects_what_is_not_a_schedule() -> None:
    """watch_pipeline() names the argument, the value and what to pass instead."""
    from commspan import CommSpanMode

    with pytest.raises(TypeError, match=r"schedule=.*not a pipeline schedule.*ScheduleGPipe"):
        CommSpanMode().watch_pipeline(object())


def test_resolve_takes_the_first_rule_that_knows() -> None:
    """resolve() tries the rules in order and gives None when none knows the collective."""
    fsdp_issued = _issued("all_gather_into_tensor", ("FSDP::all_gather (blocks.0)",))
    facts = Facts(UNITS)
    owner = resolve(fsdp_issued, facts, (DdpModules(), FsdpUnits()))
    assert owner is not None and owner.source == "fsdp"
    assert resolve(_issued("all_reduce"), facts, (FsdpUnits(), DdpModules())) is None


def test_counted_names_skips_modules_that_never_ran() -> None:
    """The owner counts, then the enclosing modules that ran (a ModuleList never does)."""
    assert counted_names("Net.blocks.0.a", {"Net", "Net.blocks.0"}) == (
        "Net.blocks.0.a", "Net.blocks.0", "Net")
    assert counted_names("Net", set()) == ("Net",)


# ------------------------------------------------------------------ counting
def _recorder(spans: list[ReadableSpan]) -> SpanRecorder:
    rec = SpanRecorder(spans.append, Resource({}), "test", traces=TraceOpener())
    rec.ensure_trace()
    return rec


def _event(rec: SpanRecorder, op: str, phase: str, counted: tuple[str, ...] = ()) -> dict[str, Any]:
    attrs: dict[str, Any] = {semconv.COLL_OP: op, semconv.PHASE: phase,
                             semconv.MODULE_FQN: rec.stack[-1].fqn}
    rec.add_event(op, op, phase, attrs, counted)
    return attrs


def test_owned_collective_counts_for_its_owner_not_the_open_span() -> None:
    """A collective issued inside Net.head's backward but owned by Net.blocks.0 counts
    for Net (open, encloses the owner), Global and Net.blocks.0 (credited: no open
    span), not for Net.head; the event stays on Net.head's span."""
    spans: list[ReadableSpan] = []
    rec = _recorder(spans)
    net = rec.push("Net", Phase.BACKWARD, {semconv.MODULE_FQN: "Net"})
    head = rec.push("Net.head", Phase.BACKWARD, {semconv.MODULE_FQN: "Net.head"})
    attrs = _event(rec, "all_gather", "backward", ("Net.blocks.0", "Net"))
    assert attrs[semconv.OWNER_CREDIT] == ["Net.blocks.0"]
    live = Aggregator()
    live.attach_live(rec.open_spans)  # while the spans are open
    expected = {
        "Global": {"backward": {"all_gather": 1}},
        "Net": {"backward": {"all_gather": 1}},
        "Net.blocks.0": {"backward": {"all_gather": 1}},
    }
    assert live.module_counts() == expected
    rec.finish(head)
    rec.finish(net)
    rec.end()
    finished = Aggregator()
    for span in spans:
        finished.on_end(span)
    assert finished.module_counts() == expected
    (head_span,) = [s for s in spans if s.name == "Net.head backward"]
    assert [e.name for e in head_span.events] == ["all_gather"]
    assert semconv.count_key("backward", "all_gather") not in head_span.attributes
    assert "Net.blocks.0" in finished.modules()


def test_owned_collective_counts_once_per_name_in_any_phase() -> None:
    """The owner's open span counts it whatever its phase (a recompute unshard of a
    unit inside a backward), once per module name; nothing is credited."""
    spans: list[ReadableSpan] = []
    rec = _recorder(spans)
    rec.push("Net", Phase.BACKWARD, {semconv.MODULE_FQN: "Net"})
    rec.push("Net.b", Phase.BACKWARD, {semconv.MODULE_FQN: "Net.b"})
    rec.push("Net.b", Phase.RECOMPUTE, {semconv.MODULE_FQN: "Net.b"})
    attrs = _event(rec, "all_gather", "recompute", ("Net.b", "Net"))
    assert semconv.OWNER_CREDIT not in attrs
    counts = [dict(f.counts) for f in rec.stack]
    key = ("recompute", "all_gather")
    assert counts == [{key: 1}, {key: 1}, {}, {key: 1}]


def test_position_owned_collective_counts_as_before() -> None:
    """Without owner names the chain rule applies unchanged: every open span of the
    phase counts it (tensor parallelism)."""
    rec = _recorder([])
    rec.push("Net", Phase.FORWARD, {semconv.MODULE_FQN: "Net"})
    rec.push("Other", Phase.FORWARD, {semconv.MODULE_FQN: "Other"})
    attrs = _event(rec, "all_reduce", "forward")
    assert semconv.OWNER_CREDIT not in attrs
    assert [dict(f.counts) for f in rec.stack] == [{("forward", "all_reduce"): 1}] * 3

