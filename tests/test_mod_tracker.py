"""The reference ModTracker tests, on commspan's compat ModTracker."""

from __future__ import annotations

from copy import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from commspan.compat import ModTracker


class _Foo(torch.nn.Module):
    def __init__(self, seen_fw: list, seen_bw: list, tracker_ref: list) -> None:
        super().__init__()
        self._seen_fw, self._seen_bw, self._tracker = seen_fw, seen_bw, tracker_ref

    def forward(self, x: dict) -> dict:
        tracker = self._tracker[0]
        x = x["a"].relu_()
        self._seen_fw.append((copy(tracker.parents), tracker.is_bw))
        x.register_hook(lambda grad: self._seen_bw.append((copy(tracker.parents), tracker.is_bw)))
        return {"a": torch.mm(x, x)}


def test_module_hierarchy() -> None:
    """Parents seen inside forward and inside backward hooks match the module nesting."""
    seen_fw: list = []
    seen_bw: list = []
    ref: list = []

    class Mod(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = _Foo(seen_fw, seen_bw, ref)
            self.b = torch.nn.ModuleDict({"nest": _Foo(seen_fw, seen_bw, ref)})
            self.c = torch.nn.ModuleList([_Foo(seen_fw, seen_bw, ref)])

        def forward(self, x: dict) -> dict:
            x = self.c[0](x)
            return self.b["nest"](self.a(x))

    mod = Mod()
    with ModTracker() as tracker:
        ref.append(tracker)
        mod({"a": torch.randn(10, 10, requires_grad=True).clone()})["a"].sum().backward()
        mod({"a": torch.randn(10, 10, requires_grad=True).clone()})["a"].sum().backward()

    assert seen_fw == [
        ({"Global", "Mod", "Mod.c.0"}, False),
        ({"Global", "Mod", "Mod.a"}, False),
        ({"Global", "Mod", "Mod.b.nest"}, False),
    ] * 2
    assert seen_bw == [
        ({"Global", "Mod", "Mod.b.nest"}, True),
        ({"Global", "Mod", "Mod.a"}, True),
        ({"Global", "Mod", "Mod.c.0"}, True),
    ] * 2


def test_bw_detection() -> None:
    """After backward, the tracker is back to Global and not in backward."""
    mod = torch.nn.Linear(2, 2)
    with ModTracker() as tracker:
        mod(torch.rand(2, requires_grad=True)).sum().backward()
        assert not tracker.is_bw
        assert tracker.parents == {"Global"}


class _Bar(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.foo = torch.nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.foo(x).relu_()


def test_user_hooks() -> None:
    """User hooks fire in the reference order, also when the module is deleted before backward."""
    mt = ModTracker()
    test_op: list = []

    def hook(mod: torch.nn.Module | None, hook_name: str) -> None:
        mfqn = mt.get_known_fqn(mod) if mod is not None else None
        test_op.append((hook_name, mfqn, mfqn in mt.parents, mt.is_bw))

    mod = _Bar()
    mt.register_user_hooks(
        lambda m, inp: hook(m, "pre_fw"),
        lambda m, inp, op: hook(m, "post_fw"),
        lambda m, gop: hook(m, "pre_bw"),
        lambda m, ginp: hook(m, "post_bw"),
    )
    with mt:
        mod(torch.rand(10, 10, requires_grad=True)).sum().backward()
    assert test_op == [
        ("pre_fw", "_Bar", True, False),
        ("pre_fw", "_Bar.foo", True, False),
        ("post_fw", "_Bar.foo", True, False),
        ("post_fw", "_Bar", True, False),
        ("pre_bw", "_Bar", True, True),
        ("pre_bw", "_Bar.foo", True, True),
        ("post_bw", "_Bar", True, True),
        ("post_bw", "_Bar.foo", True, True),
    ]

    with pytest.raises(AssertionError):
        mt.register_user_hooks(lambda x, y: x, None, None, None)

    test_op.clear()
    with mt:
        loss = mod(torch.rand(10, 10, requires_grad=True)).sum()
        del mod
        loss.backward()
    assert test_op == [
        ("pre_fw", "_Bar", True, False),
        ("pre_fw", "_Bar.foo", True, False),
        ("post_fw", "_Bar.foo", True, False),
        ("post_fw", "_Bar", True, False),
        ("pre_bw", None, False, True),
        ("pre_bw", None, False, True),
        ("post_bw", None, False, True),
        ("post_bw", None, False, True),
    ]


class _Stack(torch.nn.Module):
    def __init__(self, n_layers: int, dim: int, use_ac: bool, reentrant: bool) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(n_layers))
        self.use_ac, self.reentrant = use_ac, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.linears):
            if i >= 1 and self.use_ac:
                x = checkpoint(block, x, preserve_rng_state=True, use_reentrant=self.reentrant)
            else:
                x = block(x)
            x = torch.nn.functional.relu(x)
        return x


def test_ac() -> None:
    """Activation checkpointing: the recompute forward runs inside the block's backward."""
    test_op: list = []
    mt = ModTracker()

    def hook(mod: torch.nn.Module | None, name: str) -> None:
        mfqn = mt.get_known_fqn(mod) if mod is not None else None
        test_op.append((name, mfqn, mfqn in mt.parents, mt.is_bw))

    mt.register_user_hooks(
        lambda m, i: hook(m, "pre_fw"),
        lambda m, i, o: hook(m, "post_fw"),
        lambda m, go: hook(m, "pre_bw"),
        lambda m, gi: hook(m, "post_bw"),
    )
    model = _Stack(2, 8, True, reentrant=False)
    with mt:
        model(torch.randn(2, 8)).sum().backward()
    expected = [
        ("pre_fw", "_Stack", True, False),
        ("pre_fw", "_Stack.linears.0", True, False),
        ("post_fw", "_Stack.linears.0", True, False),
        ("pre_fw", "_Stack.linears.1", True, False),
        ("post_fw", "_Stack.linears.1", True, False),
        ("post_fw", "_Stack", True, False),
        ("pre_bw", "_Stack", True, True),
        ("pre_bw", "_Stack.linears.1", True, True),
        ("pre_fw", "_Stack.linears.1", True, True),
        ("post_fw", "_Stack.linears.1", True, True),
        ("post_bw", "_Stack.linears.1", True, True),
        ("pre_bw", "_Stack.linears.0", True, True),
    ]
    # torch 2.13 also reports post_bw at the end of backward for modules whose
    # inputs need no grad; the reference list stops before those.
    assert test_op[: len(expected)] == expected
    assert test_op[len(expected):] == [
        ("post_bw", "_Stack.linears.0", True, True),
        ("post_bw", "_Stack", True, True),
    ]


@pytest.mark.parametrize("make", [
    lambda: torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3))),
    lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)),
], ids=["back-to-back", "op-between"])
def test_module_is_in_parents_when_its_hooks_run(make) -> None:
    """torch's ModTracker promises a module's name is in ``parents`` whenever its
    hooks run; checked on torch's class (the reference) and on the compat one,
    which must also call each hook for the same modules. In a plain Sequential
    one layer's input gradient is the next layer's output gradient: the same
    autograd node ends one backward and starts the next."""
    from torch.distributed._tools.mod_tracker import ModTracker as TorchModTracker

    def run(cls: type) -> tuple[list, list]:
        tracker = cls()
        bad: list = []
        seen: list = []

        def hook(event: str):
            def check(module: torch.nn.Module, *_: object) -> None:
                name = tracker.get_known_fqn(module)
                seen.append((event, name))
                if name not in tracker.parents:
                    bad.append((event, name, sorted(tracker.parents)))
            return check

        tracker.register_user_hooks(hook("pre_fw"), hook("post_fw"), hook("pre_bw"),
                                    hook("post_bw"))
        torch.manual_seed(0)
        model = make()
        with tracker:
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        return bad, sorted(seen)

    reference_bad, reference_seen = run(TorchModTracker)
    bad, seen = run(ModTracker)
    assert reference_bad == []
    assert bad == []
    assert seen == reference_seen


def test_every_module_whose_backward_ran_gets_post_bw_as_in_torch() -> None:
    """``Sequential(Linear, Identity, Linear)``: the Identity hands its input back (its
    backward starts from no output of its own) and still gets ``post_bw`` when its input
    gradient arrives, as under torch's ModTracker."""
    from torch.distributed._tools.mod_tracker import ModTracker as TorchModTracker

    def post_bw(cls: type) -> list[str]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 4), torch.nn.Identity(), torch.nn.Linear(4, 4))
        seen: list[str] = []
        tracker = cls()
        tracker.register_user_hooks(post_bw_hook=lambda m, g: seen.append(type(m).__name__))
        with tracker:
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        return sorted(seen)

    assert post_bw(ModTracker) == post_bw(TorchModTracker) == [
        "Identity", "Linear", "Linear", "Sequential"]


def test_pre_bw_sees_the_gradient_a_modules_backward_pre_hook_passed_on() -> None:
    """A module with backward hooks of its own, one of which doubles its output
    gradient: ``pre_bw`` hears of its backward with the gradient its hooks passed on,
    as under torch's ModTracker (the reference), for every module, in the same order."""
    from torch.distributed._tools.mod_tracker import ModTracker as TorchModTracker

    def pre_bw(cls: type) -> list[tuple[str, list[float]]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        model[2].register_full_backward_pre_hook(lambda m, go: (go[0] * 2,))
        model[1].register_full_backward_hook(lambda m, gi, go: None)
        tracker = cls()
        seen: list[tuple[str, list[float]]] = []
        tracker.register_user_hooks(pre_bw_hook=lambda m, go: seen.append(
            (tracker.get_known_fqn(m), [float(g.sum()) for g in go if g is not None])))
        with tracker:
            for _ in range(2):
                model(torch.ones(3, 4, requires_grad=True)).sum().backward()
        return seen

    ours, torch_s = pre_bw(ModTracker), pre_bw(TorchModTracker)
    assert ours == torch_s
    assert ("Sequential.2", [24.0]) in torch_s  # (the doubled gradient: 12 ones, x 2)


@pytest.mark.parametrize("kind", ["pre_fw_hook", "post_fw_hook", "pre_bw_hook", "post_bw_hook"])
def test_a_user_hook_that_raises_raises_into_the_step_as_with_torch(kind: str) -> None:
    """An assertion inside a user hook fails the step, as torch's ModTracker does (it
    used to be counted as an internal error of commspan and swallowed: a test
    asserting inside a hook could not fail); the tracker is usable afterwards."""
    from torch.distributed._tools.mod_tracker import ModTracker as TorchModTracker

    def check(*_args: object) -> None:
        raise AssertionError("checked inside the hook")

    outcomes = []
    for cls in (TorchModTracker, ModTracker):
        tracker = cls()
        tracker.register_user_hooks(**{kind: check})
        with pytest.raises(AssertionError, match="checked inside the hook"):
            with tracker:
                torch.nn.Linear(2, 2)(torch.ones(1, 2, requires_grad=True)).sum().backward()
        outcomes.append(cls)
    assert len(outcomes) == 2
    seen: list[str] = []
    again = ModTracker()
    again.register_user_hooks(pre_fw_hook=lambda m, _a: seen.append(type(m).__name__))
    with again:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert seen == ["Linear"]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_new_context_names_modules_afresh() -> None:
    """One tracker, two contexts: the first calls only the child ``m.a``, the second
    the whole model. torch's tracker names the child ``_Block.a`` in the second (and
    keeps its children's ``Sequential.0``); compat kept ``Sequential`` for the child
    too. Now each context names modules as a fresh tracker does: the modules torch
    renames have torch's names, their children a fresh tracker's."""
    from torch.distributed._tools.mod_tracker import ModTracker as TorchModTracker

    def names(cls: type, first: bool) -> list[tuple[list[str | None], list[str | None]]]:
        model, tracker = _Block(), cls()
        fw: list[str | None] = []
        bw: list[str | None] = []
        tracker.register_user_hooks(
            pre_fw_hook=lambda m, i: fw.append(tracker.get_known_fqn(m)),
            pre_bw_hook=lambda m, g: bw.append(tracker.get_known_fqn(m)))
        out = []
        for whole in ([False, True] if first else [True]):
            with tracker:
                (model if whole else model.a)(torch.rand(2, 4, requires_grad=True)).sum().backward()
            out.append((fw[:], sorted(bw)))  # (pre_bw's order differs, docs/compat.md)
            fw.clear()
            bw.clear()
        return out

    ours, by_torch = names(ModTracker, True), names(TorchModTracker, True)
    assert ours[0] == by_torch[0]  # the first context: Sequential, Sequential.0, ...
    assert ours[1] == names(ModTracker, False)[0]
    assert ours[1][0] == ["_Block", "_Block.a", "_Block.a.0", "_Block.a.1", "_Block.b"]
    assert by_torch[1][0] == ["_Block", "_Block.a", "Sequential.0", "Sequential.1", "_Block.b"]
    renamed = [[n.replace("Sequential.", "_Block.a.") for n in ns] for ns in by_torch[1]]
    assert [renamed[0], sorted(renamed[1])] == list(ours[1])
