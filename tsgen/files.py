"""Writing outputs and cache entries: staged beside their target, then renamed into place.

A temporary file is named `.NAME.PID.XXXXXXXX.tmp` after the file it becomes and the
process that writes it, so a later run can tell the leftovers of a killed one (its
process is gone) from the work of one still running, and remove only those. Files get
the mode the umask gives a new file (0666 & ~umask), like any other tool's output.

Folders others may write (the compile cache if its owner let them, /tmp) are where a
planted file or symlink could make tsgen load another user's library or overwrite a
file of its user's. So: `private_folder` is THE check of a folder whose files tsgen
trusts (the compile cache), `unsafe_entry` the same check of one of its files, and
`open_shared` THE way tsgen opens a file it creates in a shared place (the compile
locks, the GPU lock): never through a symlink, never truncating, only a file of its own.
Also here: the folders of a checkout (specs/, suites/) that commands read by default.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from pathlib import Path

from .errors import TsgenError

_TEMP = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.\w+\.tmp(\.\w+)?\Z")  # also nvcc's NAME.tmp.o


def new_file_mode() -> int:
    """0666 minus the umask (os.umask is the only way to read it: set and put back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def new_temp(folder: Path, name: str) -> Path:
    """A new empty temporary file in `folder` named after `name` and this process."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.{os.getpid()}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def stage(path: Path, data: bytes, mode: int | None = None) -> Path:
    """Write `data` to a new temporary file beside `path` (mode `mode`, default new_file_mode());
    its name, for `os.replace`."""
    tmp = new_temp(path.parent, path.name)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, new_file_mode() if mode is None else mode)
    except BaseException:
        tmp.unlink()
        raise
    return tmp


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace `path` with `data` in one rename: a reader sees the old file or the new one."""
    tmp = stage(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def sweep_temps(folder: Path) -> list[Path]:
    """Remove the temporary files in `folder` whose writing process is gone; the removed ones."""
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _TEMP.match(p.name)
        if m and not _alive(int(m.group("pid"))):
            try:
                p.unlink()
                removed.append(p)
            except OSError:
                pass
    return removed


def write_if_different(path: Path, text: str, mode: int | None = None) -> bool:
    """Atomically write `text` (stage's `mode`) unless the file already holds exactly its bytes;
    True if written."""
    data = text.encode()
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_temps(path.parent)  # what a killed run left
    atomic_write(path, data, mode)
    return True


# ---------------------------------------------------------------------------
# Folders and files that others could write
# ---------------------------------------------------------------------------


class UnsafePath(OSError):
    """A folder or file tsgen will not trust: `filename` says which, the message what is wrong."""

    def __init__(self, path: Path, why: str, above: bool = False):
        super().__init__(why)
        self.strerror, self.filename, self.above = why, str(path), above


def _owner_problem(st: os.stat_result, owners: tuple[int, ...]) -> str | None:
    if st.st_uid not in owners:
        return f"owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    return None


def unsafe_entry(st: os.stat_result) -> str | None:
    """Why a file or folder with this status cannot be trusted, or None: it must be this user's
    and writable by no one else (group or others could replace what tsgen loads)."""
    problem = _owner_problem(st, (os.geteuid(),))
    if problem is None and st.st_mode & 0o022:
        problem = f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return problem


def _check_ancestors(folder: Path) -> None:
    """Every folder above `folder` (resolved) may be changed only by this user or root: owned by
    one of them and writable by no one else, unless sticky (/tmp: others cannot rename or
    remove what is not theirs). The rule ssh applies to the folders above ~/.ssh."""
    for parent in folder.parents:
        st = os.stat(parent)
        problem = _owner_problem(st, (os.geteuid(), 0))
        if problem is None and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            problem = f"writable by others and not sticky (mode {stat.S_IMODE(st.st_mode):04o})"
        if problem:
            raise UnsafePath(parent, problem, above=True)


def private_folder(path: Path, top: Path | None = None) -> Path:
    """`path` made if missing (mode 0700, so are the folders made above it) and checked: it and
    every folder between it and `top` (default: `path` alone) are this user's and writable by no
    one else, and the folders above those can be changed only by this user or root. Returns the
    resolved path, which later uses should take: a symlink swapped after the check then changes
    nothing. OSError when it cannot be made; UnsafePath (an OSError) naming what is wrong."""
    path = Path(os.path.abspath(path))
    made = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    for p in reversed(made):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:  # made meanwhile by another process
            pass
    real = Path(os.path.realpath(path))
    top = real if top is None else Path(os.path.realpath(top))
    for folder in (real, *real.parents):
        st = os.stat(folder)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePath(folder, "not a folder")
        problem = unsafe_entry(st)
        if problem:
            raise UnsafePath(folder, problem)
        if folder == top or folder == folder.parent:
            break
    _check_ancestors(top)
    return real


def open_shared(path: Path) -> int:
    """A read-write descriptor of the file `path`, created (mode 0600) if missing: THE way tsgen
    opens a file it makes in a folder others may reach (lock files). The folder must pass
    `_check_ancestors`' rule (this user's or root's, sticky if others may write it); a symlink
    is refused (O_NOFOLLOW), nothing is truncated (no O_TRUNC), and the file must be a regular
    file of this user's with no other name (no hard link to someone's file). OSError / UnsafePath."""
    path = Path(os.path.abspath(path))
    _check_ancestors(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    problem = (None if stat.S_ISREG(st.st_mode) else "not a regular file") or _owner_problem(st, (os.geteuid(),))
    if problem is None and st.st_nlink != 1:
        problem = f"has {st.st_nlink} names (a hard link)"
    if problem:
        os.close(fd)
        raise UnsafePath(path, problem)
    return fd



@contextlib.contextmanager
def held_lock(path: Path):
    """An exclusive flock on the lock file `path` (opened with open_shared) while the block runs:
    THE lock of tsgen's files in shared places (a compile's cache entry, the GPU's turn)."""
    import fcntl

    with os.fdopen(open_shared(path), "r+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

def checkout_folder(name: str, why: str) -> Path:
    """The folder `name` (specs, suites) of the tsgen checkout a command runs in, the working
    directory; TsgenError saying where it looked, and `why` it looked, when there is none."""
    folder = Path(name)
    if not folder.is_dir():
        raise TsgenError(f"no {name}/ folder in {Path.cwd()}: {why}")
    return folder
