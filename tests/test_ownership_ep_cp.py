"""Expert parallel and context parallel: the layer that issues the collectives owns them.

Fake process group of 4 ranks (this process is rank 0). The models keep their
own log of the collectives each of their layers calls (which layer, which op,
which split sizes or peer); the reference never uses commspan's attribution.

- Expert parallel: an MoE layer routes tokens to experts on other ranks with
  ``all_to_all_single`` and uneven split sizes (dispatch with the functional
  collective that has a backward, combine with the c10d one).
- Context parallel: attention that all-gathers K and V over the context
  group, and a ring variant that passes K/V blocks to the next rank with
  ``isend``/``irecv`` (batched, as ring attention does).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commspan import semconv
from commspan.testing import CommCapture, capture, fake_process_group

WORLD = 4
DIM = 8
TOKENS = 12


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    with fake_process_group(world_size=WORLD):
        yield


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.w(x))


class MoE(torch.nn.Module):
    """Top-1 routing over ``WORLD`` ranks' experts; splits follow the router."""

    def __init__(self, log: list[tuple[str, str, list[int], list[int]]]) -> None:
        super().__init__()
        self.router = torch.nn.Linear(DIM, WORLD)
        self.experts = Experts()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dest = self.router(x).argmax(-1)
        order = dest.argsort()
        splits = torch.bincount(dest, minlength=WORLD).tolist()
        # a real layer first exchanges the counts; the fake group returns no data,
        # so each rank is taken to receive what it sends
        received = list(splits)
        group = dist.group.WORLD
        assert group is not None
        routed = funcol.all_to_all_single_autograd(x[order], received, splits, group)
        self.log.append(("MoE", "dispatch", splits, received))
        y = self.experts(routed)
        out = torch.empty(sum(splits), DIM)
        dist.all_to_all_single(out, y.detach(), output_split_sizes=splits,
                               input_split_sizes=received)
        self.log.append(("MoE", "combine", received, splits))
        return y + out  # the combine's result joins without a gradient of its own


class Block(torch.nn.Module):
    def __init__(self, log: list[Any]) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.moe = MoE(log)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


def _events(cap: CommCapture) -> list[dict[str, Any]]:
    out = []
    for span in cap.spans:
        for event in span.events:
            if semconv.COLL_OP in event.attributes:
                out.append((event.timestamp, dict(event.attributes)))
    return [a for _, a in sorted(out, key=lambda item: item[0])]


def test_expert_parallel_all_to_all_owned_by_the_moe_layer(world: None) -> None:
    """Dispatch and combine are owned by the MoE layer in forward, their uneven
    split sizes recorded as the layer passed them; the dispatch's backward
    all_to_all is the layer's too, in backward."""
    torch.manual_seed(0)
    log: list[tuple[str, str, list[int], list[int]]] = []
    model = Block(log)
    x = torch.randn(TOKENS, DIM, requires_grad=True)
    with capture() as cap:
        with cap.mode.step(0):
            model(x).sum().backward()
    events = _events(cap)
    forward = [a for a in events if a[semconv.PHASE] == "forward"]
    backward = [a for a in events if a[semconv.PHASE] == "backward"]
    assert [a[semconv.COLL_OP] for a in forward] == ["all_to_all_single"] * len(log)
    assert any(len(set(splits)) > 1 for _, _, splits, _ in log), "splits must be uneven"
    for attrs, (_, _, sent, received) in zip(forward, log):
        assert attrs[semconv.OWNER_FQN] == "Block.moe"
        assert attrs[semconv.OWNER_SOURCE] == "position"
        assert attrs[semconv.COLL_INPUT_SPLITS] == sent
        assert attrs[semconv.COLL_OUTPUT_SPLITS] == received
        assert attrs[semconv.TENSOR_SHAPE] == [sum(sent), DIM]
    # the dispatch has an autograd backward: one all_to_all, splits reversed
    assert [a[semconv.COLL_OP] for a in backward] == ["all_to_all_single"]
    assert backward[0][semconv.OWNER_FQN] == "Block.moe"
    assert backward[0][semconv.COLL_INPUT_SPLITS] == log[0][3]
    counts = cap.aggregator.module_counts()
    assert counts["Block.moe"] == {"forward": {"all_to_all_single": 2},
                                   "backward": {"all_to_all_single": 1}}
    assert "Block.moe.experts" not in counts or not counts["Block.moe.experts"]
    assert cap.mode.stats()["internal_errors"] == 0


class AllGatherAttention(torch.nn.Module):
    """Each rank holds a slice of the sequence; K and V are all-gathered over it."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        group = dist.group.WORLD
        assert group is not None
        k_all = funcol.all_gather_single_autograd(k.contiguous(), 0, group)
        self.log.append(("attention", "all_gather_into_tensor"))
        v_all = funcol.all_gather_single_autograd(v.contiguous(), 0, group)
        self.log.append(("attention", "all_gather_into_tensor"))
        weights = torch.softmax(q @ k_all.transpose(0, 1) / DIM**0.5, dim=-1)
        return weights @ v_all


class RingAttention(torch.nn.Module):
    """K/V blocks go round the ring: send to the next rank, receive from the previous."""

    def __init__(self, log: list[tuple[str, str, int]]) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        rank = dist.get_rank()
        nxt, prev = (rank + 1) % WORLD, (rank - 1) % WORLD
        kv = torch.cat([k, v], dim=-1).detach().contiguous()
        out = torch.softmax(q @ k.transpose(0, 1), dim=-1) @ v
        for _ in range(WORLD - 1):
            incoming = torch.empty_like(kv)
            ops = [dist.P2POp(dist.isend, kv, nxt), dist.P2POp(dist.irecv, incoming, prev)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            self.log.extend([("ring", "send", nxt), ("ring", "recv", prev)])
            kv = incoming
            k_blk, v_blk = kv.chunk(2, dim=-1)
            out = out + torch.softmax(q @ k_blk.transpose(0, 1), dim=-1) @ v_blk
        return out


class CPModel(torch.nn.Module):
    def __init__(self, attention: torch.nn.Module) -> None:
        super().__init__()
        self.attention = attention
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attention(x))


def test_context_parallel_kv_all_gather_owned_by_attention(world: None) -> None:
    """The K and V all-gathers are the attention layer's in forward; their
    backward reduce-scatters are its too, in backward."""
    log: list[tuple[str, str]] = []
    model = CPModel(AllGatherAttention(log))
    with capture() as cap:
        with cap.mode.step(0):
            model(torch.randn(TOKENS, DIM)).sum().backward()
    events = _events(cap)
    forward = [a for a in events if a[semconv.PHASE] == "forward"]
    backward = [a for a in events if a[semconv.PHASE] == "backward"]
    assert Counter(a[semconv.COLL_OP] for a in forward) == Counter(op for _, op in log)
    assert all(a[semconv.OWNER_FQN] == "CPModel.attention" for a in forward + backward)
    # all_gather's backward is a reduce_scatter of the gradient, one per gather
    assert [a[semconv.COLL_OP] for a in backward] == ["reduce_scatter_tensor"] * len(log)
    assert all(a[semconv.TENSOR_SHAPE] == [TOKENS, DIM] for a in forward)
    assert cap.mode.stats()["internal_errors"] == 0


def test_context_parallel_ring_send_recv_owned_by_attention(world: None) -> None:
    """Each ring step's send and receive are the attention layer's, with the next
    and previous rank as peers, as the layer logged them."""
    log: list[tuple[str, str, int]] = []
    model = CPModel(RingAttention(log))
    with capture() as cap:
        with cap.mode.step(0):
            model(torch.randn(TOKENS, DIM))
    events = _events(cap)
    assert len(log) == 2 * (WORLD - 1)
    got = Counter((a[semconv.COLL_OP], a[semconv.COLL_PEER]) for a in events)
    assert got == Counter((op, peer) for _, op, peer in log)
    assert all(a[semconv.OWNER_FQN] == "CPModel.attention" for a in events)
    assert all(a[semconv.COLL_KIND] == "p2p" for a in events)
    assert cap.mode.stats()["internal_errors"] == 0


def test_a_rooted_collective_names_its_root_as_a_global_rank(world: None) -> None:
    """broadcast, reduce, gather and scatter take their root as a rank of their group
    (c10d maps the global src or dst the caller gave); the event names the global rank
    (``commspan.collective.root``), as a point-to-point op's peer: on the group of
    ranks 0, 2, 3, global rank 3 is the group's rank 2. Functional broadcast too."""
    group = dist.new_group([0, 2, 3])
    t = torch.ones(4)
    with capture() as cap:
        with cap.mode.step(0):
            dist.broadcast(t, src=3, group=group)
            dist.reduce(t, dst=2, group=group)
            dist.gather(t, [torch.empty(4) for _ in range(3)], dst=0, group=group)
            dist.scatter(t, None, src=3, group=group)
            funcol.broadcast(t, 1, dist.group.WORLD).wait()
            dist.all_reduce(t)
    got = [(a[semconv.COLL_OP], a.get(semconv.COLL_ROOT)) for a in _events(cap)]
    assert got == [("broadcast", 3), ("reduce", 2), ("gather", 0), ("scatter", 3),
                   ("broadcast", 1), ("all_reduce", None)]
