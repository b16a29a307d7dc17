"""Golden files: a model's communication, written down once and compared in every test run.

:func:`assert_matches_golden` turns what a capture recorded into a stable,
reviewable text file — one line per module, phase and op, with the count of
collectives the module issued itself (optionally their bytes and DTensor
placements, and its parameters' placements) — and compares it with the file
kept next to the test. A change in a model's communication then fails the
test with a unified diff, and the updated file shows the change in review.

Run pytest with ``--commspan-update-golden`` (the option of commspan's pytest
plugin) to write or rewrite the files instead of comparing; outside pytest,
set ``COMMSPAN_UPDATE_GOLDEN=1``.

The file::

    # commspan golden file v1: collectives each module issued itself, per phase and op.
    # options: bytes=False placements=False
    # update: pytest --commspan-update-golden (or COMMSPAN_UPDATE_GOLDEN=1)
    MLP.net2 forward all_reduce count=1

A module or parameter name holding a line break (a ``ModuleDict`` key with
``\\r`` or ``\\n``, which would end or split its line) is written as its Python
literal (``'a\\rb'``).

Lines are sorted by module name (numbers in names sort as numbers:
``layers.2`` before ``layers.10``), then phase (forward, backward,
recompute) and op; counts are summed over everything the capture recorded.
Only modules that issued collectives have lines (with ``placements=True``
also every module with DTensor parameters).

Example:
    >>> import torch, pathlib, tempfile
    >>> from commspan.testing import assert_matches_golden, capture, golden_text
    >>> with capture() as cap:
    ...     _ = torch.nn.Linear(2, 2)(torch.ones(1, 2))
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "linear.txt"
    >>> _ = path.write_text(golden_text(cap))
    >>> assert_matches_golden(cap, path)
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from commspan import semconv
from commspan.analysis.issued import natural_key

__all__ = ["UPDATE_ENV", "assert_matches_golden", "golden_text", "update_golden"]

UPDATE_ENV = "COMMSPAN_UPDATE_GOLDEN"
"""Environment variable: ``1`` makes :func:`assert_matches_golden` (re)write the files."""

_VERSION_LINE = (
    "# commspan golden file v1: collectives each module issued itself, per phase and op."
)
_UPDATE_LINE = "# update: pytest --commspan-update-golden (or COMMSPAN_UPDATE_GOLDEN=1)"
_PHASES = {p.value: n for n, p in enumerate(semconv.Phase)}

_written: list[Path] | None = None  # inside update_golden(): the files written so far
# in update mode: the text each golden file was given in this run (two calls giving one
# file two texts would leave it holding the last, and the next run failing on the other)
_given: dict[Path, str] = {}


@contextmanager
def update_golden() -> Iterator[list[Path]]:
    """Within the block, :func:`assert_matches_golden` writes files instead of comparing.

    The pytest plugin enters it for the whole session when pytest runs with
    ``--commspan-update-golden``; the previous setting is restored on exit.

    Yields:
        The list of golden files written (created or changed) in the block, filled as
        they are written.

    Example:
        >>> with update_golden() as written:
        ...     pass
        >>> written
        []
    """
    global _written
    previous = _written
    _written = []
    _new_run()
    try:
        yield _written
    finally:
        _written = previous


def _new_run() -> None:
    """Start a new run: forget the text each golden file was given so far in update mode
    (what tells two tests sharing one file apart from a later run of the same test).
    commspan's pytest plugin calls it when a test session starts."""
    _given.clear()


_OFF = frozenset({"", "0", "false", "no", "off"})
_ON = frozenset({"1", "true", "yes", "on"})


def _updating() -> bool:
    if _written is not None:
        return True
    value = os.environ.get(UPDATE_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    # (a typo must not rewrite the golden files and pass: that test could not fail)
    raise ValueError(
        f"{UPDATE_ENV}={os.environ[UPDATE_ENV]!r} is not valid; set it to 1 to rewrite the "
        "golden files, or to 0 (or leave it unset) to compare with them")


def golden_text(
    capture: Any, *, bytes: bool = False, placements: bool = False, fqn: str | None = None,
    groups: bool = False,
) -> str:
    """The golden-file text of what ``capture`` recorded (see the module docstring).

    Args:
        capture: a :class:`~commspan.testing.CommCapture`, a ``CommSpanMode`` or an
            :class:`~commspan.Aggregator`.
        bytes: add the bytes of each line's collectives (``bytes=4096``).
        placements: one line per DTensor redistribution (``placements=P(sum)->R``)
            and a line per DTensor parameter (``param weight 16x16 S(0)``).
        fqn: only this module and the modules inside it.
        groups: a line per mesh dimension (or process group outside a mesh) each
            module's collectives ran on (``group=tp count=2``): the same collectives
            on another dimension of the mesh are then a difference. A group outside
            every mesh is written by its global ranks (``group=ranks 0-3``), the same
            whatever groups the process made before (torch's name for it, a number,
            is not); an aggregator read from files knows the name only
            (``group=group 1``).

    Raises:
        ValueError: no module named ``fqn`` ran (the message lists the closest
            names that did).
    """
    from commspan.testing import _aggregator, _unknown_module

    agg = _aggregator(capture)
    if fqn is not None:
        unknown = _unknown_module(agg, fqn)
        if unknown:
            raise ValueError(f"fqn={fqn!r} is not valid: {unknown}")

    def inside(name: str) -> bool:
        return (fqn is None or fqn == semconv.GLOBAL_FQN or name == fqn
                or name.startswith(fqn + "."))

    lines: dict[tuple[Any, ...], str] = {}
    totals: dict[tuple[str, str, str, str], list[int]] = {}
    for s in agg.collectives():
        if not inside(s.fqn):
            continue
        where = f"{s.src or '?'}->{s.dst or '?'}" if placements and (s.src or s.dst) else ""
        slot = totals.setdefault((s.fqn, s.phase, s.op, where), [0, 0])
        slot[0] += s.count
        slot[1] += s.bytes
    for (name, phase, op, where), (count, nbytes) in totals.items():
        text = f"{_shown(name)} {phase} {op} count={count}"
        if bytes:
            text += f" bytes={nbytes}"
        if where:
            text += f" placements={where}"
        lines[(natural_key(name), 1, _PHASES.get(phase, 9), phase, op, where)] = text
    if groups:
        group_ranks = agg.group_ranks()
        for phase in _PHASES:
            for name, dims in agg.mesh_dim_counts(phase, subtree=False).items():
                if not inside(name):
                    continue
                by_label: dict[tuple[str, str], list[int]] = {}
                for dim, ops in dims.items():
                    label = _group_label(dim, group_ranks)  # (two groups, one label: summed)
                    for op, usage in ops.items():
                        slot = by_label.setdefault((op, label), [0, 0])
                        slot[0] += usage["count"]
                        slot[1] += usage["bytes"]
                for (op, label), (count, nbytes) in by_label.items():
                    text = f"{_shown(name)} {phase} {op} group={label} count={count}"
                    if bytes:
                        text += f" bytes={nbytes}"
                    lines[(natural_key(name), 2, _PHASES[phase], phase, op, label)] = text
    if placements:
        for name, params in agg.parameter_info().items():
            if not inside(name):
                continue
            for index, (param, info) in enumerate(params.items()):
                if info["placements"]:
                    lines[(natural_key(name), 0, index, "", "", "")] = (
                        f"{_shown(name)} param {_shown(param)} {info['shape']} "
                        f"{info['placements']}"
                    )
    header = [
        _VERSION_LINE,
        f"# options: bytes={bool(bytes)} placements={bool(placements)}"
        + (" groups=True" if groups else "")
        + (f" fqn={_shown(fqn)}" if fqn is not None else ""),
        _UPDATE_LINE,
    ]
    body = [lines[k] for k in sorted(lines)] or ["# (no collectives)"]
    return "\n".join(header + body) + "\n"


def _group_label(dim: str, group_ranks: dict[str, tuple[int, ...]]) -> str:
    """A mesh dimension as it is named; a group outside every mesh by its ranks
    (``ranks 0-3``, ``ranks 0,2``), not its name, which torch numbers in the order
    the process created its groups (another test run before gives another number)."""
    ranks = group_ranks.get(dim)
    if not ranks:
        return dim
    runs: list[str] = []
    start = prev = ranks[0]
    for r in (*ranks[1:], None):
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(runs)


_LINE_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")  # (str.splitlines)


def _shown(name: str) -> str:
    """A name as a golden line holds it: its Python literal when it holds a line break
    (``\\r`` reads back as a line end, ``\\n`` splits the line); as it is otherwise
    (a tab too, as files written before hold it)."""
    if any(ch in _LINE_BREAKS for ch in name):
        return repr(name)
    return name


def assert_matches_golden(
    capture: Any,
    path: str | os.PathLike[str],
    *,
    bytes: bool = False,
    placements: bool = False,
    fqn: str | None = None,
    groups: bool = False,
) -> None:
    """Assert that what ``capture`` recorded matches the golden file at ``path``.

    With pytest's ``--commspan-update-golden`` (or ``COMMSPAN_UPDATE_GOLDEN=1``)
    the file is written instead (directories created; left untouched when
    already equal) and the assertion passes, unless an earlier call of the run
    gave the same file another text (two tests sharing one file).

    Args:
        capture: a :class:`~commspan.testing.CommCapture`, a ``CommSpanMode`` or
            an :class:`~commspan.Aggregator`.
        path: the golden file; a relative path is relative to the current
            directory (``Path(__file__).parent / "golden" / "mlp.txt"`` keeps it
            next to the test).
        bytes: compare the bytes of the collectives too.
        placements: compare DTensor placements (of redistributions and parameters) too.
        fqn: only this module and the modules inside it.
        groups: compare the mesh dimension (or process group) of the collectives
            too (:func:`golden_text`).

    Raises:
        AssertionError: the recorded text differs from the file (the message is
            a unified diff, golden file first), the file does not exist or is
            not UTF-8 text (the message names the line and says how to rewrite
            it), or ``capture`` recorded nothing to
            compare: a mode never entered, a rank ``ranks=`` leaves out, every
            step sampled out (in update mode too: it would write an empty file).
        ValueError: no module named ``fqn`` ran (the message lists the closest names),
            or ``path`` is a directory, or a file other than a golden file (a test's
            source, a JSONL file: update mode would overwrite it; in update mode too).
        TypeError: ``path`` is not a path.

    Example:
        ``assert_matches_golden(cap, Path(__file__).parent / "golden" / "tp_mlp.txt")``
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r} is not valid; pass the golden file's path (str or Path)")
    target = Path(path)
    from commspan.testing import _assert_traced

    _assert_traced(capture, f"golden file {str(target)!r}", every_step=False)
    text = golden_text(capture, bytes=bytes, placements=placements, fqn=fqn, groups=groups)
    if target.is_dir():
        raise ValueError(f"path={str(target)!r} is not valid: it is a directory; pass the "
                         "golden file's path, e.g. golden/tp_mlp.txt")
    unreadable = ""  # why a file that exists cannot be compared (not UTF-8 text)
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        raw = None
    if raw is not None:
        _refuse_other_files(target, raw)
    try:
        kept: str | None = None if raw is None else raw.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        kept = None
        data = exc.object[:exc.start]
        line = data.count(b"\n") + 1
        unreadable = (f"line {line} (byte {exc.start}) is not UTF-8 text "
                      f"({exc.reason}: {exc.object[exc.start:exc.start + 4]!r})")
    if kept and not kept.endswith("\n"):  # an editor that drops the last newline
        kept += "\n"
    if _updating():
        key = target.resolve()
        given = _given.get(key)
        if given is not None and given != text:
            raise AssertionError(
                f"golden file {str(target)!r} was given another text earlier in this run "
                "(two tests, or two parameters of one test, share it): it would keep the "
                "last and the next run would fail on the other; give each its own file. "
                "This call's text, then the earlier one:\n" + "".join(difflib.unified_diff(
                    text.splitlines(keepends=True), given.splitlines(keepends=True),
                    fromfile="this call", tofile="earlier call")))
        _given[key] = text
        if kept != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            if _written is not None and target not in _written:
                _written.append(target)
        return
    if unreadable:
        raise AssertionError(
            f"golden file {str(target)!r}: {unreadable}, so it cannot be compared (a binary "
            "or damaged file, or one saved in another encoding); rewrite it by running the "
            "test with `pytest --commspan-update-golden` (or COMMSPAN_UPDATE_GOLDEN=1), "
            f"then review and commit it. It would hold:\n{text}"
        )
    if kept is None:
        raise AssertionError(
            f"golden file {str(target)!r} does not exist; create it by running the test with "
            "`pytest --commspan-update-golden` (or COMMSPAN_UPDATE_GOLDEN=1), then review "
            f"and commit it. It would hold:\n{text}"
        )
    if kept == text:
        return
    delta = "".join(
        difflib.unified_diff(
            kept.splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=f"{target} (golden)",
            tofile="recorded",
        )
    )
    hint = ""
    old_options = next((ln for ln in kept.splitlines() if ln.startswith("# options:")), None)
    new_options = text.splitlines()[1]
    if old_options is not None and old_options != new_options:
        hint = (f"\n(the file was written with {old_options[len('# options: '):]}; "
                f"this call uses {new_options[len('# options: '):]})")
    raise AssertionError(
        f"the recorded collectives differ from golden file {str(target)!r}; if the change "
        "is intended, run `pytest --commspan-update-golden` and review the file's diff"
        f"{hint}\n{delta}"
    )


_MARK = b"commspan golden file"


def _refuse_other_files(target: Path, raw: bytes) -> None:
    """A ``ValueError`` when ``target`` holds something other than a golden file (a
    test's source, a JSONL file, data: a path given by mistake): comparing would show a
    diff whose suggested fix, update mode, overwrites the file. An empty file, or one
    whose first line says it is a golden file (in any encoding: UTF-16 too), or whose
    lines are all comments or lines of counts (a golden file edited by hand), passes."""
    first = raw.lstrip()[:200].replace(b"\x00", b"").split(b"\n", 1)[0]
    if not raw.strip() or _MARK in first:
        return
    lines = [ln.strip() for ln in raw.splitlines() if ln.strip()]
    if all(ln.startswith(b"#") or b" count=" in ln for ln in lines):
        return
    shown = first[:60].decode("utf-8", "replace")
    raise ValueError(
        f"path={str(target)!r} is not valid: it is not a commspan golden file (its first "
        f"line, {shown!r}, does not start with {_VERSION_LINE[:22]!r}), and update mode "
        "would overwrite it; pass a golden file's path, or a new one (update mode creates "
        "it), e.g. golden/tp_mlp.txt")
