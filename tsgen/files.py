"""Writing outputs and cache entries: staged beside their target, then renamed into place.

A temporary file is named `.NAME.PID.XXXXXXXX.tmp` after the file it becomes and the
process that writes it, so a later run can tell the leftovers of a killed one (its
process is gone) from the work of one still running, and remove only those. Files get
the mode the umask gives a new file (0666 & ~umask), like any other tool's output.
Also here: the folders of a checkout (specs/, suites/) that commands read by default.
"""

from __future__ import annotations

import os
import re
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


def stage(path: Path, data: bytes) -> Path:
    """Write `data` to a new temporary file beside `path`; its name, for `os.replace`."""
    tmp = new_temp(path.parent, path.name)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, new_file_mode())
    except BaseException:
        tmp.unlink()
        raise
    return tmp


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` with `data` in one rename: a reader sees the old file or the new one."""
    tmp = stage(path, data)
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


def write_if_different(path: Path, text: str) -> bool:
    """Atomically write `text` unless the file already holds exactly its bytes; True if written."""
    data = text.encode()
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_temps(path.parent)  # what a killed run left
    atomic_write(path, data)
    return True


def checkout_folder(name: str, why: str) -> Path:
    """The folder `name` (specs, suites) of the tsgen checkout a command runs in, the working
    directory; TsgenError saying where it looked, and `why` it looked, when there is none."""
    folder = Path(name)
    if not folder.is_dir():
        raise TsgenError(f"no {name}/ folder in {Path.cwd()}: {why}")
    return folder
