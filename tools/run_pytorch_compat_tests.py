"""Run PyTorch's own CommDebugMode / ModTracker tests against commspan.compat.

PyTorch's test files are not shipped in any package, so CI cannot run them;
a developer points this script at a PyTorch checkout's ``test/`` directory
(the tag of the installed torch, e.g. v2.13.0) or at a folder holding the test
files side by side. Each file runs under pytest twice, in a subprocess:

* ``torch``: as written, on torch's own classes (the baseline);
* ``commspan``: with ``torch.distributed.tensor.debug.CommDebugMode`` and
  ``torch.distributed._tools.ModTracker`` replaced by ``commspan.compat``'s
  classes before any test module imports them. A ``sitecustomize`` module
  does the replacement, so it also happens in the worker processes that
  PyTorch's multi-process test bases spawn; a pytest plugin fails any test
  that does not see the classes asked for.

It prints one row per test (whether it uses CommDebugMode or ModTracker, found
by reading the test's source and its helper methods; outcome on torch, on
commspan; first failure message) and the totals, and writes them as Markdown
with ``--markdown``. ``--only-users`` runs only the tests that use the classes.
Exit status: 0 when no test passes on torch and fails on commspan, 1 when one
does, 2 for bad input.

Test files newer than the installed torch may need two shims, applied in both
runs alike (``--no-shims`` turns them off): a stand-in for
``torch.testing._internal.common_utils.HardwareClassification`` where torch
lacks it, and a LocalTensor test wrapper that passes ``@parametrize``
arguments on. ``--multiproc`` also runs, on CPU with gloo, the multi-process
test classes that newer files instantiate for accelerators only.

Usage::

    python tools/run_pytorch_compat_tests.py ~/src/pytorch/test
    python tools/run_pytorch_compat_tests.py ~/src/pytorch/test --files test_mod_tracker.py -k ac
    python tools/run_pytorch_compat_tests.py DIR --multiproc --markdown results.md

Needs ``pytest`` and ``expecttest`` (``pip install expecttest``; PyTorch's
test helpers import it) in the Python that runs the tests (``--python``).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

DEFAULT_FILES = (
    "distributed/tensor/debug/test_comm_mode.py",
    "distributed/tensor/debug/test_comm_mode_features.py",
    "distributed/_tools/test_mod_tracker.py",
    "distributed/tensor/parallel/test_tp_style.py",
    "distributed/tensor/parallel/test_tp_examples.py",
    "distributed/tensor/parallel/test_parallelize_api.py",
    "distributed/tensor/test_embedding_ops.py",
    "distributed/tensor/test_math_ops.py",
)
"""Files (relative to PyTorch's ``test/``) whose tests use CommDebugMode or ModTracker."""

IMPLS = ("torch", "commspan")

_SITECUSTOMIZE = '''
"""Written by commspan's tools/run_pytorch_compat_tests.py; runs at interpreter start."""
import os
import sys


def _shims():
    import contextlib
    import enum
    import functools

    import torch
    import torch.testing._internal.common_utils as common_utils

    if not hasattr(common_utils, "HardwareClassification"):
        class HardwareClassification(enum.Enum):  # newer test files label their classes
            GENERIC = "generic"
            ACCELERATOR = "accelerator"

        common_utils.HardwareClassification = HardwareClassification

    import torch.testing._internal.distributed._tensor.common_dtensor as common_dtensor

    def make_wrapped(fn, ctxs):  # the LocalTensor wrapper, passing test arguments on
        @functools.wraps(fn)
        def wrapped(self, *args, **kwargs):
            torch._dynamo.reset()
            with contextlib.ExitStack() as stack:
                for ctx in ctxs:
                    stack.enter_context(ctx(self) if callable(ctx) else ctx)
                return fn(self, *args, **kwargs)

        return wrapped

    common_dtensor.make_wrapped = make_wrapped


def _keep_cpu_multiprocess_classes():
    import torch.testing._internal.common_device_type as device_type
    from torch.testing._internal.common_utils import instantiate_parametrized_tests
    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase

    instantiate = device_type.instantiate_device_type_tests

    def instantiate_keeping_cpu(generic_test_class, scope, *args, **kwargs):
        if issubclass(generic_test_class, DTensorTestBase) and "cpu" in (
            kwargs.get("except_for") or ()
        ):
            # leave the generic class (it runs on CPU with gloo), its
            # @parametrize tests expanded
            instantiate_parametrized_tests(generic_test_class)
            return None
        return instantiate(generic_test_class, scope, *args, **kwargs)

    device_type.instantiate_device_type_tests = instantiate_keeping_cpu


def _use_commspan():
    import torch.distributed._tools as tools
    import torch.distributed._tools.mod_tracker as mod_tracker
    import torch.distributed.tensor.debug as debug
    import torch.distributed.tensor.debug._comm_mode as comm_mode

    import commspan.compat as compat

    debug.CommDebugMode = comm_mode.CommDebugMode = compat.CommDebugMode
    tools.ModTracker = mod_tracker.ModTracker = compat.ModTracker


_impl = os.environ.get("COMMSPAN_COMPAT_IMPL")
if _impl:
    try:
        if os.environ.get("COMMSPAN_COMPAT_SHIMS") == "1":
            _shims()
        if os.environ.get("COMMSPAN_COMPAT_MULTIPROC") == "1":
            _keep_cpu_multiprocess_classes()
        if _impl == "commspan":
            _use_commspan()
    except Exception as exc:  # reported, and the check plugin then fails every test
        print(f"[commspan compat runner] {type(exc).__name__}: {exc}", file=sys.stderr)
'''

_CHECK_PLUGIN = '''
"""Written by commspan's tools/run_pytorch_compat_tests.py.

Each test must see the classes asked for.
"""
import os

import pytest


@pytest.fixture(autouse=True)
def _commspan_compat_classes():
    want_commspan = os.environ.get("COMMSPAN_COMPAT_IMPL") == "commspan"
    import torch.distributed._tools.mod_tracker as mod_tracker
    import torch.distributed.tensor.debug as debug

    for cls in (debug.CommDebugMode, mod_tracker.ModTracker):
        got = cls.__module__.startswith("commspan.")
        assert got == want_commspan, f"{cls.__module__}.{cls.__name__} is in use"
    yield
'''


@dataclass
class Case:
    """One test's outcome under one implementation."""

    name: str
    outcome: str  # passed, failed, error, skipped
    message: str = ""


@dataclass
class FileRun:
    """One test file under one implementation."""

    file: str
    impl: str
    returncode: int | str
    seconds: float
    cases: list[Case] = field(default_factory=list)
    log: str = ""
    tests: dict[str, bool] = field(default_factory=dict)


def find_test_file(root: Path, relative: str) -> Path | None:
    """``root/relative`` (a PyTorch ``test/`` dir) or ``root/<basename>`` (a flat folder)."""
    for candidate in (root / relative, root / Path(relative).name):
        if candidate.is_file():
            return candidate
    return None


_CLASSES = ("CommDebugMode", "ModTracker")


def test_functions(test_file: Path) -> dict[str, bool]:
    """``{test function name: whether it uses CommDebugMode or ModTracker}``, in its own
    body or through a helper method of its class (``self.helper(...)``)."""
    source = test_file.read_text(encoding="utf-8")
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    found: dict[str, bool] = {}
    scopes = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
    for body in scopes:
        functions = {
            fn.name: ast.get_source_segment(source, fn) or ""
            for fn in body
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        direct = {name for name, text in functions.items() if any(c in text for c in _CLASSES)}
        helpers = {name for name in direct if not name.startswith("test")}
        for name, text in functions.items():
            if name.startswith("test"):
                uses = name in direct or any(f"self.{h}(" in text for h in helpers)
                found[name] = found.get(name, False) or uses
    return found


def users(test_file: Path) -> set[str]:
    """Names of the test functions that use CommDebugMode or ModTracker."""
    return {name for name, uses in test_functions(test_file).items() if uses}


def _uses(case_name: str, tests: dict[str, bool]) -> bool:
    """Whether the test function a case comes from (the longest name it starts with: a
    parametrized case adds a suffix) uses the classes."""
    method = case_name.rsplit("::", 1)[-1]
    names = [n for n in tests if method == n or method.startswith(n + "_")]
    return tests[max(names, key=len)] if names else False


def _junit_cases(xml_file: Path, module: str) -> list[Case]:
    if not xml_file.is_file():
        return []
    cases = []
    for case in ET.parse(xml_file).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = " ".join((child.get("message") or child.text or "").split())
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = str(case.get("name"))
        if cls and cls != module:  # a test class, not the module of a plain function
            name = f"{cls}::{name}"
        cases.append(Case(name, outcome, message[:200]))
    return cases


def run_file(
    python: str,
    test_file: Path,
    impl: str,
    harness: Path,
    extra_path: list[str],
    args: argparse.Namespace,
) -> FileRun:
    """Run one file under pytest with the classes of ``impl``."""
    xml_file = harness / f"{test_file.stem}-{impl}.xml"
    xml_file.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(harness), str(REPO), *extra_path, env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    env["COMMSPAN_COMPAT_IMPL"] = impl
    env["COMMSPAN_COMPAT_SHIMS"] = "0" if args.no_shims else "1"
    env["COMMSPAN_COMPAT_MULTIPROC"] = "1" if args.multiproc else "0"
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        python, "-m", "pytest", str(test_file), "-q", "-rA", "-p", "no:cacheprovider",
        "-p", "commspan_compat_check", f"--junitxml={xml_file}", "--rootdir", str(harness),
    ]
    tests = test_functions(test_file)
    selection = [f"({args.k})"] if args.k else []
    if args.only_users:
        selection.append("(" + " or ".join(sorted(users(test_file))) + ")")
    if selection:
        cmd += ["-k", " and ".join(selection)]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=harness, env=env, capture_output=True, text=True, timeout=args.timeout
        )
        returncode: int | str = proc.returncode
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = "timeout"
        log = str(exc.stdout or "")
    return FileRun(
        test_file.name, impl, returncode, round(time.monotonic() - start, 1),
        _junit_cases(xml_file, test_file.stem), log, tests,
    )


def markdown(runs: list[FileRun], impls: list[str]) -> str:
    """A table: one row per test, one column per implementation, and the totals."""
    rows: dict[tuple[str, str], dict[str, Case]] = {}
    tests = {run.file: run.tests for run in runs}
    for run in runs:
        if not run.cases:
            tail = run.log.strip().splitlines()
            rows.setdefault((run.file, "(no test ran)"), {})[run.impl] = Case(
                "", f"exit {run.returncode}", tail[-1][:200] if tail else ""
            )
        for case in run.cases:
            rows.setdefault((run.file, case.name), {})[run.impl] = case
    lines = [
        "| file | test | uses | " + " | ".join(impls) + " | first failure message |",
        "|---|---|---|" + "---|" * len(impls) + "---|",
    ]
    for (file, test), by_impl in sorted(rows.items()):
        uses = "yes" if _uses(test, tests.get(file, {})) else ""
        cells = [uses] + [by_impl[i].outcome if i in by_impl else "-" for i in impls]
        note = next(
            (by_impl[i].message for i in impls
             if i in by_impl and by_impl[i].outcome not in ("passed", "skipped")),
            "",
        )
        note = note.replace("|", "/")
        lines.append(f"| {file} | {test} | " + " | ".join(cells) + f" | {note} |")
    lines.append("")
    for impl in impls:
        for label, keep in (("", False), (" (tests using CommDebugMode or ModTracker)", True)):
            outcomes = [c.outcome for r in runs if r.impl == impl for c in r.cases
                        if not keep or _uses(c.name, r.tests)]
            counts = ", ".join(f"{o} {outcomes.count(o)}" for o in sorted(set(outcomes)))
            lines.append(f"- {impl}{label}: {counts or 'nothing ran'}")
    return "\n".join(lines) + "\n"


def regressions(runs: list[FileRun]) -> list[str]:
    """Tests that pass on torch and do not pass on commspan."""
    by_impl: dict[str, dict[tuple[str, str], str]] = {}
    for run in runs:
        for case in run.cases:
            by_impl.setdefault(run.impl, {})[(run.file, case.name)] = case.outcome
    torch_cases = by_impl.get("torch", {})
    ours = by_impl.get("commspan", {})
    return sorted(
        f"{file}::{name}"
        for (file, name), outcome in torch_cases.items()
        if outcome == "passed" and ours.get((file, name), "missing") != "passed"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tests", type=Path,
                        help="PyTorch's test/ directory, or a folder of test files")
    parser.add_argument("--files", nargs="+",
                        help="file names or paths relative to test/ (default: all known)")
    parser.add_argument("--impl", default="torch,commspan",
                        help="torch, commspan or both (default)")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--only-users", action="store_true",
                        help="run only the tests that use CommDebugMode or ModTracker")
    parser.add_argument("--multiproc", action="store_true",
                        help="also run accelerator-only multi-process classes on CPU (gloo)")
    parser.add_argument("--no-shims", action="store_true",
                        help="run the files without the version shims")
    parser.add_argument("--timeout", type=int, default=1800,
                        help="seconds per file and implementation")
    parser.add_argument("--python", default=sys.executable,
                        help="the Python with torch and pytest")
    parser.add_argument("--extra-path", action="append", default=[],
                        help="a directory to put on PYTHONPATH (e.g. where expecttest is)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--logs", type=Path,
                        help="keep pytest's output of each run in this directory")
    args = parser.parse_args(argv)

    if not args.tests.is_dir():
        print(f"tests={str(args.tests)!r}: not a directory; pass PyTorch's test/ directory "
              "(e.g. ~/src/pytorch/test at the tag of the installed torch)", file=sys.stderr)
        return 2
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown or not impls:
        print(f"--impl={args.impl!r}: use torch, commspan or torch,commspan", file=sys.stderr)
        return 2
    wanted = args.files or list(DEFAULT_FILES)
    files: list[Path] = []
    for name in wanted:
        relative = next((f for f in DEFAULT_FILES if Path(f).name == name), name)
        found = find_test_file(args.tests, relative)
        if found is None:
            print(f"skipping {relative}: not found under {args.tests}", file=sys.stderr)
        else:
            files.append(found)
    if not files:
        print(f"no test file found under {args.tests}; expected e.g. {DEFAULT_FILES[0]}",
              file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*args.extra_path, str(REPO)]))
    probe = subprocess.run([args.python, "-c", "import expecttest, pytest, torch"], env=env,
                           capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        print(f"{args.python} cannot run PyTorch's tests ({last}); install what is missing, "
              "e.g. pip install expecttest pytest, or pass --extra-path DIR", file=sys.stderr)
        return 2

    harness = Path(tempfile.mkdtemp(prefix="commspan-compat-"))
    try:
        (harness / "sitecustomize.py").write_text(textwrap.dedent(_SITECUSTOMIZE))
        (harness / "commspan_compat_check.py").write_text(textwrap.dedent(_CHECK_PLUGIN))
        runs = []
        for test_file in files:
            if args.only_users and not users(test_file):
                print(f"skipping {test_file.name}: no test uses CommDebugMode or ModTracker")
                continue
            for impl in impls:
                run = run_file(args.python, test_file, impl, harness, args.extra_path, args)
                outcomes = [c.outcome for c in run.cases]
                summary = " ".join(f"{o}={outcomes.count(o)}" for o in sorted(set(outcomes)))
                print(f"{impl:9} {test_file.name:32} exit {run.returncode} "
                      f"{run.seconds:7.1f}s {summary or '(no test ran)'}", flush=True)
                if args.logs:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    (args.logs / f"{test_file.stem}-{impl}.log").write_text(run.log)
                runs.append(run)
    finally:
        shutil.rmtree(harness, ignore_errors=True)
    table = markdown(runs, impls)
    print()
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    lost = regressions(runs)
    if lost:
        print("pass on torch, not on commspan:\n  " + "\n  ".join(lost))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
