"""What kernels print: a tsgen kernel whose wait times out prints who waited for what (then
traps), through the device printf, which the driver writes to the process's fd 1 through C stdio
at the next synchronization. `device_output` captures it around a launch and a synchronize, so
that a failure's one message can end with it (tsgen.harness, tsgen.torch)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from dataclasses import dataclass


@dataclass
class Printed:
    """What the kernels printed while a `device_output` block ran (set when the block ends)."""

    text: str = ""

    def diagnosis(self) -> str:
        """The printed lines, indented, to end a failure's message with."""
        lines = [line for line in self.text.splitlines() if line.strip()]
        if not lines:
            return "; the kernel printed nothing"
        return "; the kernel printed:\n" + "\n".join(f"    {line}" for line in lines)


@functools.lru_cache(maxsize=1)
def _c_fflush():
    import ctypes

    try:
        return ctypes.CDLL(None).fflush
    except (OSError, AttributeError):
        return None


def flush_stdout() -> None:
    """Python's and C's stdout buffers: the device printf reaches fd 1 through C stdio."""
    sys.stdout.flush()
    if _c_fflush() is not None:
        _c_fflush()(None)


@contextlib.contextmanager
def device_output(echo_through: bool = True):
    """Capture what kernels printf while the block runs, into the Printed it yields;
    `echo_through` then writes it to stdout as well, where it would have gone."""
    printed = Printed()
    flush_stdout()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 1)
        try:
            yield printed
        finally:
            flush_stdout()
            os.dup2(saved, 1)
            os.close(saved)
            captured.seek(0)
            printed.text = captured.read().decode(errors="replace")
            if echo_through and printed.text:
                sys.stdout.write(printed.text)
                sys.stdout.flush()
