"""Arize Phoenix as a real OTLP backend for tests: start it once, read spans back.

Phoenix (PyPI ``arize-phoenix``, tested with 20.26.1) runs from its own
virtualenv, as a subprocess on free ports of 127.0.0.1, in a throw-away
working directory, with every outbound feature off. It accepts OTLP over gRPC
and HTTP/protobuf and returns the spans it stored, with attributes and events,
from ``GET /v1/projects/{project}/spans``. The project of a span is taken from
the resource attribute ``openinference.project.name``.

Where the ``phoenix`` executable is looked for, first match wins:
``$COMMSPAN_PHOENIX``, ``<repo>/.venv-phoenix/bin/phoenix``,
``/work/phoenix-venv/bin/phoenix``, ``phoenix`` on ``PATH``. Tests that need it
are skipped, saying how to install it, when none exists.

Use the session fixture :func:`phoenix` (import it into the test module).
Startup takes 10-20 s, so the server is shared by the whole session; give each
test its own project name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["PROJECT_ATTRIBUTE", "Phoenix", "find_phoenix", "free_port", "phoenix"]

PROJECT_ATTRIBUTE = "openinference.project.name"
"""Resource attribute that routes spans to a Phoenix project."""

PINNED = "arize-phoenix==20.26.1"
REPO = Path(__file__).resolve().parent.parent
_CANDIDATES = (
    REPO / ".venv-phoenix" / "bin" / "phoenix",
    Path("/work/phoenix-venv/bin/phoenix"),
)


def find_phoenix() -> Path | None:
    """The ``phoenix`` executable to use, or ``None`` (see the module docstring)."""
    env = os.environ.get("COMMSPAN_PHOENIX")
    if env:
        return Path(env) if Path(env).exists() else None
    for candidate in _CANDIDATES:
        if candidate.exists():
            return candidate
    found = shutil.which("phoenix")
    return Path(found) if found else None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 and on ``::`` (Phoenix binds gRPC on all interfaces)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        try:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s6:
                s6.bind(("::", port))
        except OSError:
            continue
        return port
    raise RuntimeError("no TCP port free on both 127.0.0.1 and ::")


class Phoenix:
    """One Phoenix server process on free ports, in its own working directory.

    Args:
        executable: the ``phoenix`` script of a virtualenv with arize-phoenix.
    """

    def __init__(self, executable: Path) -> None:
        self.executable = executable
        self.workdir = Path(tempfile.mkdtemp(prefix="commspan-phoenix-"))
        self.http_port = free_port()
        self.grpc_port = free_port()
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = self.workdir / "phoenix.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s = 0.0
        self.version = ""

    # ------------------------------------------------------------ endpoints
    @property
    def grpc_endpoint(self) -> str:
        """OTLP/gRPC endpoint (plaintext)."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        """OTLP/HTTP traces URL."""
        return f"{self.base_url}/v1/traces"

    # ------------------------------------------------------------ lifecycle
    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
        env.update(
            PHOENIX_HOST="127.0.0.1",
            PHOENIX_PORT=str(self.http_port),
            PHOENIX_GRPC_PORT=str(self.grpc_port),
            PHOENIX_WORKING_DIR=str(self.workdir),
            PHOENIX_SQL_DATABASE_URL=f"sqlite:///{self.workdir}/phoenix.db",
            # no outbound traffic: no sandbox download, docs server, telemetry
            PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",
            PHOENIX_TELEMETRY_ENABLED="false",
            PHOENIX_DISABLE_AGENT_ASSISTANT="true",
            PHOENIX_ALLOWED_SANDBOX_PROVIDERS="NONE",
            PHOENIX_LOG_MIGRATIONS="false",
            PYTHONUNBUFFERED="1",
        )
        return env

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the server and wait until ``/readyz`` answers and gRPC accepts connections.

        Raises:
            RuntimeError: the process exited during startup (the message has its log tail).
            TimeoutError: not ready within ``timeout_s``.
        """
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(self.executable), "serve"],
                env=self._env(),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"phoenix exited with status {self.proc.returncode} during startup; "
                    f"log tail:\n{self.tail()}"
                )
            try:
                status, _ = self._get("/readyz", timeout_s=1.0)
                if status == 200:
                    with socket.create_connection(("127.0.0.1", self.grpc_port), timeout=1):
                        pass
                    self.startup_s = time.monotonic() - t0
                    self.version = self._get("/arize_phoenix_version")[1].decode().strip()
                    return
            except OSError:  # URLError and refused connections while it boots
                pass
            time.sleep(0.2)
        raise TimeoutError(f"phoenix not ready after {timeout_s:.0f}s; log tail:\n{self.tail()}")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (uvicorn shuts down gracefully, exit status -15), SIGKILL after the timeout."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def close(self) -> None:
        """Stop the server and delete its working directory."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def tail(self, n: int = 4000) -> str:
        """The last ``n`` bytes of the server log."""
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------ REST
    def _get(self, path: str, timeout_s: float = 10.0, **params: Any) -> tuple[int, bytes]:
        query = urllib.parse.urlencode(params, doseq=True)
        url = f"{self.base_url}{path}{'?' + query if query else ''}"
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()

    def spans(self, project: str, page_size: int = 1000) -> list[dict[str, Any]]:
        """Every span of ``project`` (all pages); ``[]`` while the project does not exist."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        path = f"/v1/projects/{urllib.parse.quote(project, safe='')}/spans"
        while True:
            params: dict[str, Any] = {"limit": page_size}
            if cursor:
                params["cursor"] = cursor
            try:
                _, body = self._get(path, **params)
            except urllib.error.HTTPError as exc:
                if exc.code == 404:  # projects are created with their first span
                    return []
                raise
            doc = json.loads(body)
            out.extend(doc["data"])
            cursor = doc.get("next_cursor")
            if not cursor:
                return out

    def wait_for_spans(
        self, project: str, count: int, timeout_s: float = 60.0, poll_s: float = 0.5
    ) -> list[dict[str, Any]]:
        """Poll until ``project`` holds at least ``count`` spans; return them.

        Phoenix answers an export before it stores the spans (about 100
        spans/s on two cores), so a successful export is not yet visible.

        Raises:
            TimeoutError: fewer spans after ``timeout_s`` (the message says how many).
        """
        deadline = time.monotonic() + timeout_s
        got: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            got = self.spans(project)
            if len(got) >= count:
                return got
            time.sleep(poll_s)
        raise TimeoutError(
            f"phoenix project {project!r}: {len(got)} of {count} spans visible after "
            f"{timeout_s:.0f}s; log tail:\n{self.tail(2000)}"
        )


@pytest.fixture(scope="session")
def phoenix() -> Iterator[Phoenix]:
    """A Phoenix server for the whole session (skips the test when Phoenix is not installed)."""
    configured = os.environ.get("COMMSPAN_PHOENIX")
    if configured and not Path(configured).exists():
        pytest.fail(f"COMMSPAN_PHOENIX={configured!r} does not exist; point it at a phoenix "
                    "executable or unset it")
    executable = find_phoenix()
    if executable is None:
        pytest.skip(
            "Arize Phoenix not found: set COMMSPAN_PHOENIX to a phoenix executable, or "
            f"`python -m venv .venv-phoenix && .venv-phoenix/bin/pip install {PINNED}`"
        )
    server = Phoenix(executable)
    try:
        server.start()
        yield server
    finally:
        server.close()
