"""commspan.testing.fake_process_group, fake_mesh and the commspan_fake_pg fixture:
process groups for tests without torch's private imports."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from commspan.testing import fake_mesh, fake_process_group

pytest_plugins = ["pytester"]


def test_session_group_is_reused(fake_pg: None) -> None:
    """Inside an initialised fake group of the same size and rank, fake_process_group uses
    it and leaves it in place; another size or rank is refused, naming both."""
    with fake_process_group(world_size=4, rank=0) as pg:
        assert pg is dist.group.WORLD and pg.size() == 4
    assert dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"fake_process_group\(world_size=8, rank=0\): a "
                                           r"default process group is already initialised "
                                           r"\(backend 'fake', world size 4, rank 0\)"):
        with fake_process_group(world_size=8):
            pass
    assert dist.get_world_size() == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size=0 is not valid; pass an int >= 1"),
        ({"world_size": "4"}, "world_size='4' is not valid; pass an int >= 1"),
        ({"rank": -1}, "rank=-1 is not valid; pass an int >= 0"),
        ({"world_size": 4, "rank": 4}, "rank=4 is not valid for world_size=4; pass 0 <= rank < 4"),
    ],
)
def test_bad_sizes(kwargs: dict[str, object], message: str) -> None:
    """Sizes and ranks out of range are ValueErrors naming the argument and the rule."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with fake_process_group(**kwargs):  # type: ignore[arg-type]
            pass


def test_fake_mesh(fake_pg: None) -> None:
    """fake_mesh builds a named CPU mesh over the world; shapes must multiply to it."""
    mesh = fake_mesh((2, 2), names=("dp", "tp"))
    assert mesh.mesh_dim_names == ("dp", "tp") and tuple(mesh.shape) == (2, 2)
    assert mesh["tp"].size() == 2 and mesh.device_type == "cpu"
    assert fake_mesh(4).size() == 4
    with pytest.raises(ValueError, match=r"shape=\(2, 4\) is not valid: it holds 8 ranks, the "
                                         r"process group 4; pass sizes that multiply to 4"):
        fake_mesh((2, 4))
    with pytest.raises(ValueError, match=r"names=\('dp',\) is not valid for shape \(2, 2\)"):
        fake_mesh((2, 2), names=("dp",))
    with pytest.raises(ValueError, match=r"names=\('a', 'a'\) is not valid"):
        fake_mesh((2, 2), names=("a", "a"))
    with pytest.raises(ValueError, match=r"shape=\(0, 4\) is not valid; pass sizes >= 1"):
        fake_mesh((0, 4))


_INNER = """
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from commspan.testing import fake_mesh, fake_process_group


@pytest.mark.commspan_fake_pg(world_size=8, rank=3)
def test_marker_sizes_the_group(commspan_fake_pg, commspan_capture):
    assert (dist.get_world_size(), dist.get_rank()) == (8, 3)
    mesh = fake_mesh((2, 4), names=("dp", "tp"))
    x = funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", mesh["tp"].get_group()))
    assert commspan_capture.counts() == {"all_reduce": 1}


def test_group_is_gone_after_the_test():
    assert not dist.is_initialized()


def test_default_group(commspan_fake_pg):
    assert (commspan_fake_pg.size(), dist.get_rank()) == (4, 0)


def test_context_manager():
    with fake_process_group(world_size=2, rank=1):
        assert (dist.get_world_size(), dist.get_rank()) == (2, 1)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="no process group is initialised; enter "
                                           "commspan.testing.fake_process_group"):
        fake_mesh(4)
"""


def test_fixture_and_marker_in_a_fresh_process(pytester: pytest.Pytester) -> None:
    """In a process of its own (the fake world size differs from this session's): the
    marker sizes the group, the group is destroyed after the test, commspan counts a
    collective on a sub-mesh, and no test imports torch.testing._internal."""
    pytester.makepyfile(test_inner=_INNER)
    assert "_internal" not in _INNER
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=4)
