"""Golden files: commspan.testing.assert_matches_golden and pytest's --commspan-update-golden."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor.parallel import parallelize_module

from commspan.testing import CommCapture, assert_matches_golden, capture, golden_text
from commspan.testing.golden import update_golden

pytest_plugins = ["pytester"]

HEADER = [
    "# commspan golden file v1: collectives each module issued itself, per phase and op.",
    "# options: bytes=False placements=False",
    "# update: pytest --commspan-update-golden (or COMMSPAN_UPDATE_GOLDEN=1)",
]
# one forward+backward of the tensor-parallel MLP: the row-wise net2 all-reduces its
# output, the column-wise net1 all-reduces its input's gradient
LINES = [
    "MLPModule.net1 backward all_reduce count=1",
    "MLPModule.net2 forward all_reduce count=1",
]


@pytest.fixture()
def tp_cap(mesh: torch.distributed.device_mesh.DeviceMesh) -> CommCapture:
    """One forward+backward of the toy MLP (net1 column-wise, net2 row-wise) over 4 fake
    ranks, its input requiring grad."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from commspan.testing.models import MLPModule

    model = parallelize_module(MLPModule(), mesh, {"net1": ColwiseParallel(),
                                                   "net2": RowwiseParallel()})
    with capture() as cap:
        model(torch.ones(4, 10, requires_grad=True)).sum().backward()
    return cap


def test_golden_text_counts_per_module_phase_op(tp_cap: CommCapture) -> None:
    """The file: a header, then one line per module, phase and op with its count."""
    assert golden_text(tp_cap) == "\n".join([*HEADER, *LINES]) + "\n"


def test_golden_text_bytes_and_placements(tp_cap: CommCapture) -> None:
    """bytes=True adds bytes (4x10 float32 = 160 B); placements=True adds the
    redistribution and each DTensor parameter's shape and placements."""
    text = golden_text(tp_cap, bytes=True, placements=True)
    assert text.splitlines()[1] == "# options: bytes=True placements=True"
    assert text.splitlines()[3:] == [
        "MLPModule.net1 param weight 16x10 S(0)",
        "MLPModule.net1 param bias 16 S(0)",
        "MLPModule.net1 backward all_reduce count=1 bytes=160 placements=P(sum)->R",
        "MLPModule.net2 param weight 10x16 S(1)",
        "MLPModule.net2 param bias 10 R",
        "MLPModule.net2 forward all_reduce count=1 bytes=160 placements=P(sum)->R",
    ]


def test_groups_name_the_mesh_dimension_so_another_one_differs(
    fake_pg: None, tmp_path: Path
) -> None:
    """groups=True adds, per module, phase and op, the mesh dimension the collectives
    ran on: the same MLP made tensor parallel over a 2x2 mesh's ``rows`` dimension
    instead of ``cols`` has the same counts, bytes and placements, and fails against
    the ``cols`` file. (Dimension names of its own: torch caches DTensor state per
    mesh, and another test's ("dp", "tp") mesh on the same fake process group would
    get this one's process groups.)"""
    from torch.distributed.device_mesh import init_device_mesh

    from commspan.testing.models import MLPModule, parallelize_mlp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rows", "cols"))
    caps = {}
    for dim in ("cols", "rows"):
        model = parallelize_mlp(MLPModule(), mesh[dim])
        with capture() as caps[dim]:
            model(torch.ones(4, 10, requires_grad=True)).sum().backward()
    plain = {dim: golden_text(cap, bytes=True, placements=True) for dim, cap in caps.items()}
    assert plain["cols"] == plain["rows"]  # what the file held before groups=
    text = golden_text(caps["cols"], groups=True)
    assert text.splitlines()[1] == "# options: bytes=False placements=False groups=True"
    assert text.splitlines()[3:] == [
        LINES[0], "MLPModule.net1 backward all_reduce group=cols count=1",
        LINES[1], "MLPModule.net2 forward all_reduce group=cols count=1",
    ]
    path = tmp_path / "mlp.txt"
    path.write_text(text)
    with pytest.raises(AssertionError,
                       match=r"\+MLPModule.net2 forward all_reduce group=rows"):
        assert_matches_golden(caps["rows"], path, groups=True)


def test_groups_outside_a_mesh_are_named_by_their_ranks(fake_pg: None) -> None:
    """A process group outside every mesh is written by its global ranks (as torch's
    get_process_group_ranks gives them), so the text is the same whatever groups the
    process made before; torch's name for it (a number in creation order) made it
    ``group=group 5`` run alone and ``group=group 8`` after another test's groups.
    Two groups of the same ranks share a line, their counts summed."""
    import torch.distributed as dist

    class Sync(torch.nn.Module):
        def forward(self, x: torch.Tensor, *groups: Any) -> torch.Tensor:
            for group in groups:
                dist.all_reduce(x, group=group)
            return x

    texts = []
    for earlier in (0, 3):
        for _ in range(earlier):  # another test's groups, made before this one's
            dist.new_group([0, 1, 2])
        pair, again, evens = dist.new_group([0, 1]), dist.new_group([0, 1]), dist.new_group(
            [0, 2])
        with capture() as cap:
            Sync()(torch.ones(2), pair, again, evens, dist.group.WORLD)
        texts.append(golden_text(cap, groups=True))
    assert texts[0] == texts[1]
    assert [dist.get_process_group_ranks(g) for g in (pair, evens, dist.group.WORLD)] == [
        [0, 1], [0, 2], [0, 1, 2, 3]]
    assert texts[0].splitlines()[3:] == [
        "Sync forward all_reduce count=4",
        "Sync forward all_reduce group=ranks 0,2 count=1",
        "Sync forward all_reduce group=ranks 0-1 count=2",
        "Sync forward all_reduce group=ranks 0-3 count=1",
    ]


def test_a_file_without_its_last_newline_still_matches(
    tp_cap: CommCapture, tmp_path: Path
) -> None:
    """An editor that drops the final newline does not make the file differ."""
    path = tmp_path / "mlp.txt"
    path.write_text(golden_text(tp_cap).rstrip("\n"))
    assert_matches_golden(tp_cap, path)


def test_lines_sort_numbers_as_numbers() -> None:
    """`layers.2` comes before `layers.10`; a model without collectives says so."""
    from commspan.analysis.issued import natural_key

    names = ["m.layers.10.w", "m.layers.2.w", "m.layers.2"]
    assert sorted(names, key=natural_key) == ["m.layers.2", "m.layers.2.w", "m.layers.10.w"]
    with capture() as cap:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert golden_text(cap).splitlines()[3:] == ["# (no collectives)"]


def test_matching_file_passes(tp_cap: CommCapture, tmp_path: Path) -> None:
    """A file holding exactly the recorded text passes (CRLF line ends too)."""
    path = tmp_path / "mlp.txt"
    path.write_text(golden_text(tp_cap))
    assert_matches_golden(tp_cap, path)
    path.write_bytes(golden_text(tp_cap).replace("\n", "\r\n").encode())
    assert_matches_golden(tp_cap, str(path))


def test_difference_is_a_unified_diff(tp_cap: CommCapture, tmp_path: Path) -> None:
    """A changed count fails with a unified diff, golden file first, and says how to accept."""
    path = tmp_path / "mlp.txt"
    path.write_text("\n".join([*HEADER, LINES[0], "MLPModule.net2 forward all_reduce count=2"])
                    + "\n")
    with pytest.raises(AssertionError) as info:
        assert_matches_golden(tp_cap, path)
    message = str(info.value)
    assert message.splitlines()[0] == (
        f"the recorded collectives differ from golden file {str(path)!r}; if the change is "
        "intended, run `pytest --commspan-update-golden` and review the file's diff")
    assert f"--- {path} (golden)\n+++ recorded\n" in message
    assert ("\n-MLPModule.net2 forward all_reduce count=2\n"
            "+MLPModule.net2 forward all_reduce count=1") in message
    assert f" {LINES[0]}\n" in message  # context line


def test_other_options_are_named(tp_cap: CommCapture, tmp_path: Path) -> None:
    """A file written with other options says which, beside the diff."""
    path = tmp_path / "mlp.txt"
    path.write_text(golden_text(tp_cap, bytes=True))
    with pytest.raises(AssertionError, match=r"\(the file was written with bytes=True "
                                             r"placements=False; this call uses bytes=False "
                                             r"placements=False\)"):
        assert_matches_golden(tp_cap, path)


def test_missing_file_says_how_to_create_it(tp_cap: CommCapture, tmp_path: Path) -> None:
    """No file: the message names the option that writes it and shows what it would hold."""
    path = tmp_path / "none.txt"
    with pytest.raises(AssertionError) as info:
        assert_matches_golden(tp_cap, path)
    message = str(info.value)
    assert message.startswith(f"golden file {str(path)!r} does not exist; create it by running "
                              "the test with `pytest --commspan-update-golden`")
    assert message.endswith(golden_text(tp_cap))
    assert not path.exists()


def test_update_mode_writes_only_changes(
    tp_cap: CommCapture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In update mode files are created (directories too) or rewritten, and pass; an equal
    file is left alone. COMMSPAN_UPDATE_GOLDEN=1 does the same."""
    path = tmp_path / "golden" / "mlp.txt"
    with update_golden() as written:
        assert_matches_golden(tp_cap, path)
        assert_matches_golden(tp_cap, path)
    assert written == [path]
    assert path.read_text() == golden_text(tp_cap)
    stale = golden_text(tp_cap).replace(" count=", " count=9")  # (an older golden file)
    assert stale != golden_text(tp_cap)
    path.write_text(stale)
    monkeypatch.setenv("COMMSPAN_UPDATE_GOLDEN", "1")
    assert_matches_golden(tp_cap, path)
    assert path.read_text() == golden_text(tp_cap)
    monkeypatch.setenv("COMMSPAN_UPDATE_GOLDEN", "0")
    path.write_text(stale)
    with pytest.raises(AssertionError):
        assert_matches_golden(tp_cap, path)


def test_update_mode_refuses_one_file_given_two_texts(
    tp_cap: CommCapture, tmp_path: Path
) -> None:
    """Two tests (or parameters) sharing one golden file with different texts: updating
    used to write both in turn, report it twice and leave the next run failing. The
    second is refused with both texts; a second call with the same text is fine."""
    path = tmp_path / "shared.txt"
    with update_golden() as written:
        assert_matches_golden(tp_cap, path)
        assert_matches_golden(tp_cap, path)
        with pytest.raises(AssertionError, match="was given another text earlier in this run"):
            assert_matches_golden(tp_cap, path, bytes=True)
    assert written == [path] and path.read_text() == golden_text(tp_cap)
    with update_golden():  # a new run starts afresh
        assert_matches_golden(tp_cap, path, bytes=True)
    assert path.read_text() == golden_text(tp_cap, bytes=True)


def test_subtree_and_misspelt_module(tp_cap: CommCapture, tmp_path: Path) -> None:
    """fqn= keeps one module's subtree; a name that never ran is a ValueError naming the
    closest names."""
    assert golden_text(tp_cap, fqn="MLPModule.net2").splitlines()[3:] == [LINES[1]]
    assert golden_text(tp_cap, fqn="MLPModule").splitlines()[3:] == LINES
    with pytest.raises(ValueError, match=r"fqn='MLPModule.net_2' is not valid: no module "
                                         r"named 'MLPModule.net_2' ran; did you mean "
                                         r"'MLPModule.net2'"):
        assert_matches_golden(tp_cap, tmp_path / "x.txt", fqn="MLPModule.net_2")
    with pytest.raises(TypeError, match="path=3 is not valid"):
        assert_matches_golden(tp_cap, 3)  # type: ignore[arg-type]


_GOLDEN_TEST = """
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from pathlib import Path
from commspan.testing import assert_matches_golden

GOLDEN = Path(__file__).parent / "golden" / "reduce.txt"
N = {n}

class Reduce(torch.nn.Module):
    def forward(self, x):
        for _ in range(N):
            x = funcol.wait_tensor(funcol.all_reduce(x, "sum", group=dist.group.WORLD))
        return x

def test_reduce(commspan_fake_pg, commspan_capture):
    Reduce()(torch.ones(2))
    assert_matches_golden(commspan_capture, GOLDEN)
"""


def test_pytest_option_writes_then_compares(pytester: pytest.Pytester, fake_pg: None) -> None:
    """--commspan-update-golden writes the file and lists it at the end; without it the same
    test passes, and fails with the diff once the model issues one more collective."""
    pytester.makepyfile(test_golden=_GOLDEN_TEST.format(n=1))
    first = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--commspan-update-golden")
    first.assert_outcomes(passed=1)
    golden = pytester.path / "golden" / "reduce.txt"
    assert golden.read_text().splitlines()[3:] == ["Reduce forward all_reduce count=1"]
    first.stdout.fnmatch_lines(["*commspan: wrote 1 golden file:*", f"*{golden}*"])
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    pytester.makepyfile(test_golden=_GOLDEN_TEST.format(n=2))
    failed = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*-Reduce forward all_reduce count=1",
                                 "*+Reduce forward all_reduce count=2"])


def test_collectives_outside_every_module_are_in_the_text_while_capturing(
    fake_pg: None,
) -> None:
    """Inside the capture the rank span is still open: what it holds (a collective
    outside every module) is in the golden text and in assert_placements there, as
    in the counts, not only once the capture has ended."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from commspan.testing import assert_placements, fake_mesh

    with capture() as cap:
        distribute_tensor(torch.ones(8, 4), fake_mesh(4), [Shard(0)]).sum().full_tensor()
        inside = golden_text(cap)
        assert "Global forward all_reduce count=1" in inside.splitlines()
        assert_placements(cap, "Global", "all_reduce", "P(sum)", "R", phase="forward")
    assert golden_text(cap) == inside


def test_golden_text_with_groups_and_placements_is_whole_while_capturing(
    fake_pg: None,
) -> None:
    """Inside the capture (the README's pytest pattern), a collective on the open rank
    span and a module span that waits for its collective's completion have their
    mesh-dimension (``group=``) and parameter lines, as after the capture: they had
    count lines only (mesh_dim_counts and parameters read finished spans)."""
    import torch.distributed as dist

    from commspan.testing import fake_mesh
    from commspan.testing.models import MLP, parallelize_mlp

    model = parallelize_mlp(MLP(), fake_mesh(4))
    with capture() as cap:
        dist.all_reduce(torch.ones(2))  # outside every module: on the open rank span
        y = model(torch.randn(2, 8))  # net2's all_reduce, not waited yet: net2 waits
        inside = golden_text(cap, groups=True, placements=True)
        y.sum()
    after = golden_text(cap, groups=True, placements=True)
    assert any(line.startswith("Global forward all_reduce group=") for line in
               after.splitlines())
    assert any("param" in line for line in after.splitlines() if "net2" in line)
    assert inside == after


@pytest.mark.parametrize("value", ["false", "0", "no", "off", ""])
def test_update_variable_off_values_do_not_rewrite(
    tp_cap: CommCapture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    path = tmp_path / "g.txt"
    path.write_text("# tampered\n")
    monkeypatch.setenv("COMMSPAN_UPDATE_GOLDEN", value)
    with pytest.raises(AssertionError):
        assert_matches_golden(tp_cap, path)
    assert path.read_text() == "# tampered\n"


@pytest.mark.parametrize("value", ["n", "2", "upd"])
def test_update_variable_with_another_value_is_refused(
    tp_cap: CommCapture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """A value that is neither on nor off (a typo) is an error naming the variable; it
    rewrote the file and passed, a test that could not fail."""
    path = tmp_path / "g.txt"
    path.write_text("# tampered\n")
    monkeypatch.setenv("COMMSPAN_UPDATE_GOLDEN", value)
    with pytest.raises(ValueError, match=f"COMMSPAN_UPDATE_GOLDEN='{value}' is not valid"):
        assert_matches_golden(tp_cap, path)
    assert path.read_text() == "# tampered\n"


def test_module_names_that_differ_only_in_zeros_keep_their_lines() -> None:
    """ModuleDict keys "1" and "01" (and a name with a superscript digit) sort apart:
    the golden text kept one line of the two and dropped the other's count, and "²"
    raised ValueError."""
    from commspan.analysis.issued import natural_key

    names = ["Net.d.01", "Net.d.1", "Net.d.²", "Net.d.10", "Net.d.2"]
    assert len({natural_key(n) for n in names}) == len(names)
    assert sorted(names, key=natural_key) == [
        "Net.d.01", "Net.d.1", "Net.d.2", "Net.d.10", "Net.d.²"]


def test_a_module_name_with_a_line_break_round_trips(
    tmp_path: Path, fake_pg: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ModuleDict keys holding \\r, \\n and a tab: the file written in update mode
    matches on the next run (a \\r read back as a line end and it never matched), one
    line per module that issued a collective (the tab's written as it is, as
    before), and a change in one of them still differs."""
    import torch.distributed as dist

    keys = ["a\rb", "c\nd", "tab\there"]

    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.d = torch.nn.ModuleDict({k: Block() for k in keys})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for m in self.d.values():
                x = m(x)
            return x

    net = Net()
    with capture() as cap:
        net(torch.ones(2))
    path = tmp_path / "golden.txt"
    monkeypatch.setenv("COMMSPAN_UPDATE_GOLDEN", "1")
    assert_matches_golden(cap, path)
    monkeypatch.setenv("COMMSPAN_UPDATE_GOLDEN", "0")
    assert_matches_golden(cap, path)
    body = [ln for ln in path.read_text(encoding="utf-8").splitlines() if not ln.startswith("#")]
    assert len(body) == len(keys)
    assert sum(ln.startswith("Net.d.tab\there ") for ln in body) == 1  # as files before
    with capture() as more:
        net(torch.ones(2))
        net.d["c\nd"](torch.ones(2))
    with pytest.raises(AssertionError, match="count=2"):
        assert_matches_golden(more, path)


@pytest.mark.parametrize("update", [False, True])
def test_a_capture_that_recorded_nothing_is_refused(
    update: bool, tmp_path: Path, fake_pg: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mode never entered (the commspan_mode fixture without ``with``) and a capture
    whose rank ``ranks=`` leaves out recorded nothing: comparing would pass on a file of
    "(no collectives)", and an update would write one; both are refused, the file left
    unwritten."""
    import torch.distributed as dist

    from commspan.testing import fresh_mode

    class Sync(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x

    empty = tmp_path / "empty.txt"
    with capture() as nothing:
        pass
    empty.write_text(golden_text(nothing))
    if update:
        monkeypatch.setenv("COMMSPAN_UPDATE_GOLDEN", "1")
    with fresh_mode() as mode:
        Sync()(torch.ones(2))  # forgot `with mode:`
        with pytest.raises(AssertionError, match=r"golden file '.*empty\.txt': this "
                           r"CommSpanMode was never entered"):
            assert_matches_golden(mode, empty)
    with capture(ranks=[1]) as untraced:
        Sync()(torch.ones(2))
    with pytest.raises(AssertionError, match=r"golden file '.*new\.txt': this rank \(0\) is "
                       r"not traced"):
        assert_matches_golden(untraced, tmp_path / "new.txt")
    assert not (tmp_path / "new.txt").exists()


def test_update_variable_serves_each_pytest_session_of_a_process(
    pytester: pytest.Pytester, fake_pg: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With COMMSPAN_UPDATE_GOLDEN=1, pytest run again in one process (an IDE, a
    notebook) after the model changed rewrites the file: the text the first run gave it
    is not taken for a second test sharing the file."""
    monkeypatch.setenv("COMMSPAN_UPDATE_GOLDEN", "1")
    golden = pytester.path / "golden" / "reduce.txt"
    for n in (1, 2):
        pytester.makepyfile(test_golden=_GOLDEN_TEST.format(n=n))
        pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
        assert golden.read_text().splitlines()[3:] == [f"Reduce forward all_reduce count={n}"]
    pytester.makepyfile(test_golden=_GOLDEN_TEST.format(n=2) + """
def test_reduce_once(commspan_fake_pg, commspan_capture):
    Reduce()(torch.ones(2))
    torch.distributed.all_reduce(torch.ones(2))  # one more, outside the module
    assert_matches_golden(commspan_capture, GOLDEN)
""")
    shared = pytester.runpytest_inprocess("-p", "no:cacheprovider")  # (two tests, one file)
    shared.assert_outcomes(passed=1, failed=1)
    shared.stdout.fnmatch_lines(["*was given another text earlier in this run*"])


@pytest.mark.parametrize("update", [False, True])
def test_a_golden_file_that_is_not_text_is_named_or_rewritten(
    update: bool, tp_cap: CommCapture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A golden file that is not UTF-8 (saved as UTF-16, damaged) fails naming the file,
    its line and the fix, instead of a UnicodeDecodeError naming neither; update mode
    rewrites it (it raised there too). A directory for path is a ValueError naming it."""
    path = tmp_path / "g.txt"
    path.write_bytes("\n".join([*HEADER, *LINES]).encode("utf-8").replace(b"net2", b"net\xb2"))
    if update:
        monkeypatch.setenv("COMMSPAN_UPDATE_GOLDEN", "1")
        assert_matches_golden(tp_cap, path)
        assert path.read_text(encoding="utf-8") == golden_text(tp_cap)
    else:
        with pytest.raises(AssertionError, match=r"golden file '.*g\.txt': line 5 \(byte \d+\) "
                           r"is not UTF-8 text .*--commspan-update-golden"):
            assert_matches_golden(tp_cap, path)
    with pytest.raises(ValueError, match=r"path='.*' is not valid: it is a directory"):
        assert_matches_golden(tp_cap, tmp_path)


@pytest.mark.parametrize("update", [False, True])
def test_a_path_to_a_file_that_is_no_golden_file_is_refused_and_kept(
    update: bool, tp_cap: CommCapture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """path naming a JSONL rank file or a test's source by mistake: the comparison showed
    a diff and said to run update mode, which then overwrote the file; both modes now
    refuse it naming the path and its first line, and leave it as it was. An empty file
    and a golden file saved as UTF-16 are still golden files (rewritten in update mode)."""
    if update:
        monkeypatch.setenv("COMMSPAN_UPDATE_GOLDEN", "1")
    source = tmp_path / "test_model.py"
    source.write_text("import torch\n\ndef test_x():\n    pass\n")
    rank_file = tmp_path / "commspan-rank0.jsonl"
    rank_file.write_text('{"resourceSpans":[]}\n')
    for path, first in ((source, "import torch"), (rank_file, '{"resourceSpans":[]}')):
        before = path.read_bytes()
        with pytest.raises(ValueError, match=re.escape(
                f"path={str(path)!r} is not valid: it is not a commspan golden file (its "
                f"first line, {first!r}, does not start with '# commspan golden file'), and "
                "update mode would overwrite it")):
            assert_matches_golden(tp_cap, path)
        assert path.read_bytes() == before
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    utf16 = tmp_path / "utf16.txt"
    utf16.write_text(golden_text(tp_cap), encoding="utf-16")
    for path in (empty, utf16):
        if update:
            assert_matches_golden(tp_cap, path)
            assert path.read_text(encoding="utf-8") == golden_text(tp_cap)
        else:
            with pytest.raises(AssertionError, match=re.escape(f"golden file {str(path)!r}")):
                assert_matches_golden(tp_cap, path)
