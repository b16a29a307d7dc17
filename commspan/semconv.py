"""The names commspan gives its spans, events and attributes: the one place they live.

Every other module imports names from here; ``docs/schema.md`` is checked
against this module by ``tests/test_semconv.py``. Changing a name here is a
schema change: bump :data:`SCHEMA_VERSION` and note it in ``CHANGELOG.md``.

Example:
    >>> from commspan import semconv
    >>> semconv.MODULE_FQN
    'commspan.module.fqn'
    >>> semconv.count_key(semconv.Phase.FORWARD, "all_reduce")
    'commspan.collectives.forward.all_reduce'
"""

from __future__ import annotations

import enum
from functools import cache

__all__ = [
    "ATTRIBUTES",
    "BYTES_PREFIX",
    "COLL_ALGBW",
    "COLL_BUSBW",
    "COLL_DURATION_NS",
    "COLL_WAIT_NS",
    "COLL_INPUT_SPLITS",
    "COLL_KIND",
    "COLL_OP",
    "COLL_OUTPUT_SPLITS",
    "COLL_OVERLOAD",
    "COLL_PEER",
    "COLL_ROOT",
    "COLL_REDUCE_OP",
    "COLL_SEQ",
    "COLL_STATE",
    "COMM_TIME_PREFIX",
    "COUNT_PREFIX",
    "COUNT_TOTAL",
    "DDP_BUCKET_INDEX",
    "DDP_BUCKET_MODULES",
    "EVENT_EXCEPTION",
    "EVENT_GC",
    "EXCEPTION_MESSAGE",
    "EXCEPTION_TYPE",
    "FSDP_UNIT_MODULES",
    "GC_COLLECTED",
    "GC_DURATION_NS",
    "GC_GENERATION",
    "GLOBAL_FQN",
    "HANG_REASON",
    "HANG_REASON_DUMP",
    "HANG_REASON_SIGNAL",
    "HANG_REASON_TIMEOUT",
    "HANG_STACK_FQNS",
    "HANG_STACK_PHASES",
    "HANG_STEP_TRACED",
    "HANG_TIMEOUT",
    "HOST_NAME",
    "INSTRUMENTATION_SCOPE",
    "KIND_COLLECTIVE",
    "LOCAL_RANK",
    "MESH_DIM",
    "MESH_DIM_NAME",
    "MODULE_DEPTH",
    "MODULE_FQN",
    "MODULE_TYPE",
    "OWNER_BYTES",
    "OWNER_CREDIT",
    "OWNER_FQN",
    "OWNER_KIND",
    "OWNER_KIND_ACTIVATION_RECV",
    "OWNER_KIND_ACTIVATION_SEND",
    "OWNER_KIND_ALL_REDUCE",
    "OWNER_KIND_BUCKET",
    "OWNER_KIND_FORWARD_SYNC",
    "OWNER_KIND_GRADIENT_RECV",
    "OWNER_KIND_GRADIENT_SEND",
    "OWNER_KIND_INIT_SYNC",
    "OWNER_KIND_REDISTRIBUTE_GRAD",
    "OWNER_KIND_REDUCE_GRAD",
    "OWNER_KIND_STAGE_SETUP",
    "OWNER_KIND_UNSHARD",
    "OWNER_KIND_UNUSED_MAP",
    "OWNER_PARAMS",
    "OWNER_PREFETCH",
    "OWNER_SOURCE",
    "PARAM_NAMES",
    "PARAM_PLACEMENTS",
    "P2P_SEQ",
    "P2P_TAG",
    "PARAM_SHAPES",
    "PG_NAME",
    "PG_RANKS",
    "PG_SIZE",
    "PHASE",
    "PP_MICROBATCH",
    "PP_PEER_STAGE",
    "PP_STAGE",
    "PROCESS_PID",
    "Phase",
    "RANK",
    "REDIST_DST",
    "REDIST_OP",
    "REDIST_SRC",
    "ROOTED_OPS",
    "RUN_ID",
    "SAMPLING_RANKS",
    "SCHEMA",
    "SCHEMA_URL",
    "SCHEMA_VERSION",
    "SELF_COUNT",
    "SERVICE_INSTANCE_ID",
    "SERVICE_NAME",
    "SOURCE_COMPILE",
    "SOURCE_DDP",
    "SOURCE_FSDP",
    "SOURCE_PIPELINE",
    "SOURCE_POSITION",
    "SPAN_HANG",
    "SPAN_RANK",
    "SPAN_SESSION",
    "SPAN_STEP",
    "STATE_COMPLETED",
    "STATE_FAILED",
    "STATE_ISSUED",
    "STEP",
    "TENSOR_BYTES",
    "TENSOR_COUNT",
    "TENSOR_DTYPE",
    "TENSOR_SHAPE",
    "WORLD_SIZE",
    "bytes_key",
    "comm_time_key",
    "count_key",
    "module_span_name",
    "parse_count_key",
]

SCHEMA_VERSION = "4"
"""Version of commspan's span schema; bumped whenever a name below changes or changes
meaning. 2: collectives have an owner (``commspan.owner.*``) and count for it, not for
the span open when they were issued; phase ``setup``; ``commspan.mesh.dim_name``.
3: ``commspan.collective.seq`` counts collectives only; point-to-point ops are
numbered per peer and direction (``commspan.p2p.seq``). 4: barriers are collectives
(``barrier``, ``monitored_barrier``: numbered in their group's sequence); ``scatter``'s
tensor attributes describe its output, the rank's share; ``commspan.p2p.tag``; a
receive from any source has no ``commspan.p2p.seq``."""

SCHEMA_URL = f"https://commspan.dev/schemas/{SCHEMA_VERSION}"
"""Schema URL recorded on the instrumentation scope of every span."""

INSTRUMENTATION_SCOPE = "commspan"
"""Instrumentation scope name of every span commspan emits."""


class Phase(str, enum.Enum):
    """The phase a module span or a collective belongs to."""

    FORWARD = "forward"
    """A module's forward call."""
    BACKWARD = "backward"
    """The module's part of autograd's backward pass; also a module called while
    autograd runs that is not a recompute (from a gradient hook, say)."""
    RECOMPUTE = "recompute"
    """The forward re-run during backward by activation checkpointing."""
    SETUP = "setup"
    """Collectives only: a parallel wrapper setting itself up, not a training phase
    (DDP's construction: its parameter check and state broadcast)."""

    def __str__(self) -> str:
        return self.value


GLOBAL_FQN = "Global"
"""Pseudo module name of the per-rank root span; its counts cover the whole rank."""

# ---------------------------------------------------------------- span names
SPAN_STEP = "commspan.step"
"""Trace root of one training step (emitted by one process for all ranks)."""
SPAN_SESSION = "commspan.session"
"""Trace root covering a ``with CommSpanMode():`` block used without steps."""
SPAN_RANK = "commspan.rank"
"""Per-rank span under the trace root; parent of that rank's module spans."""
SPAN_HANG = "commspan.hang"
"""A rank's record of what it is doing, written at once (not when a step ends) when a
collective has not completed after ``hang_timeout_s``, on ``mode.dump()`` or on the
opt-in signal. Child of the rank span of the step in progress (that rank span may never
be written); starts when the oldest incomplete collective was issued (or at the dump when
none is), ends at the dump. Carries ``commspan.hang.*`` attributes and one event per
recent collective (see Events)."""


def module_span_name(fqn: str, phase: Phase) -> str:
    """Name of a module span, e.g. ``"MLPModule.net2 forward"``."""
    return f"{fqn} {phase.value}"


EVENT_EXCEPTION = "exception"
"""OpenTelemetry's standard event name for a recorded exception."""

# ---------------------------------------------------------- span attributes
RUN_ID = "commspan.run_id"
STEP = "commspan.step"
RANK = "commspan.rank"
LOCAL_RANK = "commspan.local_rank"
WORLD_SIZE = "commspan.world_size"
SAMPLING_RANKS = "commspan.sampling.ranks"
SCHEMA = "commspan.schema_version"

MODULE_FQN = "commspan.module.fqn"
MODULE_TYPE = "commspan.module.type"
MODULE_DEPTH = "commspan.module.depth"
PHASE = "commspan.phase"
PARAM_NAMES = "commspan.module.param_names"
PARAM_PLACEMENTS = "commspan.module.param_placements"
PARAM_SHAPES = "commspan.module.param_shapes"

COUNT_PREFIX = "commspan.collectives."
"""Prefix of per-op collective counts on module and rank spans.

``commspan.collectives.<phase>.<op>`` is the number of ``<op>`` collectives of
``<phase>`` issued inside the span or any span nested in it that count for the
span's module. A collective counts for its owner (``commspan.owner.fqn``), for
the modules enclosing the owner by name, and for the rank span. For a
collective owned by the span open when it was issued (tensor parallelism,
``commspan.owner.source`` ``position``) that means: every open span of its phase,
and a span of another phase only if its module encloses the owner by name (a
recompute that runs inside ``w2``'s backward is not charged to ``w2``). A module
open twice in one chain (a recompute inside its own backward) counts it once.
A module a collective counts for that had no open span when it was issued is
named in the event's ``commspan.owner.credit_fqns`` instead. A module's count is
the sum over its spans plus the events that credit it.
"""
COUNT_TOTAL = "total"
"""``commspan.collectives.<phase>.total``: all ops of that phase, same rules."""
SELF_COUNT = "commspan.collectives.self"
"""Number of collective events attached to this very span."""

BYTES_PREFIX = "commspan.bytes."
"""Prefix of the per-phase byte roll-ups on module and rank spans.

``commspan.bytes.<phase>`` is the sum of ``commspan.tensor.bytes`` over the
collectives of ``<phase>`` in the span's subtree, with the rules of the counts
(see :data:`COUNT_PREFIX`): a backend can sum it over the spans of one module.
"""
COMM_TIME_PREFIX = "commspan.comm_time_ns."
"""Prefix of the per-phase collective-time roll-ups on module and rank spans.

``commspan.comm_time_ns.<phase>`` is the sum of ``commspan.collective.duration_ns``
over the collectives of ``<phase>`` in the span's subtree that have one, with the
rules of the counts; absent when none of them was timed.
"""

# ---------------------------------------------------------- event attributes
COLL_OP = "commspan.collective.op"
COLL_OVERLOAD = "commspan.collective.overload"
COLL_KIND = "commspan.collective.kind"
COLL_SEQ = "commspan.collective.seq"
P2P_SEQ = "commspan.p2p.seq"
P2P_TAG = "commspan.p2p.tag"
COLL_REDUCE_OP = "commspan.collective.reduce_op"
COLL_PEER = "commspan.collective.peer"
COLL_ROOT = "commspan.collective.root"
ROOTED_OPS = frozenset(("broadcast", "gather", "reduce", "scatter"))
"""The canonical ops (values of ``COLL_OP``) that have a root, so their events carry
``COLL_ROOT``. A rank other than the root can finish its part before every rank took
part (its data sent to a root not yet there): their ranks do not all wait for the last
one to arrive."""
COLL_INPUT_SPLITS = "commspan.collective.input_split_sizes"
COLL_OUTPUT_SPLITS = "commspan.collective.output_split_sizes"
COLL_DURATION_NS = "commspan.collective.duration_ns"
COLL_WAIT_NS = "commspan.collective.wait_ns"
PG_NAME = "commspan.pg.name"
PG_SIZE = "commspan.pg.size"
PG_RANKS = "commspan.pg.ranks"
MESH_DIM = "commspan.mesh.dim"
MESH_DIM_NAME = "commspan.mesh.dim_name"
OWNER_FQN = "commspan.owner.fqn"
OWNER_SOURCE = "commspan.owner.source"
OWNER_KIND = "commspan.owner.kind"
OWNER_PREFETCH = "commspan.owner.prefetch"
OWNER_PARAMS = "commspan.owner.params"
OWNER_BYTES = "commspan.owner.bytes"
OWNER_CREDIT = "commspan.owner.credit_fqns"
DDP_BUCKET_INDEX = "commspan.ddp.bucket.index"
DDP_BUCKET_MODULES = "commspan.ddp.bucket.modules"
FSDP_UNIT_MODULES = "commspan.fsdp.unit.modules"
PP_STAGE = "commspan.pp.stage"
PP_MICROBATCH = "commspan.pp.microbatch"
PP_PEER_STAGE = "commspan.pp.peer_stage"
TENSOR_SHAPE = "commspan.tensor.shape"
TENSOR_DTYPE = "commspan.tensor.dtype"
TENSOR_BYTES = "commspan.tensor.bytes"
TENSOR_COUNT = "commspan.tensor.count"
REDIST_SRC = "commspan.redistribute.src"
REDIST_DST = "commspan.redistribute.dst"
REDIST_OP = "commspan.redistribute.op"

COLL_ALGBW = "commspan.collective.algbw"
COLL_BUSBW = "commspan.collective.busbw"
COLL_STATE = "commspan.collective.state"

KIND_COLLECTIVE = "collective"
KIND_P2P = "p2p"

SOURCE_POSITION = "position"
"""``commspan.owner.source``: owned by the innermost span open when it was issued."""
SOURCE_FSDP = "fsdp"
"""``commspan.owner.source``: an FSDP2 (``fully_shard``) collective, owned by its unit."""
SOURCE_DDP = "ddp"
"""``commspan.owner.source``: a DistributedDataParallel collective."""
SOURCE_PIPELINE = "pipeline"
"""``commspan.owner.source``: a point-to-point op of a watched pipeline stage."""
SOURCE_COMPILE = "compile"
"""``commspan.owner.source``: in a torch.compile'd region run by torch's DebugInterpreter
(``aot_eager``), owned by the submodule of the graph node that issued it."""

OWNER_KIND_UNSHARD = "unshard"
"""``commspan.owner.kind``: FSDP2 all-gather of a unit's parameters."""
OWNER_KIND_REDUCE_GRAD = "reduce_grad"
"""``commspan.owner.kind``: FSDP2 reduce-scatter of a unit's gradients."""
OWNER_KIND_ALL_REDUCE = "all_reduce"
"""``commspan.owner.kind``: HSDP all-reduce of a unit's gradient shard across replicas."""
OWNER_KIND_REDISTRIBUTE_GRAD = "redistribute_grad"
"""``commspan.owner.kind``: FSDP2 over tensor parallelism: a gradient of the unit brought
to its parameter's placement over the other mesh dimensions while FSDP collects the
unit's gradients for their reduction (a sequence-parallel norm's partial gradient
all-reduced over ``tp``)."""
OWNER_KIND_BUCKET = "bucket"
"""``commspan.owner.kind``: DDP all-reduce of one gradient bucket (or a comm hook's
collective for it)."""
OWNER_KIND_UNUSED_MAP = "unused_map"
"""``commspan.owner.kind``: DDP's all-reduce of which parameters were used
(``find_unused_parameters=True``)."""
OWNER_KIND_INIT_SYNC = "init_sync"
"""``commspan.owner.kind``: DDP's construction: parameter shape check, state broadcast."""
OWNER_KIND_FORWARD_SYNC = "forward_sync"
"""``commspan.owner.kind``: DDP's forward: bucket-rebuild and buffer broadcasts."""
OWNER_KIND_ACTIVATION_SEND = "activation_send"
"""``commspan.owner.kind``: a pipeline stage sends a microbatch's activations on."""
OWNER_KIND_ACTIVATION_RECV = "activation_recv"
"""``commspan.owner.kind``: a pipeline stage receives a microbatch's activations."""
OWNER_KIND_GRADIENT_SEND = "gradient_send"
"""``commspan.owner.kind``: a pipeline stage sends a microbatch's input gradients back."""
OWNER_KIND_GRADIENT_RECV = "gradient_recv"
"""``commspan.owner.kind``: a pipeline stage receives its output gradients."""
OWNER_KIND_STAGE_SETUP = "stage_setup"
"""``commspan.owner.kind``: pipeline stages exchanging tensor shapes before their first
microbatch."""

STATE_ISSUED = "issued"
"""``commspan.collective.state``: issued, not known to have completed."""
STATE_COMPLETED = "completed"
"""``commspan.collective.state``: completed, as far as the rank can observe."""
STATE_FAILED = "failed"
"""``commspan.collective.state``: the op raised on this rank (a backend's timeout, a
peer gone): it never completed."""

# ------------------------------------------------------------- hang records
HANG_REASON = "commspan.hang.reason"
HANG_TIMEOUT = "commspan.hang.timeout_s"
HANG_STACK_FQNS = "commspan.hang.stack.fqns"
HANG_STACK_PHASES = "commspan.hang.stack.phases"
HANG_STEP_TRACED = "commspan.hang.step_traced"

HANG_REASON_TIMEOUT = "timeout"
"""``commspan.hang.reason``: a collective did not complete within ``hang_timeout_s``."""
HANG_REASON_DUMP = "dump"
"""``commspan.hang.reason``: the program called ``mode.dump()``."""
HANG_REASON_SIGNAL = "signal"
"""``commspan.hang.reason``: the opt-in signal (e.g. SIGUSR1) arrived."""

# ------------------------------------------------------ garbage collections
EVENT_GC = "commspan.gc"
"""Event name of a pause of the process for Python's garbage collector, recorded on
the rank span of the trace in progress (``CommSpanMode(record_gc=True)``)."""
GC_GENERATION = "commspan.gc.generation"
GC_DURATION_NS = "commspan.gc.duration_ns"
GC_COLLECTED = "commspan.gc.collected"

# -------------------------------------------------- OpenTelemetry conventions
EXCEPTION_TYPE = "exception.type"
EXCEPTION_MESSAGE = "exception.message"
SERVICE_NAME = "service.name"
SERVICE_INSTANCE_ID = "service.instance.id"
HOST_NAME = "host.name"
PROCESS_PID = "process.pid"

ATTRIBUTES: dict[str, str] = {
    RUN_ID: "Run identifier shared by all ranks of one run (resource and rank span).",
    STEP: "Step index given to ``mode.step(i)`` (step root and rank span).",
    RANK: "Global rank of the process (resource and rank span).",
    LOCAL_RANK: "Rank within the node, from ``LOCAL_RANK`` (torchrun sets it); 0 for a "
                "world of one rank; absent when unknown: no ``LOCAL_RANK`` in a world of "
                "several ranks (resource).",
    WORLD_SIZE: "Number of ranks (resource and rank span).",
    SCHEMA: "commspan span schema version (rank span).",
    MODULE_FQN: "Module name: root class name + dotted path, e.g. ``MLPModule.net2``; "
    "``Global`` on the rank span. Also copied onto every collective event. A submodule "
    "assigned after its model was first named (a new head, a swapped block, a LoRA layer) "
    "is named by its path in the module that calls it (``Net.head``, ``Net.blocks.3``), "
    "when it is that module's child or inside a ``ModuleList`` / ``ModuleDict`` child of "
    "it; a module keeps the name it was first seen under (one shared under two names, the "
    "first). Two top-level "
    "models of one class called apart (a student and its teacher) share their names, and "
    "their counts add up; call them from one parent module (then ``Parent.student`` and "
    "``Parent.teacher``) to tell them apart. A model class named ``Global`` is not told "
    "apart from the rank span (as in torch's CommDebugMode).",
    MODULE_TYPE: "Class name of the module, e.g. ``Linear``.",
    MODULE_DEPTH: "Nesting depth of the module call (root module = 1).",
    PHASE: "``forward``, ``backward``, ``recompute`` or ``setup`` (see Phases). Also copied "
           "onto every event.",
    PARAM_NAMES: "Names of the module's direct parameters (forward spans).",
    PARAM_PLACEMENTS: "DTensor placements of those parameters, e.g. ``S(0)``; "
    "empty string for a plain tensor (forward spans). A parameter FSDP2 manages is "
    "described by the sharded DTensor FSDP2 keeps, also while its unit has it gathered.",
    PARAM_SHAPES: "Global shapes of those parameters, e.g. ``16x10`` (forward spans).",
    COUNT_PREFIX + "<phase>.<op>": "Collectives of that phase and op inside the span's "
    "subtree (int).",
    COUNT_PREFIX + "<phase>.total": "All collectives of that phase inside the subtree (int).",
    SELF_COUNT: "Collective events attached to this span itself (int).",
    BYTES_PREFIX + "<phase>": "Bytes (``commspan.tensor.bytes``) of the collectives of that "
    "phase inside the span's subtree, same rules as the counts (int).",
    COMM_TIME_PREFIX + "<phase>": "Sum of ``commspan.collective.duration_ns`` of the timed "
    "collectives of that phase inside the span's subtree, same rules as the counts (int ns). "
    "Collectives overlap each other and compute, so this is time spent waiting on "
    "collectives summed per collective, not a share of the span's duration.",
    SAMPLING_RANKS: "Resource: how the ranks that trace were chosen, when not all do "
    "(``CommSpanMode(ranks=...)``), e.g. ``ranks 0,8``, ``fraction 0.25 (ranks 0,4)``, "
    "``one per tp group (ranks 0,8)`` (a fraction and one per group list the ranks they "
    "chose in the job's world); ``commspan check`` then expects the ranks that wrote spans "
    "and those it names.",
    COLL_OP: "Canonical op name (also the event name), e.g. ``all_reduce``.",
    COLL_OVERLOAD: "Full op overload, e.g. ``_c10d_functional.all_reduce.default``.",
    COLL_KIND: "``collective`` or ``p2p`` (send/recv).",
    COLL_SEQ: (
        "Per-rank, per-process-group sequence number of collectives: 1 for the first "
        "collective a `CommSpanMode` sees on the group, counting on across its `with` "
        "blocks, so the ranks of a group that trace the same steps give a collective the "
        "same number. "
        "Point-to-point ops do not count here (they have `commspan.p2p.seq`); files of "
        "schema 2 counted them too."
    ),
    P2P_SEQ: (
        "Point-to-point ops: per-rank number of the op among those in the same direction "
        "with the same peer on the group: 1 for the first send to that peer (receive from "
        "it), counting on across the mode's `with` blocks. A send and the receive that "
        "matches it carry the same number when the backend matches a pair's ops in the "
        "order they were issued (NCCL; gloo for ops of one tag). Absent on a receive from "
        "any source (its peer is not known when it is issued)."
    ),
    P2P_TAG: "Point-to-point ops given a tag other than 0: the tag. gloo matches a send "
    "with a receive by peer and tag, so ops of several tags in flight between two ranks "
    "may match in another order than ``commspan.p2p.seq`` numbers them.",
    COLL_REDUCE_OP: "Reduce op, e.g. ``sum``, when the op has one.",
    COLL_DURATION_NS: "Issue to completion of the collective as the issuing process observes "
    "it (``wait_tensor`` for functional collectives, the ``Work`` of a blocking c10d op, the "
    "future of an async one, CUDA events for CUDA tensors), int ns; absent with "
    "``time_collectives=False`` or when the completion was not seen before the step ended. "
    "The rank that arrived last waits least; the HTML report and the Chrome trace draw "
    "collectives with this width.",
    COLL_WAIT_NS: "Functional collectives: the time the rank spent inside the "
    "``wait_tensor`` that completed the collective, int ns (from its call to its return, at "
    "most the duration). A rank that did other work between issuing the collective and "
    "waiting for it has a duration that holds that work too: a wait much shorter than the "
    "duration says so, and ``commspan stragglers`` does not read such a duration as a "
    "late arrival. Absent for other collectives (their wait starts when they are issued) "
    "and for CUDA tensors.",
    COLL_INPUT_SPLITS: "``all_to_all_single`` with uneven splits (expert parallelism): how "
    "many rows of the input go to each rank of the group, in group rank order (int array); "
    "absent when the caller passes none (even splits).",
    COLL_OUTPUT_SPLITS: "``all_to_all_single`` with uneven splits: how many rows come from "
    "each rank of the group (int array); absent when the caller passes none.",
    COLL_PEER: "Global rank of the peer of a point-to-point op (ops take group ranks; "
    "commspan maps them through the group's ranks).",
    COLL_ROOT: "Global rank of the root of a collective that has one (``broadcast``'s "
    "source, ``gather``'s and ``reduce``'s destination, ``scatter``'s source): every rank "
    "of the group must name the same (``commspan check`` compares it).",
    PG_NAME: "Process group name.",
    PG_SIZE: "Process group size.",
    PG_RANKS: "Global ranks of the process group.",
    MESH_DIM: "DeviceMesh dimension the process group belongs to, when known.",
    MESH_DIM_NAME: "Name of that mesh dimension (``mesh_dim_names``), when the mesh names "
    "it, e.g. ``tp``, ``dp``; also when only the group's description says it (torch's "
    "DeviceMesh describes its groups as ``mesh_<name>``: a collective met before any DTensor "
    "of that mesh, such as ``distribute_tensor``'s scatter), without ``commspan.mesh.dim``.",
    OWNER_FQN: "The module that owns the collective: its counts include it. The span open "
    "when it was issued (``commspan.module.fqn``) for tensor parallelism and a module's own "
    "collectives; the FSDP unit whose parameters it moves (for a unit of several modules, the "
    "lowest module holding them all); the lowest module holding all "
    "of a DDP bucket's parameters; the DDP module for DDP's own syncs. See "
    "docs/parallelisms.md.",
    OWNER_SOURCE: "What decided the owner: ``position``, ``fsdp``, ``ddp``, ``pipeline`` or "
    "``compile`` (the submodule a compiled graph's node belongs to, ``aot_eager``).",
    OWNER_KIND: "What the collective does for its owner (FSDP: ``unshard``, ``reduce_grad``, "
    "``all_reduce``, ``redistribute_grad``; DDP: ``bucket``, ``unused_map``, ``init_sync``, "
    "``forward_sync``; pipeline: ``activation_send``, ``activation_recv``, ``gradient_send``, "
    "``gradient_recv``, ``stage_setup``); absent for ``position``.",
    OWNER_PREFETCH: "FSDP unshard: issued ahead of its unit's use by another unit's hook "
    "(implicit backward prefetch, or ``set_modules_to_*_prefetch``) (bool).",
    OWNER_PARAMS: "Number of parameters the collective moves: the FSDP unit's own "
    "parameters (nested units excluded), for its gradient reduction those that require "
    "gradients, or the DDP bucket's (int).",
    OWNER_BYTES: "Bytes of the owner's data the collective carries: the whole (padded) "
    "unit for an FSDP all-gather (its output) or reduce-scatter (its input), the unit's "
    "shard for HSDP's all-reduce, the gradient for ``redistribute_grad`` (an all-gather's "
    "output, a sharded gradient gathered), the bucket for DDP "
    "(int). Over the wire each rank "
    "sends about this x (n-1)/n (all-gather, reduce-scatter) or x 2(n-1)/n (all-reduce).",
    OWNER_CREDIT: "Modules the collective counts for (its owner and the modules enclosing "
    "it by name) that had no open span when it was issued, so that no span's count "
    "attributes hold it; readers add the event to these modules' counts (array).",
    DDP_BUCKET_INDEX: "DDP bucket index (the reducer's; buckets are launched in index order).",
    PP_STAGE: "Pipeline stage index: on the module spans of a watched stage while it runs a "
    "microbatch, and on its point-to-point events (int).",
    PP_MICROBATCH: "Microbatch index, on the same spans and events (int).",
    PP_PEER_STAGE: "The stage a pipeline point-to-point op exchanges with (int; its global "
    "rank is ``commspan.collective.peer``).",
    DDP_BUCKET_MODULES: "Modules holding the DDP bucket's parameters (array of module fqns).",
    FSDP_UNIT_MODULES: "The modules of an FSDP unit made of several (``fully_shard([a, b])``; "
    "array of module fqns); its owner is the lowest module holding them all.",
    TENSOR_SHAPE: "Shape of the (first) input tensor (``scatter``: of its output, the "
    "rank's share, since only its source has inputs; barriers: none).",
    TENSOR_DTYPE: "Dtype of the input tensor(s), e.g. ``float32``.",
    TENSOR_BYTES: "Bytes of all input tensors of the op (``scatter``: of its output).",
    TENSOR_COUNT: "Number of input tensors (coalesced and list ops).",
    REDIST_SRC: "DTensor placements before the redistribution that issued the op.",
    REDIST_DST: "DTensor placements after it.",
    REDIST_OP: "The DTensor op that needed the redistribution, or ``redistribute``.",
    COLL_ALGBW: "Algorithm bandwidth, GB/s (1e9 bytes/s): the op's size S over its duration. "
    "S is the bytes of all ranks' shares for ``all_gather*``, ``gather`` and ``scatter`` "
    "(``commspan.tensor.bytes`` x group size), ``commspan.tensor.bytes`` otherwise.",
    COLL_BUSBW: "Bus bandwidth, GB/s: algbw x the NCCL-tests factor for the op and group size "
    "n: 2(n-1)/n for ``all_reduce*``; (n-1)/n for ``all_gather*``, ``reduce_scatter*``, "
    "``all_to_all*``, ``gather``, ``scatter``; 1 for ``broadcast``, ``reduce`` and p2p.",
    COLL_STATE: "``issued``, ``completed`` or ``failed``: on the collective events of a "
    "``commspan.hang`` span, whether that collective had completed at the dump, or its op "
    "raised on this rank (a backend's timeout: it never completed). On a module span's "
    "collective event only ``failed``, when its op (or the wait for it) raised: "
    "``commspan check`` names it without a hang record.",
    HANG_REASON: "Why a ``commspan.hang`` span was written: ``timeout``, ``dump`` or "
    "``signal``.",
    HANG_TIMEOUT: "The ``hang_timeout_s`` in force (float seconds), when the reason is "
    "``timeout``.",
    HANG_STACK_FQNS: "The rank's open module spans at the dump, outermost first (array of "
    "module fqns; the rank span's ``Global`` is not listed).",
    HANG_STACK_PHASES: "The phase of each of those spans (array parallel to "
    "``commspan.hang.stack.fqns``).",
    HANG_STEP_TRACED: "``false`` when the step in progress (``commspan.step``) is one "
    "``sample=`` leaves out: nothing of it is recorded, so the stack and collectives "
    "say nothing of where the rank is in it (absent otherwise).",
    GC_GENERATION: "On a ``commspan.gc`` event: the generation the garbage collector "
    "collected, 0 to 2 (2: a full collection, which walks every object of the process).",
    GC_DURATION_NS: "On a ``commspan.gc`` event: how long the collection held the process "
    "(ns); the event is timestamped when it started.",
    GC_COLLECTED: "On a ``commspan.gc`` event: the unreachable objects it found.",
    EXCEPTION_TYPE: "Exception class (on the ``exception`` event).",
    EXCEPTION_MESSAGE: "Exception message (on the ``exception`` event).",
}
"""Every attribute commspan writes, with its meaning (the source of docs/schema.md)."""


@cache
def count_key(phase: Phase | str, op: str) -> str:
    """Attribute key holding the subtree count of ``op`` collectives in ``phase``."""
    return f"{COUNT_PREFIX}{Phase(phase).value}.{op}"


@cache
def bytes_key(phase: Phase | str) -> str:
    """Attribute key of the subtree's collective bytes in ``phase``, e.g.
    ``commspan.bytes.forward``."""
    return f"{BYTES_PREFIX}{Phase(phase).value}"


@cache
def comm_time_key(phase: Phase | str) -> str:
    """Attribute key of the subtree's collective time in ``phase``, e.g.
    ``commspan.comm_time_ns.backward``."""
    return f"{COMM_TIME_PREFIX}{Phase(phase).value}"


def parse_count_key(key: str) -> tuple[str, str] | None:
    """Split a count attribute key into ``(phase, op)``; ``None`` if it is not one.

    ``commspan.collectives.self`` and ``…<phase>.total`` are not per-op counts
    and also return ``None``.
    """
    if not key.startswith(COUNT_PREFIX):
        return None
    rest = key[len(COUNT_PREFIX) :]
    phase, sep, op = rest.partition(".")
    if not sep or op == COUNT_TOTAL or phase not in _PHASE_VALUES:
        return None
    return phase, op


_PHASE_VALUES = frozenset(p.value for p in Phase)
