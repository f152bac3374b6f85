"""Result files: what a benchmark ran on, and where its numbers go.

A result is one JSON file (meta + rows + errors) and its Markdown table, written to
`RESULTS/<dir>/<suite>/<date>-<commit>.{json,md}`: <dir> is the op when the suite times one op
kind, else the ops' family module (collectives, primitives, fused, grid_gemm); <date> is the
UTC date of the run, <commit> the short commit of the code that ran (TSGEN_COMMIT, else git,
else "unknown"). The meta records the device, driver, CUDA, CuPy, NCCL and torch versions,
tsgen's version and the exact command. tsgen/bench/index.py makes results/latest.md and the
performance tables (docs/benchmarks.md) from the newest file of each suite.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from ..files import atomic_write
from .ceilings import Device


ASSUMED_CLOCK_KHZ = 2_100_000  # above any Hopper's boost clock: a looser ceiling, never a false error
CLOCK_RATE_ATTR = 13  # cudaDevAttrClockRate (kHz); CUDA 13 removed cudaDeviceProp.clockRate


def device_of(world) -> Device:
    """The GPU of the World's first local rank, as the ceilings need it."""
    rt, dev = world.cp.cuda.runtime, world.devices[world.ranks[0]]
    props = rt.getDeviceProperties(dev)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    clock = props.get("clockRate")
    if not clock:
        try:
            clock = rt.deviceGetAttribute(CLOCK_RATE_ATTR, dev)
        except Exception:  # noqa: BLE001 - an older or newer runtime: assume a clock above any real one
            clock = None
    return Device(name, int(props["multiProcessorCount"]), int(clock or ASSUMED_CLOCK_KHZ),
                  (int(props["major"]), int(props["minor"])), int(props.get("l2CacheSize", 0) or 0))


def commit(root: Path | None = None) -> str:
    """The short commit of the code that runs: TSGEN_COMMIT, else git's (with -dirty when the
    tracked files differ from it), else "unknown" (a copy of the tree without .git)."""
    if os.environ.get("TSGEN_COMMIT"):
        return os.environ["TSGEN_COMMIT"]
    root = root or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--", "tsgen", "templates"],
                               timeout=10).returncode
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module), "__version__", None)
    except Exception:  # noqa: BLE001 - not installed, or broken: the meta says so
        return None


def environment(world=None) -> dict:
    """Device, driver, CUDA, CuPy, NCCL and torch versions, tsgen's, the command, the time."""
    from .. import __version__

    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "commit": commit(), "command": " ".join(["tsgen"] + sys.argv[1:]) if sys.argv else "",
           "tsgen": __version__, "python": platform.python_version(), "cupy": _version("cupy"),
           "torch": _version("torch"), "host": platform.node()}
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001
            pass
    if world is not None:
        cp = world.cp
        try:
            env["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
            env["cuda_driver"] = cp.cuda.runtime.driverGetVersion()
        except Exception:  # noqa: BLE001
            pass
        dev = device_of(world)
        env["device"] = {"name": dev.name, "sms": dev.sms, "clock_mhz": dev.clock_khz // 1000,
                         "compute_capability": f"{dev.cc[0]}.{dev.cc[1]}", "l2_bytes": dev.l2_bytes,
                         "gpus": len(set(getattr(world.backend, "bus_ids", []) or [0]))}
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def _family_module(family) -> str:
    """The module under tsgen.ops that defines `family` (its package, for a family in a
    package such as tsgen.ops.collectives)."""
    module = family.__class__.__module__
    if module.startswith("tsgen.ops."):
        return module.split(".")[2]
    return module.rsplit(".", 1)[-1]


def result_dir(results: Path, suite: str, ops: list[str]) -> Path:
    """RESULTS/<op or the ops' family module>/<suite>."""
    from ..ops import get_family

    kinds = sorted(set(ops))
    if len(kinds) == 1:
        top = kinds[0]
    else:
        groups = sorted({_family_module(get_family(k)) for k in kinds})
        top = groups[0] if len(groups) == 1 else "mixed"
    return Path(results) / top / suite


def write_result(results: Path, suite: str, meta: dict, rows: list[dict], errors: list[str], markdown: str) -> Path:
    """Write RESULTS/<dir>/<suite>/<date>-<commit>.json and .md (a second run of the same day
    and commit gets -2, -3, ...); the JSON's path."""
    ops = [r["op"] for r in rows if r.get("op")] + list(meta.get("ops", []))
    folder = result_dir(results, suite, ops or ["mixed"])
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['date'][:10]}-{meta['commit']}"
    n, name = 1, stem
    while (folder / f"{name}.json").exists():
        n += 1
        name = f"{stem}-{n}"
    path = folder / f"{name}.json"
    # each file whole or not at all (a stopped suite may be killed while it writes): the .md first,
    # as `tsgen results` indexes the runs by their .json
    atomic_write(path.with_suffix(".md"), markdown.encode())
    atomic_write(path, (json.dumps({"meta": meta, "rows": rows, "errors": errors}, indent=1, default=str) + "\n").encode())
    return path
