"""The documentation's code runs: README and docs/ Python blocks, and every module's doctests."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import commspan

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]*)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])


def python_blocks(path: Path) -> list[str]:
    """The ```python fenced blocks of a Markdown file, in order."""
    return _BLOCK.findall(path.read_text(encoding="utf-8"))


def run_blocks(path: Path) -> dict[str, object]:
    """Run a Markdown file's Python blocks in order, in one namespace; return it."""
    namespace: dict[str, object] = {"__name__": f"docs:{path.name}"}
    for i, block in enumerate(python_blocks(path), 1):
        code = compile(block, f"{path.name} block {i}", "exec")
        exec(code, namespace)  # noqa: S102 - running our own documentation
    return namespace


def test_readme_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """README's Python blocks run as written and write a rank-0 JSONL file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert python_blocks(REPO / "README.md"), "README.md has no ```python block"
    namespace = run_blocks(REPO / "README.md")
    out = capsys.readouterr().out
    assert out.startswith("Global\n") and "Sequential.2" in out
    assert (tmp_path / "commspan-out" / "commspan-rank0.jsonl").stat().st_size > 0
    namespace["mode"].shutdown()  # type: ignore[attr-defined]


def test_readme_test_snippets_pass(pytester: pytest.Pytester) -> None:
    """README's "In tests" blocks are whole test files: each passes under pytest as
    written (every name imported), the golden-file one after
    ``--commspan-update-golden`` has written its file."""
    blocks = [b for b in python_blocks(REPO / "README.md") if "\ndef test_" in b]
    assert len(blocks) == 2, "README.md's test blocks changed: update this test"
    pytester.makepyfile(**{f"test_readme_{i}": b for i, b in enumerate(blocks)})
    args = ("-p", "no:cacheprovider", "--strict-markers")
    pytester.runpytest_subprocess(*args, "--commspan-update-golden").assert_outcomes(passed=2)
    golden = (pytester.path / "golden" / "tp.txt").read_text()
    assert "Transformer.layers.0.attention.wo forward all_reduce" in golden
    # the model is built before the capture: its construction's broadcasts and scatters
    # (outside every module) are not in the file
    assert not [line for line in golden.splitlines() if line.startswith("Global")], golden
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2)


_RUN_DOCS = ["jsonl.md", "design.md", "views.md", "backends.md", "compat.md", "debugging.md"]
# fragments that need a device mesh or a model of the page's own, not whole programs
_FRAGMENT_DOCS = {"parallelisms.md", "performance.md"}


def test_every_docs_python_block_is_run_or_a_known_fragment() -> None:
    """A docs page with Python blocks is run by :func:`test_docs_examples_run` (backends,
    compat and debugging were not) or listed as fragments."""
    with_blocks = {p.name for p in (REPO / "docs").glob("*.md") if python_blocks(p)}
    assert with_blocks - set(_RUN_DOCS) == _FRAGMENT_DOCS


@pytest.mark.parametrize("name", _RUN_DOCS)
def test_docs_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/*.md Python blocks run, next to JSONL files written the README's way."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    run_blocks(REPO / "README.md")["mode"].shutdown()  # type: ignore[attr-defined]
    run_blocks(REPO / "docs" / name)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation dropped,
    spaces as dashes."""
    text = re.sub(r"[`*_]|\[|\]\([^)]*\)", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    for heading in re.findall(r"^#{1,6}\s+(.*)$", text, re.MULTILINE):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("path", _DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path) -> None:
    """Every relative link (and image) in README.md and docs/*.md points at a file of the
    repository, and its #anchor at a heading of that file."""
    broken = []
    for target in _LINK.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = path.parent / file if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken


def _modules() -> list[str]:
    names = ["commspan"]
    names += [m.name for m in pkgutil.walk_packages(commspan.__path__, "commspan.")]
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_module_doctests(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The examples in each commspan module's docstrings pass as doctests."""
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctests failed in {name}"


def test_docs_name_the_current_schema_and_every_phase() -> None:
    """docs/jsonl.md's example line shows the schema URL files carry now, and
    docs/api.md names every ``Phase`` (it showed ``schemas/3`` and no ``setup``)."""
    from commspan.semconv import SCHEMA_URL, Phase

    jsonl = (REPO / "docs" / "jsonl.md").read_text(encoding="utf-8")
    assert set(re.findall(r"https://commspan\.dev/schemas/\d+", jsonl)) == {SCHEMA_URL}
    api = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    line = next(ln for ln in api.splitlines() if ln.startswith("- `Phase`"))
    assert all(f"`{p.value}`" in line for p in Phase)
