"""Writing files and folders all-or-nothing, with the mode the umask gives.

Every file the project writes (resolved config, metrics rotation, exit status, exports,
prepared data, sweep and analysis outputs) goes through this module:

* ``atomic_path(path)`` yields a temporary name in ``path``'s folder for a library that
  writes to a path (``safetensors.save_file``, ``pyarrow.parquet.write_table``,
  ``savefig``); on success the file is flushed to disk (``fsync``), given the mode
  ``0o666 & ~umask`` (a ``mkstemp`` file is 0600) and renamed over ``path``
  (``os.replace``); on any error the temporary file is removed and ``path`` is untouched.
* ``atomic_open``, ``write_text``, ``write_bytes`` are the same for a file handle or a
  whole text / byte string.
* ``atomic_folder(path)`` is the same for a folder filled file by file (prepared data):
  the files are written into a temporary sibling folder that is renamed to ``path`` at
  the end, so ``path`` exists only when it is complete.
* ``check_output_folder(path, setting)`` tells, before anything expensive runs, whether
  a folder can be created and written (not read-only, not under a regular file).
* ``check_new_outputs(paths, overwrite)`` refuses, before anything expensive runs, to replace
  the results of an earlier command (a figure, a table) unless the command was asked to
  (``--overwrite``); ``remove_stale_outputs`` then removes what an overwritten run left that
  this one did not write again (a figure it no longer draws).

A failed write raises ``WriteError`` (a ``UserError`` and an ``OSError``) naming the file,
the OS error and, when the disk is full, the free space left. This module is the one owner of
recognising such failures (``os_error_of``): libraries that write report them in their own
exceptions (safetensors' ``SafetensorError: ... No space left on device (os error 28)``, DCP's
``CheckpointException`` over per-rank failures, tensorboard's writer thread, pyarrow's
``OSError`` with its own text), and every writer turns them into the same one-line
``WriteError``: ``atomic_path`` / ``atomic_folder`` for files written whole, ``writing(path)``
for files a library writes in place (event files, appended logs). This module imports nothing
of the project but the errors, so every layer can use it.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Optional

from mhar_titan.errors import UserError

__all__ = ["WriteError", "OutputFolderError", "umask", "file_mode", "folder_mode", "free_bytes", "os_error_text",
           "os_error_of", "write_error", "writing", "swallowed_write_error", "atomic_path", "atomic_open",
           "write_text", "write_bytes", "atomic_folder", "check_output_folder", "OutputExistsError", "OVERWRITE_FLAG",
           "check_new_outputs", "remove_stale_outputs"]


class WriteError(UserError, OSError):
    """A file or folder could not be written (disk full, read-only, permissions); nothing half-written is left."""


class OutputFolderError(UserError, OSError):
    """An output folder cannot be created or written (read-only, under a regular file, no permission)."""


class OutputExistsError(UserError, FileExistsError):
    """A command would replace an earlier command's results (``check_new_outputs``)."""


OVERWRITE_FLAG = "--overwrite"
"""The flag with which a command that writes results replaces those of an earlier run of it."""


_umask_lock = threading.Lock()


def umask() -> int:
    """The process's umask (read from ``/proc/self/status`` on Linux, else set and restored under a lock)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _umask_lock:
        old = os.umask(0o022)
        os.umask(old)
    return old


def file_mode() -> int:
    """``0o666 & ~umask``: the mode ``open(path, "w")`` would give a new file."""
    return 0o666 & ~umask()


def folder_mode() -> int:
    """``0o777 & ~umask``: the mode ``mkdir`` would give a new folder."""
    return 0o777 & ~umask()


def free_bytes(path: str | os.PathLike) -> Optional[int]:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent); None when unknown."""
    path = Path(path)
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def os_error_text(e: OSError, path: Path, needed: Optional[int] = None) -> str:
    """One phrase for an OS error met writing under ``path``: the disk-full case names the free space
    (and ``needed`` bytes when known), the others the OS's own words and errno name."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path)
        need = f"; it needed about {needed:,} bytes" if needed is not None else ""
        left = f" ({free:,} bytes free)" if free is not None else ""
        return (f"the disk is full{left}{need} ({errno.errorcode.get(e.errno, e.errno)}): free space there, "
                f"or write to another filesystem")
    if e.errno == errno.EROFS:
        return "the filesystem is read-only (EROFS): write to a writable folder"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied ({errno.errorcode[e.errno]}): write to a folder you may write, or fix its mode"
    name = errno.errorcode.get(e.errno, "no errno") if e.errno is not None else "no errno"
    return f"{e.strerror or e} ({name})"


_TEXT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)
_ERRNO_IN_TEXT = re.compile(r"(?:os error|errno)\s*(\d+)", re.IGNORECASE)


def _errno_in_text(text: str) -> Optional[int]:
    """The errno a library's own message names (``(os error 28)``, ``[errno 28]``, or the OS's words
    for a full disk, a quota, a read-only filesystem, a permission or an I/O error), or None."""
    found = _ERRNO_IN_TEXT.search(text)
    if found and int(found.group(1)) in errno.errorcode:
        return int(found.group(1))
    return next((n for n in _TEXT_ERRNOS if os.strerror(n).lower() in text.lower()), None)


_STREAM_WRITE_FAILURE = re.compile(r"unexpected pos \d+ vs \d+|iostream error|PytorchStreamWriter failed", re.I)
"""torch's zip writer (``torch.save``, DCP's files) on a short write: a ``RuntimeError`` without errno."""

NEARLY_FULL_BYTES = 1 << 20
"""Free space below which a write failure that names no errno is taken for a full disk."""


def os_error_of(e: BaseException, path: Optional[str | os.PathLike] = None) -> Optional[OSError]:
    """The OS error behind ``e``, or None when ``e`` is not about the OS (a bug: re-raise it).

    Looked for in ``e`` and its causes and contexts, DCP's per-rank failures
    (``CheckpointException.failures``) and exception groups: the first ``OSError`` with an errno,
    else the errno a library's exception names in its text (safetensors' ``SafetensorError: ...
    No space left on device (os error 28)``) as an ``OSError`` of that errno, else, for torch's
    zip writer's short write (``RuntimeError: ... unexpected pos``, no errno) while writing
    ``path``: ENOSPC when the filesystem there has less than ``NEARLY_FULL_BYTES`` free, EIO otherwise.
    """
    seen: set[int] = set()
    todo, named, short_write = [e], None, False
    while todo:
        err = todo.pop(0)
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return err
        if named is None and not isinstance(err, (KeyboardInterrupt, SystemExit)):
            number = _errno_in_text(str(err))
            if number is not None:
                named = OSError(number, os.strerror(number))
            short_write = short_write or bool(_STREAM_WRITE_FAILURE.search(str(err)))
        failures = getattr(err, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            for f in failures.values():
                todo.append(f[0] if isinstance(f, tuple) and f else f)
        for f in getattr(err, "exceptions", ()) or ():  # an ExceptionGroup
            todo.append(f)
        todo += [err.__cause__, err.__context__]
    if named is None and short_write and path is not None:
        free = free_bytes(path)
        number = errno.ENOSPC if free is not None and free < NEARLY_FULL_BYTES else errno.EIO
        named = OSError(number, os.strerror(number))
    return named


def write_error(e: BaseException, path: str | os.PathLike) -> Optional[WriteError]:
    """The one-line ``WriteError`` for a failed write of ``path`` (``cannot write PATH: ...``, the
    disk-full case naming the free space), or None when ``e`` is not an OS failure (or is a
    ``UserError`` of the caller's other than ``WriteError``)."""
    if isinstance(e, WriteError):
        return e
    if isinstance(e, (UserError, KeyboardInterrupt, SystemExit, GeneratorExit)):  # a refusal, an interrupt
        return None
    err = os_error_of(e, path)
    if err is None:
        return None
    return WriteError(f"cannot write {path}: {os_error_text(err, Path(path))}")


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Around a library that writes ``path`` (a file or folder) in place (an event file, an appended
    log, a results file): an OS failure raised inside, in whatever exception the library uses,
    becomes ``WriteError`` (``write_error``); other errors propagate unchanged. What the library
    already wrote stays (it is not a whole-file write: use ``atomic_path`` where it can be one).

    Raises:
        WriteError: the library failed on an OS error (disk full, read-only, permissions).
    """
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = write_error(e, path)
        if error is None:
            raise
        raise error from None


def swallowed_write_error(path: str | os.PathLike, logged: str) -> WriteError:
    """The ``WriteError`` for a library that caught its own failed write of ``path`` and only logged
    it (``logged``: what it logged, e.g. lm-eval's ``Could not save results aggregated``): the OS
    error its log names, else a full disk when the filesystem there has less than
    ``NEARLY_FULL_BYTES`` free, else the log's own words."""
    path = Path(path)
    err = os_error_of(RuntimeError(logged), path)
    free = free_bytes(path)
    if err is None and free is not None and free < NEARLY_FULL_BYTES:
        err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    why = os_error_text(err, path) if err is not None else logged.strip() or "the library did not say why"
    return WriteError(f"cannot write {path}: {why}")


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on leaving without error it replaces ``path`` atomically.

    The caller (or the library it calls) creates and writes the yielded file; this then
    ``fsync``s it, sets its mode to ``0o666 & ~umask`` and ``os.replace``s it over ``path``.

    Raises:
        WriteError: an OS failure while writing (an ``OSError``, or a library's exception over one,
            ``os_error_of``), syncing or renaming (the temporary file is removed, ``path`` keeps its
            earlier content). Other errors propagate unchanged, also after removing the temporary file.
    """
    path = Path(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise WriteError(f"cannot write {path}: {os_error_text(e, path.parent)}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        try:
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(tmp, file_mode())
            os.replace(tmp, path)
        except BaseException as e:  # an OSError, or a library's own exception over one (SafetensorError, DCP's)
            error = write_error(e, path)
            if error is None:
                raise
            raise error from None
    finally:
        tmp.unlink(missing_ok=True)  # gone already after the rename
    _fsync_folder(path.parent)


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """``open(path, mode)`` ("w" or "wb") on a temporary file that replaces ``path`` when the block
    ends without error (``atomic_path``). Raises ``WriteError`` like ``atomic_path``."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    with atomic_path(path) as tmp:
        try:
            f = open(tmp, mode, **kwargs)
        except OSError as e:
            raise WriteError(f"cannot write {path}: {os_error_text(e, Path(path).parent)}") from None
        with f:
            yield f
            f.flush()


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` all-or-nothing (``atomic_path``). Raises ``WriteError``."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` all-or-nothing (``atomic_path``). Raises ``WriteError``."""
    with atomic_open(path, "wb") as f:
        f.write(data)


@contextmanager
def atomic_folder(path: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling folder of ``path``; when the block ends without error it is
    renamed to ``path`` (mode ``0o777 & ~umask``, its files ``0o666 & ~umask``, all ``fsync``ed).

    ``path`` must not exist, or be an empty folder, unless ``replace``: then a complete earlier
    folder is swapped out only after the new one is complete. On any error (also Ctrl-C) the
    temporary folder is removed and ``path`` is as before.

    Raises:
        WriteError: ``path`` exists (not empty, without ``replace``), or an OS failure while writing
            (an ``OSError``, or a library's exception over one, ``os_error_of``).
    """
    path = Path(path)
    if path.exists() and not replace and (not path.is_dir() or any(path.iterdir())):
        raise WriteError(f"{path} already exists and is not empty; delete or move it first, or choose another "
                         "output folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as e:
        raise WriteError(f"cannot write {path}: {os_error_text(e, path.parent)}") from None
    old = None
    try:
        try:
            yield tmp
            for child in tmp.rglob("*"):
                if child.is_file():
                    os.chmod(child, file_mode())
                    with open(child, "rb") as f:
                        os.fsync(f.fileno())
                elif child.is_dir():
                    os.chmod(child, folder_mode())
            os.chmod(tmp, folder_mode())
            _fsync_folder(tmp)
            if path.is_dir() and any(path.iterdir()):
                old = path.with_name(f".{path.name}.old-{os.getpid()}")
                os.replace(path, old)
            elif path.is_dir():
                path.rmdir()
            os.replace(tmp, path)
        except BaseException as e:  # an OSError, or a library's own exception over one (SafetensorError, DCP's)
            if old is not None and not path.exists():
                os.replace(old, path)
                old = None
            error = write_error(e, path)
            if error is None:
                raise
            raise WriteError(str(error).replace(str(tmp), str(path))) from None  # name the folder asked for
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    _fsync_folder(path.parent)


def check_output_folder(path: str | os.PathLike, setting: str) -> None:
    """Check that folder ``path`` (named by ``setting`` in messages) exists or can be created, and can be
    written: a probe file is created and removed in it, or in its nearest existing parent when it
    does not exist yet (nothing is left behind).

    Raises:
        OutputFolderError: ``path`` or a parent is a regular file, or the folder is read-only or
            not writable (the message names the folder, the problem and the fix).
    """
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "is a regular file" if existing == path else f"is under the regular file {existing}"
        raise OutputFolderError(f"{setting}: {path} {where}, not a folder; choose a folder path")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        verb = "cannot be written" if existing == path else f"cannot be created in {existing}"
        raise OutputFolderError(f"{setting}: {path} {verb}: {os_error_text(e, existing)}") from None


def check_new_outputs(paths, overwrite: bool, elsewhere: str = "--out DIR") -> None:
    """Refuse to replace earlier results: the files and folders a command is about to write
    (``paths``, all of them, before anything is computed) must not exist yet, unless ``overwrite``
    (the command's ``OVERWRITE_FLAG``). ``elsewhere`` names the command's other way out (another
    output folder).

    Raises:
        OutputExistsError: one line naming the first path that exists (and how many more), that
            nothing was written, and both ways out.
    """
    if overwrite:
        return
    existing = [Path(p) for p in paths if Path(p).exists()]
    if existing:
        more = f" (and {len(existing) - 1} more of its outputs)" if len(existing) > 1 else ""
        raise OutputExistsError(f"{existing[0]} already exists{more}: it holds the results of an earlier run of this "
                                f"command, which are kept (nothing was written); pass {OVERWRITE_FLAG} to replace "
                                f"them, or {elsewhere} to write elsewhere")


def remove_stale_outputs(candidates, written) -> list[Path]:
    """Remove the files of ``candidates`` (every file a command may write) that this run did not
    write (``written``): an overwritten run's outputs that would otherwise sit beside the new ones
    (a figure the new run does not draw). Returns the removed paths."""
    kept = {Path(p) for p in written}
    removed = []
    for path in map(Path, candidates):
        if path not in kept and path.is_file():
            path.unlink()
            removed.append(path)
    return removed
