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
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import procs
from .env import env_seconds
from .errors import ToolchainError
from .headers import include_flags, library_digest
from .files import (UnsafePath, atomic_write, held_lock, new_file_mode, new_temp, private_folder, sweep_temps,
                    unsafe_entry)

if TYPE_CHECKING:
    from .manifest import Manifest

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
    homes = [Path(h) / "bin" for h in map(os.environ.get, ("CUDA_HOME", "CUDA_PATH")) if h]
    not_executable = []
    for d in homes + _wheel_bin_dirs():
        if (d / name).is_file():
            if os.access(d / name, os.X_OK):
                return d / name
            not_executable.append(f"{d / name} is not executable")
    raise ToolchainError(
        f"{name} not found on PATH, in CUDA_HOME/CUDA_PATH, or in the pip CUDA wheels; "
        + "".join(f"{n}; " for n in not_executable)
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


_HOW_TO_SET = "set TSGEN_CACHE_DIR to a folder of yours"


def cache_dir() -> Path:
    """The compile cache's folder (absolute): TSGEN_CACHE_DIR, else $XDG_CACHE_HOME/tsgen, else
    ~/.cache/tsgen. A relative XDG_CACHE_HOME is ignored, as the XDG spec says (with a note on
    stderr); with no home folder either (HOME unset, no passwd entry), ToolchainError."""
    if os.environ.get("TSGEN_CACHE_DIR"):
        return Path(os.path.abspath(os.environ["TSGEN_CACHE_DIR"]))
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "tsgen"
    home = os.path.expanduser("~")
    if xdg:
        _note_relative_xdg(xdg, home)
    if not os.path.isabs(home) or home == "/":
        raise ToolchainError("no folder for the compile cache: TSGEN_CACHE_DIR and XDG_CACHE_HOME are unset"
                             + (f" (XDG_CACHE_HOME={xdg!r} is not an absolute path)" if xdg else "")
                             + " and this user has no home folder (HOME unset, none in the password database); "
                             + _HOW_TO_SET)
    return Path(home) / ".cache" / "tsgen"


@functools.lru_cache(maxsize=None)
def _note_relative_xdg(xdg: str, home: str) -> None:
    print(f"tsgen: XDG_CACHE_HOME={xdg!r} is not an absolute path, so it is ignored (the XDG spec says so); "
          f"the compile cache is under {home}/.cache", file=sys.stderr)


def cache_folder(*parts: str) -> Path:
    """The compile cache's folder (or the folder `parts` below it), made if missing and checked:
    tsgen loads what it finds there, so the folders from the cache down must be this user's and
    writable by no one else, and those above changeable only by this user or root
    (files.private_folder). Its resolved path; ToolchainError saying what is wrong and how to fix it."""
    root = cache_dir()
    folder = root.joinpath(*parts)
    try:
        return private_folder(folder, top=root)
    except UnsafePath as e:
        what = f"the folder {e.filename} above it" if e.above else e.filename
        fix = f"chmod go-w {e.filename}" if e.strerror.startswith("writable by group") else "use a folder of your own"
        raise ToolchainError(f"compile cache {root}: {what} is {e.strerror}; anyone who can write there can "
                             f"plant a library tsgen would load, so it is not used: {fix}, or {_HOW_TO_SET} "
                             "(mkdir -m 700 FOLDER)") from None
    except OSError as e:
        raise cache_error(folder, e) from None


def tool_timeout() -> float:
    """Seconds any nvcc / cuobjdump run may take: TSGEN_TOOL_TIMEOUT, default 1800."""
    return env_seconds("TSGEN_TOOL_TIMEOUT", "1800", ToolchainError)


def run_tool(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a CUDA tool with the timeout; ToolchainError if it cannot start or runs too long.
    It runs in a process group of its own (tsgen/procs.py), killed whole when the tool ends,
    times out or tsgen is stopped: nothing nvcc starts (cicc, ptxas, the host compiler)
    outlives it. Its output goes to unnamed temporary files, not pipes, so a process that
    left its group holding them cannot keep tsgen waiting."""
    timeout = tool_timeout()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = procs.start(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        except OSError as e:
            raise ToolchainError(f"cannot run {cmd[0]}: {e.strerror or e}") from None
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ToolchainError(f"{Path(cmd[0]).name} ran longer than {timeout:g} s (TSGEN_TOOL_TIMEOUT), "
                                 f"stopped: {' '.join(cmd)}") from None
        finally:
            procs.end(proc)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return subprocess.CompletedProcess(cmd, proc.returncode, *texts)


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: Path) -> str:
    out = run_tool([str(nvcc), "--version"])
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "unknown"


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
        head = source.read_text(encoding="utf-8", errors="replace")[:300]
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
    ends; a compile that opened it before then finds `out` there and uses it. Opened with
    files.open_shared: a symlink planted in its place is refused, never followed."""
    lock = out.with_name(f".{out.name}.lock")
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(held_lock(lock))
        except OSError as e:
            raise cache_error(out.parent, e) from None
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()


def library_function(name: str) -> bool:
    """A function of a device library's own code (NVSHMEM's nvshmemi_* templates are
    compiled into our object with -rdc; some spill a few bytes -- theirs, not ours)."""
    return re.search(r"\d(nvshmem[ix]?|nvshmemi_transfer)_", name) is not None


_SERIALIZED = re.compile(r"\(C75\d\d\).*serialized")


def serialized_wgmma(text: str) -> list[str]:
    """ptxas's notes that it serialized a function's wgmma (C7508, C7510, C7514, C7518, ...: every
    product then waited for alone, a kernel several times slower that still computes the right
    answer); the lines as ptxas printed them."""
    return [line.strip() for line in text.splitlines() if _SERIALIZED.search(line)]


class CompileResult:
    def __init__(self, output: Path, report_text: str, cached: bool):
        self.output, self.cached = output, cached
        self.report = parse_ptxas_report(report_text)
        self.serialized = serialized_wgmma(report_text)  # see serialized_wgmma: none in a shipped kernel

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
    flags = gencode_flags(arch) + NVCC_FLAGS + list(extra or []) + include_flags()
    if libs:
        if mode == "shared":
            raise ToolchainError(f"{source}: modules linked against {', '.join(link)} load as cubins "
                                 "(mode='cubin'), not as shared libraries")
        flags += ["-rdc=true"] + [f"-I{lib.include}" for lib in libs]
    try:
        text = source.read_bytes()
    except OSError as e:
        raise ToolchainError(f"cannot read {source}: {e.strerror or e}") from None
    # The key names no install path: the -I folders go in as their headers' contents (of tsgen's
    # library, the headers the source includes; of a device library, all of them).
    key_flags = [f for f in flags if f not in {f"-I{lib.include}" for lib in libs} | set(include_flags())]
    key = hashlib.sha256(
        b"\0".join([text, arch.encode(), mode.encode(), " ".join(key_flags).encode(), nvcc_version(nvcc).encode(),
                    library_digest(text.decode("utf-8", "replace"))]
                   + [_tree_digest(lib.include) for lib in libs] + [_file_digest(lib.archive) for lib in libs])
    ).hexdigest()[:24]
    out_dir = cache_folder()
    suffix = {"cubin": "cubin", "obj": "o", "shared": "so"}[mode]
    out = out_dir / f"{source.stem}-{key}.{suffix}"
    report_file = out.with_suffix(out.suffix + ".ptxas.txt")
    cached = _cached_report(out, report_file)
    if cached is not None:
        return CompileResult(out, cached, cached=True)
    with _compiling(out):
        cached = _cached_report(out, report_file)
        if cached is not None:  # compiled by another process meanwhile
            return CompileResult(out, cached, cached=True)
        return _compile(source, nvcc, libs, arch, mode, flags, out, report_file)


def _compile(source: Path, nvcc: Path, libs: list[DeviceLib], arch: str, mode: str, flags: list[str],
             out: Path, report_file: Path) -> CompileResult:
    out_dir = out.parent
    try:
        sweep_temps(out_dir)
        tmp = str(new_temp(out_dir, source.stem))
    except OSError as e:
        raise cache_error(out_dir, e) from None
    what = {"cubin": ["-cubin"], "obj": ["-c"], "shared": ["-shared", "-Xcompiler", "-fPIC"]}[mode]
    linked = bool(libs) and mode == "cubin"
    if linked:  # relocatable object first, then the device link below
        what = ["-c"]
    cmd = [str(nvcc), *what, *flags, "-o", tmp + (".o" if linked else ""), str(source)]
    try:
        proc = run_tool(cmd)
        if proc.returncode != 0:
            raise ToolchainError(
                f"nvcc failed on {source} (rendered from spec {_spec_of(source)}):\n"
                + (proc.stderr + proc.stdout).strip()
                + f"\ncommand: {' '.join(cmd)}"
            )
        _check_output(tmp + (".o" if linked else ""), cmd)
        report_text = proc.stderr + proc.stdout
        if linked:
            # Device link: our object + lib<name>_device.a -> one cubin that the runtime loads
            # with cuModuleLoad (then nvshmemx_cumodule_init). -Xnvlink -v reports the linked
            # kernels' registers and local memory after the library's code is pulled in.
            lflags = [f for lib in libs for f in lib.link_flags]
            lcmd = [str(nvcc), *gencode_flags(arch), "-dlink", "-cubin", "-Xnvlink", "-v", "-o", tmp,
                    tmp + ".o", *lflags]
            lproc = run_tool(lcmd)
            if lproc.returncode != 0:
                raise ToolchainError(
                    f"device link failed for {source} (rendered from spec {_spec_of(source)}):\n"
                    + (lproc.stderr + lproc.stdout).strip()
                    + f"\ncommand: {' '.join(lcmd)}"
                )
            _check_output(tmp, lcmd)
            report_text += lproc.stderr + lproc.stdout
        try:
            _store(Path(tmp), out, report_file, report_text)
        except OSError as e:
            raise cache_error(out_dir, e) from None
    finally:
        for p in (tmp, tmp + ".o"):
            if os.path.exists(p):
                os.unlink(p)
    return CompileResult(out, report_text, cached=False)


def _check_output(path: str, cmd: list[str]) -> None:
    """ToolchainError unless the tool that just exited 0 left a non-empty `path`."""
    try:
        size = os.path.getsize(path)
    except OSError:
        size = None
    if not size:
        raise ToolchainError(f"{Path(cmd[0]).name} exited 0 but wrote {'no' if size is None else 'an empty'} "
                             f"output file {path}; nothing was cached\ncommand: {' '.join(cmd)}")


def compile_for(manifest: Manifest, source: str | Path, arch: str = DEFAULT_ARCH) -> CompileResult:
    """Compile `source` as the runtime loads the module `manifest` describes: the one place
    its compile mode (Manifest.compile_mode) becomes nvcc's: the shared library with the host
    launchers, or a cubin device-linked with the manifest's device libraries."""
    mode, libs = manifest.compile_mode
    if mode == "shared":
        return compile_source(source, arch=arch, mode="shared")
    return compile_source(source, arch=arch, link=libs)


def compile_module(source: str | Path, arch: str = DEFAULT_ARCH) -> CompileResult:
    """Compile a generated source as the runtime loads it, as its manifest (the JSON
    beside it) says (compile_for)."""
    from .manifest import Manifest

    source = Path(source)
    return compile_for(Manifest.load(source.with_suffix(".json")), source, arch)


# A cache entry: the binary, and its ptxas report whose first line is the binary's digest.
_DIGEST_LINE = "tsgen cache: sha256 "


def _cached_report(out: Path, report_file: Path) -> str | None:
    """The ptxas report of a cache entry whose binary has the digest its report recorded;
    None for a miss (absent, truncated, emptied, replaced: it is compiled again), and so is
    an entry another user owns or others may write (files.unsafe_entry): the digest proves
    nothing when whoever wrote the binary wrote the report too."""
    try:
        if any(unsafe_entry(os.lstat(p)) for p in (out, report_file)):  # a symlink (0777) too
            return None
        first, _, report = report_file.read_text(errors="replace").partition("\n")
        digest = _file_digest(out).decode()
    except OSError:
        return None
    return report if first == _DIGEST_LINE + digest else None


def cache_file_mode() -> int:
    """Mode of a new file in the compile cache: the umask's, but never writable by group or others."""
    return new_file_mode() & ~0o022


def _store(tmp: Path, out: Path, report_file: Path, report_text: str) -> None:
    """Put a compiled binary in the cache: its report with its digest first, then the binary,
    each in one rename (a reader sees a whole entry, none, or a digest mismatch: a miss)."""
    atomic_write(report_file, f"{_DIGEST_LINE}{_file_digest(tmp).decode()}\n{report_text}".encode(),
                 mode=cache_file_mode())
    os.chmod(tmp, cache_file_mode())
    os.replace(tmp, out)


def cache_error(folder: Path, e: OSError) -> ToolchainError:
    return ToolchainError(f"compile cache {folder}: {e.strerror or e} ({e.filename}); "
                          "set TSGEN_CACHE_DIR to a folder you can write")


def write_cached(folder: tuple[str, ...], name: str, text: str) -> Path:
    """Write `text` to file `name` in the cache's sub-folder `folder` unless it holds it already
    (a rendered source, a manifest): the folder made and checked (cache_folder), the file never
    writable by others. Its path; ToolchainError naming the folder."""
    from .files import write_if_different

    where = cache_folder(*folder)
    try:
        with contextlib.suppress(FileNotFoundError):
            if unsafe_entry(os.lstat(where / name)):  # not trusted, even if it holds the same text
                os.unlink(where / name)
        write_if_different(where / name, text, mode=cache_file_mode())
    except OSError as e:
        raise cache_error(where, e) from None
    return where / name


def dump_sass(binary: str | Path) -> str:
    proc = run_tool([str(find_cuobjdump()), "--dump-sass", str(binary)])
    if proc.returncode != 0:
        raise ToolchainError(f"cuobjdump failed on {binary}: {proc.stderr.strip()}")
    return proc.stdout
