"""Exceptions that carry the CLI exit code they map to.

Exit codes: 0 ok, 1 a check failed (stale outputs, wrong results),
2 bad input (spec, arguments, environment).
"""

from __future__ import annotations


def one_line(text: str) -> str:
    """`text` with every unprintable character escaped (a newline or CR in a file name
    or a key becomes `\\n`, `\\r`): one problem stays one line."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


# How to install what running kernels needs: the extras of pyproject.toml, from the checkout (the
# package is not on the package index). tests/test_pointers.py checks that these extras exist.
CUDA_EXTRAS_HINT = '`pip install ".[cuda13]"` in the tsgen checkout (".[cuda12]" for CUDA 12)'


class TsgenError(Exception):
    """Base class: a message meant for the user and an exit code."""

    exit_code = 2


class SpecError(TsgenError):
    """A spec file is missing, unparsable or invalid.

    ``problems`` holds one ``FILE:LINE:COL: field: what is wrong`` line each.
    """

    def __init__(self, problems: list[str]):
        self.problems = [one_line(p) for p in problems]
        super().__init__("\n".join(problems))


class ToolchainError(TsgenError):
    """nvcc / cuobjdump missing, or a compile failed."""


class RuntimeSetupError(TsgenError):
    """The GPUs, peer access or buffers do not fit what a kernel needs."""


class CheckFailed(TsgenError):
    """A check ran and found a problem (stale output, wrong result)."""

    exit_code = 1


class KernelFailed(CheckFailed):
    """A kernel failed on the GPU (a wait's timeout trapped, a launch failure): the kernel under
    test is broken, so exit 1 as for a wrong result. The CUDA context of that GPU is lost: the
    process can only report and end (tsgen.harness.leave_now)."""
