"""JSONL span files: one line per exported batch, in OTLP/JSON (optionally gzip'd).

Each line is one ``ExportTraceServiceRequest`` in the OTLP/JSON encoding, the
format the OpenTelemetry Collector's ``file`` exporter writes and its
``otlpjson`` receiver reads, so the files replay into any collector. See
``docs/jsonl.md``. This module writes the files; the encoding and the readers
are in :mod:`commspan.otlpjson`.

Example:
    >>> import tempfile, pathlib
    >>> from commspan.exporters import JsonlSpanExporter
    >>> d = tempfile.mkdtemp()
    >>> exporter = JsonlSpanExporter(pathlib.Path(d) / "trace-rank{rank}.jsonl")
    >>> exporter.shutdown()
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import logging
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from commspan import semconv
from commspan._errors import Once, file_in_the_way
from commspan._fork import renew_after_fork
from commspan.capture.ranks import process_ranks
from commspan.otlpjson.encode import encode_lines
from commspan.otlpjson.files import starts_compressed

__all__ = ["DEFAULT_FILENAME", "JsonlSpanExporter"]

_log = logging.getLogger(__name__)
DEFAULT_FILENAME = "commspan-rank{rank}.jsonl"


class JsonlSpanExporter(SpanExporter):
    """Write spans to a JSONL file, one OTLP/JSON request per line.

    Each ``export`` call appends one whole line with a single ``write``. The
    file never gets a line appended after a partial one: a file that does not
    end in a newline when opened (an earlier writer crashed mid-line) gets a
    newline first, and a write cut short (a full disk) is truncated back to
    where its line began. The file is checked once per batch: if it was
    deleted or replaced (its directory removed mid-run), it is created again
    and the event logged once. An export that did not write its whole line
    returns ``FAILURE``, so its spans are counted as failed, never exported.

    Args:
        path: file to append to, or a directory (the file is then
            ``commspan-rank{rank}.jsonl`` inside it). A path that exists as a
            directory, ends in ``/``, or has neither a suffix nor a ``{rank}``
            field (``"commspan-out"``) is a directory. ``{rank}`` and
            ``{run_id}`` in a file name are filled from the first spans'
            resource, so every rank writes its own file.
        fsync: also ``fsync`` after every line (durable, slower).
        compress: write each line as its own gzip member (``True``: zlib level 1;
            or a level from 1 to 9): about a tenth of the bytes for a millisecond
            of the export thread's CPU per step of the medium model
            (docs/performance.md). The file is then a valid ``.gz`` file of the same
            lines (``zcat`` shows them); the default file name of a directory ends
            in ``.jsonl.gz``. Every commspan reader reads both kinds, and a line
            cut short by a crash costs that line only, as in a plain file.
        digest: also append, for each line, a digest line to ``<file>.digest``:
            the counts, collectives and steps of the line's spans, folded per rank
            and trace, so that ``Aggregator.from_jsonl`` and ``commspan
            summary``/``table``/``check`` read a thousand-rank run in seconds
            (docs/jsonl.md, "Digests"). Readers check each digest line against
            the JSONL line it stands for and parse the lines it does not cover;
            the JSONL file stays complete on its own. Costs the export thread
            0.2-0.3 ms and 2.5 kB per step of the medium model.

    Raises:
        TypeError: ``path`` is not a str or path.
        ValueError: ``path`` has a field other than ``{rank}`` and
            ``{run_id}`` (``"trace-{rnak}.jsonl"``) or an unpaired brace; it names a
            directory (no suffix) that exists and is not one, or lies below a file.

    Example:
        >>> from commspan import CommSpanMode
        >>> from commspan.exporters import JsonlSpanExporter
        >>> mode = CommSpanMode(exporters=[JsonlSpanExporter("/tmp/commspan-doc")])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = False,
        compress: bool | int = False,
        digest: bool = False,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"path={path!r} is not valid; pass a file path or a directory (str or Path)"
            )
        text = os.fspath(path)
        if isinstance(text, str) and "{" not in text and os.path.exists(text) \
                and not os.path.isdir(text) and _is_directory(text):
            # a name without a suffix means a directory of rank files: this one exists
            # and is not a directory (a device such as /dev/full, a file), so every
            # export would fail; say so now rather than at the first span
            raise ValueError(
                f"path={text!r} is not valid: it names a directory (no suffix) but exists "
                "and is not one; pass a directory, or a file path with a suffix "
                "(e.g. 'out/rank{rank}.jsonl')")
        blocking = file_in_the_way(text) if isinstance(text, str) else None
        if blocking is not None:  # (every export would fail: no directory can be made)
            raise ValueError(
                f"path={text!r} is not valid: {blocking!r} is a file, not a directory, so "
                "nothing can be written below it; pass a directory (or a file path) elsewhere")
        if compress is True:
            level = 1
        elif compress is False:
            level = 0
        elif isinstance(compress, int) and 1 <= compress <= 9:
            level = compress
        else:
            raise ValueError(
                f"compress={compress!r} is not valid; pass True (gzip level 1), False, or "
                "a gzip level from 1 (fastest) to 9 (smallest)"
            )
        for name, flag in (("fsync", fsync), ("digest", digest)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r} is not valid; pass True or False")
        self._template = os.fspath(path)
        _check_template(self._template)
        self.digest = digest
        """Whether a digest line follows each line, in ``<file>.digest``."""
        self._digest_fd: int | None = None
        self._digest_texts: Any = None
        self._digest_torn = False  # the last digest line was cut short by a short write
        self._fsync = fsync
        self.compress_level = level
        """The gzip level each line is written with; 0: not compressed."""
        self._fd: int | None = None
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")  # the export thread holds it while it writes
        self._closed = False
        self._file_id: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file held open
        self._size = 0  # where the next line starts, as last seen
        self._fresh_line = False  # the next line must begin with a newline
        self._warned = Once()
        self.path: Path | None = None
        self._path_str = ""
        self._path_resource: Any = None  # the resource self.path was chosen for
        self.lines_written = 0
        self.bytes_written = 0

    def _path_for(self, first: ReadableSpan) -> Path:
        res = first.resource.attributes if first.resource is not None else {}
        rank = res.get(semconv.RANK)
        if rank is None:
            rank = process_ranks().rank
        run_id = res.get(semconv.RUN_ID, "run")
        template = self._template
        if _is_directory(template):
            name = DEFAULT_FILENAME + ".gz" if self.compress_level else DEFAULT_FILENAME
            template = os.path.join(template, name)
        return Path(template.format(rank=rank, run_id=run_id))

    def _follow_rank(self, first: ReadableSpan) -> int | None:
        """Spans of another resource than the file's: a file holds one rank's spans,
        so when the path's ``{rank}`` or ``{run_id}`` now reads otherwise (a mode
        that learnt its rank once the process group came up), the file is left for
        the one at that path. Returns the descriptor to write to (``None``: open)."""
        self._path_resource = first.resource
        try:
            path = self._path_for(first)
        except (ValueError, KeyError, IndexError, AttributeError, TypeError):
            return self._fd
        if path == self.path:
            return self._fd
        self._close_fd()
        self.path = None
        return None

    def _open(self, first: ReadableSpan) -> int | None:
        """Open (or create again) the file; ``None``, logged once, if it cannot be."""
        try:
            path = self.path if self.path is not None else self._path_for(first)
            self.path, self._path_str = path, str(path)
            self._path_resource = first.resource
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except (OSError, ValueError, KeyError, IndexError, AttributeError, TypeError) as exc:
            self._warn_once(
                "open", "commspan: JsonlSpanExporter cannot open %s (%s: %s); its spans are "
                "counted as failed until it can (not logged again)",
                self.path if self.path is not None else self._template, type(exc).__name__, exc,
            )
            return None
        st = os.fstat(fd)
        if st.st_size > 0:
            packed = starts_compressed(path)
            if packed is not None and packed != bool(self.compress_level):
                # a mix of plain and gzip'd lines is unreadable: write nothing there
                os.close(fd)
                self._warn_once(
                    "format", "commspan: %s holds %s lines and this JsonlSpanExporter "
                    "writes %s ones (compress=%s); a mix cannot be read, so nothing is "
                    "appended and its spans are counted as failed: pass another path, or "
                    "compress=%s (not logged again)", path,
                    "compressed" if packed else "plain", "plain" if packed else "compressed",
                    bool(self.compress_level), packed,
                )
                return None
        if self.digest:
            self._open_digest(path, fresh=st.st_size == 0)
        self._fd = fd
        self._file_id = (st.st_dev, st.st_ino)
        self._size = st.st_size
        # a compressed line cut short needs nothing: readers resume at the next member
        self._fresh_line = (
            not self.compress_level
            and st.st_size > 0
            and not _ends_in_newline(path, st.st_size)
        )
        if self._fresh_line:
            _log.warning(
                "commspan: %s does not end in a newline (an earlier writer stopped "
                "mid-line); appending from a new line, readers report the partial line "
                "as damaged", path,
            )
        return fd

    def _file_is_there(self) -> bool:
        """Whether the path still names the file held open (one ``stat`` per batch);
        also notes where the next line starts."""
        try:
            st = os.stat(self._path_str)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:  # cannot tell (a directory made unreadable): keep writing
            return True
        if (st.st_dev, st.st_ino) != self._file_id:
            return False
        self._size = st.st_size
        return True

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Append one line holding ``spans``.

        Returns:
            ``SUCCESS`` once the whole line is written; ``FAILURE`` after
            ``shutdown``, or when the file cannot be opened or the line was not
            (wholly) written: nothing of that line is left in the file.
        """
        if not spans:
            return SpanExportResult.SUCCESS
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            fd = self._fd
            if fd is not None and spans[0].resource is not self._path_resource:
                fd = self._follow_rank(spans[0])
            if fd is not None and not self._file_is_there():
                self._warn_once(
                    "gone", "commspan: %s was deleted or replaced while being written; "
                    "writing to a new file at that path (lines written before went with "
                    "the old file; not logged again)", self.path,
                )
                self._close_fd()
                fd = None
            if fd is None:
                fd = self._open(spans[0])
                if fd is None:
                    return SpanExportResult.FAILURE
            # the collector stays as the training loop set it (no gc.disable() here:
            # it is process-wide, and pausing it bought nothing measurable)
            data = encode_lines(spans, b"\n")
            if self.compress_level:  # one member per line, self-contained (mtime 0)
                data = gzip.compress(data, self.compress_level, mtime=0)
            if self._fresh_line:
                data = b"\n" + data
            start = self._size
            written = 0
            try:
                view = memoryview(data)
                while written < len(data):
                    n = os.write(fd, view[written:])
                    if n <= 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    written += n
                if self._fsync:
                    os.fsync(fd)
            except OSError as exc:
                if written == len(data):  # whole line written, fsync failed
                    self._fresh_line = False
                    what = "not fsynced"
                elif self._undo(fd, start, written):
                    what = "removed from the file"
                else:
                    what = ("left cut short in the file (readers skip it as a damaged "
                            "line)")
                self._warn_once(
                    "write", "commspan: writing %s failed (%s); the line was %s and its "
                    "spans are counted as failed (further failures are counted, not logged)",
                    self.path, exc, what,
                )
                return SpanExportResult.FAILURE
            self._fresh_line = False
            self._size = start + written
            self.lines_written += 1
            self.bytes_written += len(data)
            if self._digest_fd is not None:
                lead = 1 if data[:1] == b"\n" else 0
                self._write_digest(spans, data, start + lead, lead)
        return SpanExportResult.SUCCESS

    def _open_digest(self, path: Path, fresh: bool) -> None:
        """Open ``<file>.digest`` for appending (emptied when the JSONL file is new: its
        lines would not match); a digest that cannot be opened only costs speed."""
        from commspan.analysis.digest import DigestTexts

        self._close_digest()
        self._digest_texts = DigestTexts()
        side = os.fspath(path) + ".digest"
        self._digest_torn = False
        if not fresh:  # a digest cut short by a crash: its last line is ended first
            with contextlib.suppress(OSError), open(side, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                self._digest_torn = fh.read(1) != b"\n"
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        try:
            self._digest_fd = os.open(side, flags | (os.O_TRUNC if fresh else 0), 0o644)
        except OSError as exc:
            self._warn_once(
                "digest", "commspan: cannot write the digest %s (%s); readers parse the "
                "JSONL file instead (not logged again)", side, exc,
            )

    def _write_digest(self, spans: Sequence[ReadableSpan], data: bytes, offset: int,
                      lead: int) -> None:
        # the one import of analysis from here: the digest folds spans as readers do
        from commspan.analysis.digest import DigestTexts, digest_line, span_records

        assert self._digest_fd is not None
        line = b""
        written = 0
        try:
            line = digest_line(span_records(spans), memoryview(data)[lead:], offset,
                               len(spans), self._digest_texts)
            if self._digest_torn:  # the last line was cut short: end it, start afresh
                os.write(self._digest_fd, b"\n")
                self._digest_torn = False
            written = os.write(self._digest_fd, line)
            if written != len(line):
                raise OSError(f"wrote {written} of its {len(line)} bytes")
        except Exception as exc:  # never fail an export for its digest
            # the texts this line defined are not in the file: later lines define them
            # again (else they would name texts no line defines, and be parsed too);
            # a line cut short is ended before the next
            self._digest_texts = DigestTexts()
            self._digest_torn = self._digest_torn or 0 < written < len(line)
            self._warn_once(
                "digest", "commspan: a digest line for %s could not be written (%s: %s); "
                "readers parse the lines it misses (not logged again)",
                self.path, type(exc).__name__, exc,
            )

    def _close_digest(self) -> None:
        if self._digest_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._digest_fd)
            self._digest_fd = None

    def _undo(self, fd: int, start: int, written: int) -> bool:
        """After a short write, cut the file back to where the line began; if that is
        not certain to remove only this line's bytes, start the next line afresh.
        Returns whether the file holds none of the line's bytes."""
        if written == 0:
            return True
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size == start + written:
                os.ftruncate(fd, start)
                return True
        except OSError:
            pass
        self._fresh_line = True
        return False

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        self._warned.warn(_log, kind, message, *args)

    def _close_fd(self) -> None:
        self._close_digest()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Lines are written unbuffered; nothing to flush."""
        return True

    def shutdown(self) -> None:
        """Close the file; later exports fail."""
        with self._lock:
            self._closed = True
            self._close_fd()


_FIELDS = ("rank", "run_id")


def _check_template(template: str) -> None:
    """Reject a path whose fields ``_open`` could not fill, before any span is lost."""
    try:
        template.format(rank=0, run_id="run")
    except KeyError as exc:
        problem = f"unknown field {{{exc.args[0]}}}"
    except IndexError:
        problem = "a positional field ({} or {0})"
    except (ValueError, AttributeError, TypeError) as exc:
        problem = str(exc)
    else:
        return
    raise ValueError(
        f"path={template!r} is not a valid file-name template: {problem}; the fields are "
        "{rank} and {run_id} (write {{ or }} for a literal brace)"
    )


def _ends_in_newline(path: Path, size: int) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # cannot tell: a spare newline only makes an empty line
        return False
    try:
        return os.pread(fd, 1, size - 1) == b"\n"
    except OSError:
        return False
    finally:
        os.close(fd)


def _is_directory(template: str) -> bool:
    """A directory, a path ending in a separator, or a name with neither a
    suffix nor a ``{rank}`` field (``"commspan-out"``) means: one file per rank
    inside it."""
    if template.endswith(("/", os.sep)) or os.path.isdir(template):
        return True
    name = os.path.basename(template)
    return "{" not in name and not os.path.splitext(name)[1]

