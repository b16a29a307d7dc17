"""The package's imports follow its layers (docs/design.md, "Flow of information").

Every module of ``commspan`` belongs to one layer; a module imports only from
its own layer and the layers below it, and only capture/ (with the session,
testing and compat on top) imports torch. The imports are read with ``ast``,
lazy ones inside functions included, so nothing here depends on what is
installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "commspan"

# Lowest first. A module may import from its own layer and the ones before it.
LAYERS: list[tuple[str, ...]] = [
    # names, error handling, the bandwidth formulas, locks renewed after fork(), JSON
    # with big ints: import nothing of commspan
    ("commspan.semconv", "commspan._errors", "commspan._bandwidth", "commspan._fork",
     "commspan._json"),
    ("commspan.ownership",),  # the rules: who owns a collective, which phase
    ("commspan.spans",),  # frames -> OpenTelemetry spans
    ("commspan.capture",),  # torch hooks and the dispatch mode: drive the recorder
    ("commspan.otlpjson",),  # the file format, both directions
    ("commspan.exporters",),  # export queue, JSONL and OTLP exporters
    ("commspan.analysis",),  # counts and analyses over finished spans or records
    ("commspan.render",),  # text, HTML, Perfetto views
    ("commspan.cli",),  # the command: arguments and exit codes
    # wiring and extras on top: the facade, the mode, the testing helpers, compat
    ("commspan", "commspan.session", "commspan.testing", "commspan.compat"),
    ("commspan.__main__",),  # `python -m commspan`: the command
]

# Imports from a higher layer that are allowed, each with its reason.
EXCEPTIONS = {
    # Aggregator.table() is public since 0.1; it renders with the text view, imported
    # inside the method.
    ("commspan.analysis.counts", "commspan.render.table"),
    # `commspan plan` runs the user's step under a mode on the fake process group: the
    # one command that needs the session; imported inside the command.
    ("commspan.cli.commands", "commspan.session.plan"),
    # the digest a JSONL writer may add folds spans exactly as the readers do
    ("commspan.exporters.jsonl", "commspan.analysis.digest"),
}

# Where torch may be imported.
TORCH_LAYERS = ("commspan.capture", "commspan.session", "commspan.testing", "commspan.compat")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> int:
    """The index in LAYERS of the layer ``name`` belongs to (the longest matching prefix)."""
    best, best_len = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            # "commspan" stands for the facade module alone, not for the whole package
            matches = name == prefix if prefix == "commspan" else _under(name, prefix)
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise LookupError(f"{name} is in no layer: add it to LAYERS in tests/test_layering.py")
    return best


def imported(name: str, source: str, known: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a commspan module or of torch in ``source``.

    ``from commspan import x`` imports the submodule ``commspan.x`` when there is
    one; ``__version__`` counts as the base layer's, other names as the facade's.
    """
    out: list[tuple[int, str]] = []
    package = name if name in known and (PACKAGE.parent / name.replace(".", "/")).is_dir() else (
        name.rsplit(".", 1)[0]
    )
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    out.append((node.lineno, full))
                elif base == "commspan" and alias.name == "__version__":
                    out.append((node.lineno, "commspan.semconv"))
                else:
                    out.append((node.lineno, base))
    return [(line, mod) for line, mod in out if _under(mod, "commspan") or _under(mod, "torch")]


def violations(name: str, source: str, known: set[str]) -> list[str]:
    """What in ``source`` (module ``name``) breaks the layering."""
    problems = []
    own = layer_of(name)
    for line, mod in imported(name, source, known):
        if _under(mod, "torch"):
            if not any(_under(name, p) for p in TORCH_LAYERS):
                problems.append(f"{name}:{line} imports {mod}: only capture/ imports torch")
            continue
        target = layer_of(mod)
        if target > own and (name, mod) not in EXCEPTIONS:
            problems.append(
                f"{name}:{line} imports {mod}, a layer above it ({LAYERS[target][0]} over "
                f"{LAYERS[own][0]})"
            )
    return problems


MODULES = _modules()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_only_its_layer_and_below(name: str) -> None:
    """The module imports nothing from a layer above its own, and torch only in capture/
    (or the session, testing and compat on top)."""
    source = MODULES[name].read_text(encoding="utf-8")
    assert violations(name, source, set(MODULES)) == []


def test_every_exception_is_still_needed() -> None:
    """Each allowed upward import is still made (stale exceptions are removed)."""
    for name, target in EXCEPTIONS:
        source = MODULES[name].read_text(encoding="utf-8")
        assert target in {mod for _, mod in imported(name, source, set(MODULES))}, (name, target)


@pytest.mark.parametrize(
    ("name", "source", "expected"),
    [
        ("commspan.spans.recorder", "from commspan.session import CommSpanMode\n",
         "imports commspan.session, a layer above it"),
        ("commspan.capture.modules", "def f():\n    from commspan.exporters import jsonl\n",
         "imports commspan.exporters.jsonl, a layer above it"),
        ("commspan.analysis.tree", "import torch\n", "imports torch: only capture/"),
        ("commspan.otlpjson.decode", "from ..cli import main\n", "imports commspan.cli"),
    ],
    ids=["spans->session", "lazy-capture->exporters", "analysis-torch", "relative"],
)
def test_the_check_catches_an_upward_import(name: str, source: str, expected: str) -> None:
    """The checker itself flags an upward import, a lazy one, a relative one and torch."""
    found = violations(name, source, set(MODULES))
    assert len(found) == 1 and expected in found[0], found


def test_a_module_outside_every_layer_is_an_error() -> None:
    """A new top-level module must be placed in a layer before the check passes."""
    with pytest.raises(LookupError, match="in no layer"):
        layer_of("commspan.newthing")
