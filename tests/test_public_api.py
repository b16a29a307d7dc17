"""The public surface: explicit, sorted ``__all__`` lists and documented callables."""

from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path
from typing import Any

import pytest

import commspan

# Facades re-export the public API and hold nothing else; the other public
# modules define their API and import helpers.
FACADES = ["commspan", "commspan.exporters", "commspan.render"]
PUBLIC_MODULES = [*FACADES, "commspan.testing", "commspan.compat"]


def _module(name: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            pytest.skip(f"{name} does not exist (yet)")
        raise


def _public_names(module: types.ModuleType) -> set[str]:
    """Names a user can see: not underscored, not a submodule, not a __future__ feature."""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and type(value).__name__ != "_Feature"
    }


def _defined_names(module: types.ModuleType) -> set[str]:
    """Public classes and functions defined in ``module`` itself (not imported)."""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module.__name__
    }


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_is_sorted(name: str) -> None:
    """``__all__`` is sorted, without duplicates."""
    exported = list(_module(name).__all__)
    assert exported == sorted(set(exported))


@pytest.mark.parametrize("name", FACADES)
def test_facade_all_is_exactly_the_public_names(name: str) -> None:
    """A facade's ``__all__`` is exactly its public names: nothing missing, nothing extra."""
    module = _module(name)
    assert set(module.__all__) - {"__version__"} == _public_names(module)


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_names_exist_and_cover_definitions(name: str) -> None:
    """Every ``__all__`` name exists; every public class or function defined there is in it."""
    module = _module(name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what the module lacks: {missing}"
    assert _defined_names(module) <= set(module.__all__)


def test_top_level_api() -> None:
    """The package exports its entry points and a version string."""
    assert {"CommSpanMode", "Aggregator", "Phase"} <= set(commspan.__all__)
    assert "__version__" in commspan.__all__
    assert isinstance(commspan.__version__, str) and commspan.__version__.count(".") == 2


def test_every_public_name_is_in_the_api_page() -> None:
    """docs/api.md lists every name of the public modules' ``__all__`` (and only theirs)."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    sections = dict(re.findall(r"^## `([\w.]+)`\n(.*?)(?=^## |\Z)", page, re.M | re.S))
    modules = [*PUBLIC_MODULES, "commspan.analysis", "commspan.capture"]
    assert sorted(sections) == sorted(modules)
    missing = {
        name: [n for n in _module(name).__all__
               if not re.search(rf"`{re.escape(n)}`", sections[name])]
        for name in modules
    }
    assert not any(missing.values()), f"docs/api.md does not list {missing}"


def test_exporters_api() -> None:
    """The exporters facade offers the JSONL exporter, its reader and the OTLP factory."""
    from commspan import exporters

    assert {"JsonlSpanExporter", "read_spans", "otlp_exporter"} <= set(exporters.__all__)


def _public_callables() -> list[tuple[str, Any]]:
    found: dict[str, Any] = {}
    for mod_name in PUBLIC_MODULES:
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError:
            continue
        for name in module.__all__:
            obj = getattr(module, name)
            if not callable(obj) or type(obj).__module__ == "typing":
                continue  # values and type aliases carry no docstring of their own
            found[f"{mod_name}.{name}"] = obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    if isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    if isinstance(member, property):
                        member = member.fget
                    if callable(member):
                        found[f"{mod_name}.{name}.{attr}"] = member
    return sorted(found.items())


@pytest.mark.parametrize(
    "qualname,obj", _public_callables(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_public_callables_have_docstrings(qualname: str, obj: Any) -> None:
    """Every public class, function, method and property has its own docstring."""
    assert (inspect.getdoc(obj) or "").strip(), f"{qualname} has no docstring"
