"""Run examples/tp_transformer.py (4 gloo ranks) once per test session and steps count.

The render tests need real multi-rank JSONL files. Spawning 4 ranks that
import torch takes ~10 s, so each run is kept in the session's base temporary
directory and reused by every test module that asks for the same number of
steps.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tp_transformer.py"
RANKS = 4


def example_run(tmp_path_factory: pytest.TempPathFactory, steps: int, *args: str) -> Path:
    """The JSONL directory of a ``--steps steps`` run of the example, with more command-line
    ``args`` (e.g. ``--sequence-parallel``), run on first use."""
    out = tmp_path_factory.getbasetemp() / "-".join(
        ["tp-example", f"{steps}-steps", *(a.strip("-") for a in args)])
    done = out / "DONE"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # the example starts its own ranks
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(out), "--steps", str(steps), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=out,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = sorted(out.glob("commspan-rank*.jsonl"))
    assert len(files) == RANKS, files
    done.write_text("ok\n")
    return out


def load_example(path: Path) -> ModuleType:
    """The example script at ``path`` imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module
