"""Whole-file writes for the simulator's and CLI's outputs (traces, result JSON, plots, generated docs):
a reader never sees half a file, and a failed write leaves the old file as it was.

``replace_file`` (``FileReplacement`` when the data comes in pieces) writes a sibling ``NAME.tmp`` and renames it over ``NAME``. A failure removes the
sibling and is reported against ``NAME``, the path the user gave (not the ``.tmp`` they never named).
A symlink ``NAME`` has its target replaced (the link stays); a device, FIFO or socket is never
replaced by a file (refused: a rename would swap the node itself, e.g. ``/dev/full``, for a file).
The sidecar's own state files have their own writer with fsync (``controller.snapshot``).
``temporary_directory`` is the scratch directory of a run, removed however the run ends.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from policies.text import error_text


def replace_file(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data``; OSError (naming ``path``) when it cannot be written."""
    out = FileReplacement(path)
    try:
        out.write(data)
        out.commit()
    finally:  # (Ctrl-C mid-write too: it left NAME.tmp beside the file)
        out.discard()


class FileReplacement:
    """``replace_file`` written in pieces, for outputs too large to hold whole: ``NAME.tmp`` opened at
    construction, ``write`` as often as needed, ``commit`` renames it over ``NAME``; ``discard``
    (idempotent, a no-op once committed) removes it, and belongs in a ``finally``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # The rename replaces the node it names: a link's target is what the user means to write.
        real = Path(os.path.realpath(self.path))
        if real.exists() and not real.is_file() and not real.is_dir():
            raise OSError(errno.EINVAL, "is not a regular file", str(self.path))
        self._real = real
        self._tmp = real.with_name(real.name + ".tmp")
        self._f: IO[bytes] | None = None
        self._done = False
        with self._named():
            self._f = self._tmp.open("wb")

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            self.discard()
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def write(self, data: bytes) -> None:
        if self._f is not None:
            with self._named():
                self._f.write(data)

    def commit(self) -> None:
        assert self._f is not None, "commit after discard"
        with self._named():
            self._f.close()
            self._tmp.replace(self._real)
        self._f = None
        self._done = True

    def discard(self) -> None:
        if self._done:
            return
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None
        with contextlib.suppress(OSError):
            self._tmp.unlink()
        self._done = True


#: The signals a run ends on with its clean-up (Ctrl-C; SIGTERM and SIGHUP where the entry point
#: raises KeyboardInterrupt for them, as the benchmarks do).
_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def temporary_directory(*, prefix: str) -> Iterator[str]:
    """``tempfile.TemporaryDirectory(prefix=prefix)`` that a Ctrl-C cannot leave behind: one that
    lands while the directory is made is raised once the ``with`` owns it, and the directory is
    removed. Raised between the ``mkdir`` and the clean-up's registration (a few bytecodes, wider when
    the process is switched out there), it left the directory (seen once in CI: ``sidecar_load``
    interrupted the moment its directory appeared). The Python handlers are swapped for the moment,
    not the signals blocked: a thread's mask does not hold a signal another thread takes. A directory
    that cannot be removed at the end is not the run's error (``ignore_cleanup_errors``)."""
    if threading.current_thread() is not threading.main_thread():  # (handlers run in the main one)
        with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as d:
            yield d
        return
    noted: list[int] = []
    swapped: dict[int, Any] = {}
    try:
        for sig in _STOPS:
            handler = signal.getsignal(sig)
            if callable(handler):  # Python's own (not ignored, not the default, not set outside Python)
                swapped[sig] = handler
                signal.signal(sig, lambda signum, _frame: noted.append(signum))
        with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as d:
            _restore(swapped)
            if noted:
                signal.raise_signal(noted[0])  # (its own handler raises here)
            yield d
    finally:
        _restore(swapped)


def _restore(handlers: dict[int, Any]) -> None:
    while handlers:
        sig, handler = handlers.popitem()
        signal.signal(sig, handler)


def save_figure(fig: Any, path: str | Path, *, dpi: int) -> None:
    """Replace ``path`` with matplotlib's ``fig`` as a PNG (``replace_file``): rendered first, so a
    figure that fails to draw leaves an existing image untouched."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    replace_file(path, buf.getvalue())


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file: links, ``..`` and hard links seen through (one that does not
    exist yet compared by its resolved path). Commands check an output against their inputs with it."""
    with contextlib.suppress(OSError):
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    return Path(a).resolve() == Path(b).resolve()


def missing_directory(path: str | Path) -> Path | None:
    """The directory a file at ``path`` would be written in, when it does not exist (None: it does):
    commands check their output files with it before a long run, not after it."""
    parent = Path(path).resolve().parent
    return None if parent.is_dir() else parent


def unwritable_directory(directory: str | Path) -> str | None:
    """Why no file can be made in the existing ``directory`` (None: one can). A permission check is not
    enough: root passes it for a read-only mount or ``/proc``, where only the attempt fails."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".speccontrol-probe-")
    except OSError as e:
        return error_text(e)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def output_problem(
    flag: str, path: str | Path | None, *, directory: bool = False, suffix: str = "", appended: bool = False
) -> str | None:
    """What is wrong with ``path`` as the output of ``flag`` before a long run (None: nothing, or no
    output asked for, ``path`` None): every command says it in these words, and exits 2 before any
    work rather than 1 after it. A file's path must name a file (not '', '/' or a directory) in a
    directory that exists, ending in ``suffix`` when one is given (plots: the format is the
    extension, so ``x.xyz`` failed after the run and ``x`` became ``x.png``), and an existing one must
    be a regular file (or a link to one): a device, FIFO or socket is refused, as outputs are written
    by replacing the file (``appended``: an output written in place, as a stream, may be a FIFO or
    device); a ``directory`` (made when missing) must not be a file. The directory a file goes in (the
    nearest existing one, for a directory to make) must let a file be made in it: tried, not guessed."""
    if path is None:
        return None
    p = Path(path)
    if not str(path):
        return f"{flag} '': not a {'directory' if directory else 'file'} name"
    if directory:
        if p.exists() and not p.is_dir():
            return f"{flag} {path}: is a file, not a directory"
        # The directory is made with its parents after the run: a file among them failed it only then.
        above = next((a for a in (p.absolute(), *p.absolute().parents) if a.exists()), None)
        if above is not None and above != p.absolute() and not above.is_dir():
            return f"{flag} {path}: {above} is a file, not a directory to make it in"
        why = None if above is None else unwritable_directory(above)
        return None if why is None else f"{flag} {path}: cannot write in {above}: {why}"
    if p.is_dir() or p.name in ("", ".", ".."):
        return f"{flag} {path}: is a directory, not a file"
    if suffix and p.suffix.lower() != suffix:
        return f"{flag} {path}: must name a {suffix} file"
    if p.exists() and not p.is_file() and not appended:
        return f"{flag} {path}: is not a regular file (a device, FIFO or socket): name a file"
    missing = missing_directory(p)
    if missing is not None:
        return f"{flag} {path}: no directory {missing} to write it in"
    if appended and p.exists():
        return None  # written in place (a FIFO, a device, a log): the directory is not touched
    parent = p.resolve().parent
    why = unwritable_directory(parent)
    return None if why is None else f"{flag} {path}: cannot write in {parent}: {why}"


__all__ = ["missing_directory", "output_problem", "replace_file", "same_file", "unwritable_directory"]
