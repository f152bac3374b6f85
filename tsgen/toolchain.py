"""Finding and driving the CUDA toolchain: nvcc, ptxas, cuobjdump.

nvcc is looked up on PATH, then in CUDA_HOME / CUDA_PATH, then in the pip
``nvidia-cuda-nvcc`` wheel. cuobjdump likewise, with the pip
``nvidia-cuda-cuobjdump`` wheel as the fallback that works on machines with
no CUDA install.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ToolchainError

DEFAULT_ARCH = "sm_90a"

_INSTALL_HINT = {
    "nvcc": "install the CUDA toolkit and put its bin/ on PATH, set CUDA_HOME, "
    "or `pip install nvidia-cuda-nvcc`",
    "cuobjdump": "install the CUDA toolkit, set CUDA_HOME, or "
    "`pip install nvidia-cuda-cuobjdump`",
    "ptxas": "install the CUDA toolkit and put its bin/ on PATH, set CUDA_HOME, "
    "or `pip install nvidia-cuda-nvcc`",
}


def _wheel_bin_dirs() -> list[Path]:
    """bin/ folders of the pip ``nvidia-*`` CUDA wheels (cu12 and cu13 layouts)."""
    dirs: list[Path] = []
    try:
        import nvidia  # namespace package of the pip CUDA wheels
    except ImportError:
        return dirs
    for root in getattr(nvidia, "__path__", []):
        root = Path(root)
        dirs += sorted(root.glob("cu*/bin"))  # nvidia/cu13/bin/nvcc
        dirs += sorted(root.glob("cuda_*/bin"))  # nvidia/cuda_nvcc/bin/nvcc (cu12)
    return dirs


def find_tool(name: str) -> Path:
    """Path of a CUDA tool, or ToolchainError saying how to get one."""
    found = shutil.which(name)
    if found:
        return Path(found)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / name).is_file():
            return Path(home) / "bin" / name
    for d in _wheel_bin_dirs():
        if (d / name).is_file():
            return d / name
    raise ToolchainError(
        f"{name} not found on PATH, in CUDA_HOME/CUDA_PATH, or in the pip CUDA wheels; "
        + _INSTALL_HINT.get(name, "install the CUDA toolkit")
    )


def find_nvcc() -> Path:
    return find_tool("nvcc")


def find_ptxas() -> Path:
    return find_tool("ptxas")


def find_cuobjdump() -> Path:
    return find_tool("cuobjdump")


def gencode_flags(arch: str) -> list[str]:
    """`-gencode` form: sm_90a needs it (the -arch shorthand also runs a plain pass)."""
    m = re.fullmatch(r"sm_(\d+[a-z]?)", arch)
    if not m:
        raise ToolchainError(f"arch {arch!r} is not of the form sm_90a / sm_90 / sm_100a")
    return [f"-gencode=arch=compute_{m.group(1)},code={arch}"]


# ---------------------------------------------------------------------------
# Compiling generated sources
# ---------------------------------------------------------------------------

# Unused static helpers (177) are expected: every source inlines the whole helper layer.
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-Xptxas", "-v", "-Werror", "all-warnings", "-diag-suppress", "177"]


def cache_dir() -> Path:
    root = os.environ.get("TSGEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tsgen"
    )
    return Path(root)


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 else "unknown"


_FUNC = re.compile(r"Function properties for (\S+)")
# nvcc -dlink -Xnvlink -v: the linked kernels' resources
_NVLINK_FUNC = re.compile(r"nvlink info\s*: Function properties for '(\S+)':")
_NVLINK_USE = re.compile(r"nvlink info\s*: used (\d+) registers.*?(\d+) stack.*?(\d+) bytes lmem")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_report(text: str) -> dict[str, dict[str, int]]:
    """Per-function registers, stack frame and spills from `ptxas -v` output."""
    report: dict[str, dict[str, int]] = {}
    current = None
    entry = None
    linked = None
    for line in text.splitlines():
        if m := _NVLINK_FUNC.search(line):
            linked = m.group(1)
            continue
        if (m := _NVLINK_USE.search(line)) and linked:
            report.setdefault(linked, {}).update(
                linked_registers=int(m.group(1)), linked_stack=int(m.group(2)), linked_lmem=int(m.group(3)))
            linked = None
            continue
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            entry = m.group(1)
            report.setdefault(entry, {})
        elif m := _FUNC.search(line):
            current = m.group(1)
            report.setdefault(current, {})
        elif (m := _FRAME.search(line)) and current:
            report[current].update(
                stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
        elif (m := re.search(r"Used (\d+) registers", line)) and entry:
            report[entry]["registers"] = int(m.group(1))
    return report


def _spec_of(source: Path) -> str:
    """The spec a generated source came from, read off its banner."""
    try:
        head = source.read_text(encoding="utf-8")[:300]
    except OSError:
        return "?"
    m = re.search(r"Generated by tsgen \S+ from (\S+)", head)
    return m.group(1) if m else "?"


# ---------------------------------------------------------------------------
# Device libraries (-rdc=true + device link): NVSHMEM
# ---------------------------------------------------------------------------

# Device library name -> (header that marks its include/, archive in its lib/, pip install hint)
DEVICE_LIBS = {
    "nvshmem": ("nvshmem.h", "libnvshmem_device.a",
                "`pip install nvidia-nvshmem-cu13` (CUDA 13) or `pip install nvidia-nvshmem-cu12` (CUDA 12), "
                "or set NVSHMEM_HOME to an NVSHMEM install"),
}


@dataclass(frozen=True)
class DeviceLib:
    name: str
    include: Path  # -I
    archive: Path  # lib<name>_device.a, linked with nvcc -dlink

    @property
    def link_flags(self) -> list[str]:
        lib = self.archive.name[3:-2]  # libnvshmem_device.a -> nvshmem_device
        return [f"-L{self.archive.parent}", f"-l{lib}"]


def _device_lib_roots(name: str) -> list[Path]:
    """Where an install of `name` may live: $NVSHMEM_HOME, then the pip wheels
    (nvidia/nvshmem/{include,lib} in nvidia-nvshmem-cu12 and -cu13)."""
    roots: list[Path] = []
    home = os.environ.get(f"{name.upper()}_HOME")
    if home:
        roots.append(Path(home))
    try:
        import nvidia  # namespace package of the pip CUDA wheels
    except ImportError:
        return roots
    for base in getattr(nvidia, "__path__", []):
        base = Path(base)
        roots += [base / name] + sorted(base.glob(f"cu*/{name}")) + sorted(base.glob("cu*"))
    return roots


def find_device_lib(name: str) -> DeviceLib:
    """include/ and lib<name>_device.a of a device library, or ToolchainError saying how to get them."""
    if name not in DEVICE_LIBS:
        raise ToolchainError(f"unknown device library {name!r}; known: {', '.join(sorted(DEVICE_LIBS))}")
    header, archive, hint = DEVICE_LIBS[name]
    for root in _device_lib_roots(name):
        inc, lib = root / "include", root / "lib" / archive
        if (inc / header).is_file() and lib.is_file():
            return DeviceLib(name, inc, lib)
    raise ToolchainError(f"{name}: {header} and {archive} not found ({name.upper()}_HOME, pip wheels); {hint}")


def _file_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest().encode()


@functools.lru_cache(maxsize=None)
def _tree_digest(folder: Path) -> bytes:
    """Digest of the files under `folder`, their names relative to it and their contents
    (a device library's headers: the cache key holds what they say, not where they are)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0" + _file_digest(path))
    return h.hexdigest().encode()


@contextlib.contextmanager
def _compiling(out: Path):
    """Held while `out` is compiled: one compile of a cache entry at a time across threads
    and processes (parallel builds, test workers). The lock file goes when the compile
    ends; a compile that opened it before then finds `out` there and uses it."""
    import fcntl

    lock = out.with_name(f".{out.name}.lock")
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()


def library_function(name: str) -> bool:
    """A function of a device library's own code (NVSHMEM's nvshmemi_* templates are
    compiled into our object with -rdc; some spill a few bytes -- theirs, not ours)."""
    return re.search(r"\d(nvshmem[ix]?|nvshmemi_transfer)_", name) is not None


class CompileResult:
    def __init__(self, output: Path, report: dict[str, dict[str, int]], cached: bool):
        self.output, self.report, self.cached = output, report, cached

    @property
    def own_report(self) -> dict[str, dict[str, int]]:
        """The report without device-library functions (see library_function)."""
        return {k: v for k, v in self.report.items() if not library_function(k)}


def compile_source(
    source: str | Path, arch: str = DEFAULT_ARCH, mode: str = "cubin", extra: list[str] | None = None,
    link: tuple[str, ...] | list[str] = (),
) -> CompileResult:
    """nvcc `source` to a cubin, an object (mode="obj"), or a shared library with the
    host launchers (mode="shared", what the runtime loads for `host_launch` ops),
    cached by content hash; raises ToolchainError naming the file, line and spec.

    `link`: device libraries (DEVICE_LIBS, the manifest's `device_libs`). The source
    is then compiled with -rdc=true against the library's headers and device-linked
    with lib<name>_device.a into one cubin (nvcc -dlink -cubin): only mode="cubin"
    is meaningful with `link`."""
    source = Path(source)
    nvcc = find_nvcc()
    libs = [find_device_lib(n) for n in link]
    flags = gencode_flags(arch) + NVCC_FLAGS + list(extra or [])
    if libs:
        if mode == "shared":
            raise ToolchainError(f"{source}: modules linked against {', '.join(link)} load as cubins "
                                 "(mode='cubin'), not as shared libraries")
        flags += ["-rdc=true"] + [f"-I{lib.include}" for lib in libs]
    text = source.read_bytes()
    # The key names no install path: the libraries' -I folders go in as their headers' contents.
    key_flags = [f for f in flags if f not in {f"-I{lib.include}" for lib in libs}]
    key = hashlib.sha256(
        b"\0".join([text, arch.encode(), mode.encode(), " ".join(key_flags).encode(), nvcc_version(nvcc).encode()]
                   + [_tree_digest(lib.include) for lib in libs] + [_file_digest(lib.archive) for lib in libs])
    ).hexdigest()[:24]
    out_dir = cache_dir()
    suffix = {"cubin": "cubin", "obj": "o", "shared": "so"}[mode]
    out = out_dir / f"{source.stem}-{key}.{suffix}"
    report_file = out.with_suffix(out.suffix + ".ptxas.txt")
    if out.exists() and report_file.exists():
        return CompileResult(out, parse_ptxas_report(report_file.read_text()), cached=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _compiling(out):
        if out.exists() and report_file.exists():  # compiled by another process meanwhile
            return CompileResult(out, parse_ptxas_report(report_file.read_text()), cached=True)
        return _compile(source, nvcc, libs, arch, mode, flags, out, report_file)


def _compile(source: Path, nvcc: Path, libs: list[DeviceLib], arch: str, mode: str, flags: list[str],
             out: Path, report_file: Path) -> CompileResult:
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{source.stem}.", suffix=".tmp")
    os.close(fd)
    what = {"cubin": ["-cubin"], "obj": ["-c"], "shared": ["-shared", "-Xcompiler", "-fPIC"]}[mode]
    linked = bool(libs) and mode == "cubin"
    if linked:  # relocatable object first, then the device link below
        what = ["-c"]
    cmd = [str(nvcc), *what, *flags, "-o", tmp + (".o" if linked else ""), str(source)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolchainError(
                f"nvcc failed on {source} (rendered from spec {_spec_of(source)}):\n"
                + (proc.stderr + proc.stdout).strip()
                + f"\ncommand: {' '.join(cmd)}"
            )
        report_text = proc.stderr + proc.stdout
        if linked:
            # Device link: our object + lib<name>_device.a -> one cubin that the runtime loads
            # with cuModuleLoad (then nvshmemx_cumodule_init). -Xnvlink -v reports the linked
            # kernels' registers and local memory after the library's code is pulled in.
            lflags = [f for lib in libs for f in lib.link_flags]
            lcmd = [str(nvcc), *gencode_flags(arch), "-dlink", "-cubin", "-Xnvlink", "-v", "-o", tmp,
                    tmp + ".o", *lflags]
            lproc = subprocess.run(lcmd, capture_output=True, text=True)
            if lproc.returncode != 0:
                raise ToolchainError(
                    f"device link failed for {source} (rendered from spec {_spec_of(source)}):\n"
                    + (lproc.stderr + lproc.stdout).strip()
                    + f"\ncommand: {' '.join(lcmd)}"
                )
            report_text += lproc.stderr + lproc.stdout
        # the report first: an output in the cache always has its whole report beside it
        Path(tmp + ".txt").write_text(report_text)
        os.replace(tmp + ".txt", report_file)
        os.replace(tmp, out)
    finally:
        for p in (tmp, tmp + ".o", tmp + ".txt"):
            if os.path.exists(p):
                os.unlink(p)
    return CompileResult(out, parse_ptxas_report(report_text), cached=False)


def compile_module(source: str | Path, arch: str = DEFAULT_ARCH) -> CompileResult:
    """Compile a generated source as the runtime loads it, as its manifest (the JSON
    beside it) says: the shared library with the host launchers for host_launch ops,
    else a cubin, device-linked with the manifest's device_libs."""
    source = Path(source)
    manifest = json.loads(source.with_suffix(".json").read_text(encoding="utf-8"))
    if manifest.get("host_launch", False):
        return compile_source(source, arch=arch, mode="shared")
    return compile_source(source, arch=arch, link=tuple(manifest.get("device_libs", ())))


def dump_sass(binary: str | Path) -> str:
    proc = subprocess.run([str(find_cuobjdump()), "--dump-sass", str(binary)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolchainError(f"cuobjdump failed on {binary}: {proc.stderr.strip()}")
    return proc.stdout
