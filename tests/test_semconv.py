"""commspan.semconv is the one home of names, and docs/schema.md follows it."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from commspan import semconv

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "commspan"
# A span, event or attribute name of ours: "commspan." then a dotted lowercase name.
_NAME = re.compile(r"^commspan\.[a-z_<>]+(\.[a-z_<>]*)*$")


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "gen_schema_doc", REPO / "tools/gen_schema_doc.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_schema_doc_is_up_to_date() -> None:
    """docs/schema.md is exactly what tools/gen_schema_doc.py generates from semconv."""
    expected = _generator().generate()
    current = (REPO / "docs" / "schema.md").read_text(encoding="utf-8")
    assert current == expected, (
        "docs/schema.md is stale: run `python tools/gen_schema_doc.py` and commit the result "
        "(a changed name is a schema change: bump SCHEMA_VERSION and note it in CHANGELOG.md)"
    )


def test_schema_doc_lists_every_attribute_and_phase() -> None:
    """Every ATTRIBUTES key, span name and Phase value appears in docs/schema.md."""
    text = (REPO / "docs" / "schema.md").read_text(encoding="utf-8")
    names = [*semconv.ATTRIBUTES, semconv.SPAN_STEP, semconv.SPAN_SESSION, semconv.SPAN_RANK]
    names += [p.value for p in semconv.Phase]
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing
    assert f"Schema version **{semconv.SCHEMA_VERSION}**" in text


def test_schema_doc_is_markdown_not_docstring_markup() -> None:
    """No Sphinx role (:data:`X`) leaks into docs/schema.md, and a docstring that follows
    "Label: " mid-sentence does not start with a capital (": Prefix of ...")."""
    text = (REPO / "docs" / "schema.md").read_text(encoding="utf-8")
    assert not re.findall(r":(?:data|func|class|meth|attr|mod):`", text)
    assert not re.findall(r"(?:roll-ups|attributes|`Global`): [A-Z][a-z]", text)


def test_every_attribute_constant_is_documented() -> None:
    """Each ``commspan.*`` / OpenTelemetry key constant in semconv has an ATTRIBUTES entry."""
    keys = {
        name: value
        for name, value in vars(semconv).items()
        if name.isupper()
        and isinstance(value, str)
        and _NAME.match(value)
        and not name.startswith(("SPAN_", "EVENT_", "SCHEMA_URL", "COUNT_PREFIX",
                                 "BYTES_PREFIX", "COMM_TIME_PREFIX", "INSTRUMENTATION"))
    }
    undocumented = {n: v for n, v in keys.items() if v not in semconv.ATTRIBUTES}
    assert not undocumented, f"add these to semconv.ATTRIBUTES: {undocumented}"


def test_count_keys_round_trip() -> None:
    """count_key and parse_count_key are inverse for every phase; totals are not per-op keys."""
    for phase in semconv.Phase:
        key = semconv.count_key(phase, "all_reduce")
        assert semconv.parse_count_key(key) == (phase.value, "all_reduce")
    total = f"{semconv.COUNT_PREFIX}forward.{semconv.COUNT_TOTAL}"
    assert semconv.parse_count_key(total) is None
    assert semconv.parse_count_key(semconv.SELF_COUNT) is None


def _hardcoded_names(path: Path, root: Path = REPO) -> list[str]:
    """``file:line: literal`` for each ``commspan.*`` name spelled in code (not docstrings)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    # docstrings, module-level or attribute ones, are bare string statements
    prose = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    # the pieces of an f-string are reported once, as the f-string
    prose |= {
        id(part)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        for part in node.values
    }
    where = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in prose and _NAME.match(node.value):
                found.append(f"{where}:{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and str(head.value).startswith("commspan."):
                found.append(f"{where}:{node.lineno}: f{head.value!r}...")
    return found


_SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "semconv.py")


@pytest.mark.parametrize("path", _SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_hardcoded_commspan_names(path: Path) -> None:
    """No module but semconv.py spells a ``commspan.*`` name as a string literal."""
    assert not _hardcoded_names(path), "use the constants of commspan.semconv instead"


def test_hardcoded_name_detector_works(tmp_path: Path) -> None:
    """The detector flags literals and f-strings, and leaves docstrings alone."""
    source = tmp_path / "mod.py"
    source.write_text(
        '"""Docstring naming commspan.rank is fine."""\n'
        'KEY = "commspan.module.fqn"\n'
        "def f(phase):\n"
        '    """commspan.phase in a docstring is fine."""\n'
        '    return f"commspan.collectives.{phase}"\n',
        encoding="utf-8",
    )
    found = _hardcoded_names(source, root=tmp_path)
    assert [line.split(": ", 1)[1] for line in found] == [
        "'commspan.module.fqn'",
        "f'commspan.collectives.'...",
    ]
