"""Baseline workers: one process per GPU, started by `tsgen launch` (tsgen/launch.py).

`launch_workers(cfg, world)` writes the configuration to a file, starts `world` ranks of
`python -m tsgen.bench.workers CONFIG` under tsgen launch (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT in their environment, NVLink multicast forced off, output to a log), and
returns what rank 0 wrote to cfg["result_path"]. A rank that raises writes its traceback to
error_dir/error-RANK.txt and exits 1; tsgen launch then stops the others after a short grace
(their NCCL calls would wait forever), and BaselineRunError carries the first traceback (or
the log's tail, for a rank that died without one). So does the timeout.
The worker runs the function cfg["worker"] names, "tsgen.bench.MODULE:FUNCTION" (the baseline
function that launched it says which), as `FUNCTION(cfg, rank) -> rows`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Sequence

from ..env import force_no_multicast

GRACE_S = 3.0  # after one rank failed, the others' NCCL calls would wait forever


class BaselineRunError(RuntimeError):
    """A worker failed or the run timed out; the message holds the traceback."""


def child_env(base: dict | None = None) -> dict:
    """A worker's environment: `base` (default os.environ) with multicast forced off, tsgen
    importable and output unbuffered."""
    env = force_no_multicast(dict(os.environ if base is None else base))
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        parts.insert(0, root)
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


def _failure(tmp: Path, code: int, timeout: float) -> str:
    log = _tail(tmp / "log.txt")
    if code == 124:
        return f"baseline workers timed out after {timeout:.0f} s and were killed\n{log}"
    errs = sorted((f.stat().st_mtime, int(f.stem.split("-")[1]), f.read_text(errors="replace"))
                  for f in tmp.glob("error-*.txt"))
    if errs:
        _, rank, text = errs[0]
    else:
        m = re.search(r"rank (\d+) exited with (\d+)", log)
        rank, text = (int(m.group(1)) if m else "?"), ""
    msg = [f"baseline worker rank {rank} failed (exit code {code}); all workers were stopped.",
           text.strip() or "(no traceback written) last output:\n" + log]
    if len(errs) > 1:
        msg.append(f"(ranks {[r for _, r, _ in errs[1:]]} failed too; their errors are often a consequence "
                   "of the first)")
    return "\n".join(msg)


def launch_workers(cfg: dict, world: int, timeout: float = 300.0, argv: Sequence[str] | None = None):
    """Run `world` workers (`argv + [CONFIG]`, default this module) under tsgen launch; rank 0's result."""
    from ..launch import launch

    tmp = Path(tempfile.mkdtemp(prefix="tsgen-baselines-"))
    try:
        cfg = dict(cfg, result_path=str(tmp / "result.json"), error_dir=str(tmp))
        (tmp / "config.json").write_text(json.dumps(cfg))
        cmd = list(argv or [sys.executable, "-m", "tsgen.bench.workers"]) + [str(tmp / "config.json")]
        with open(tmp / "log.txt", "w") as log:
            # a SIGTERM to the bench (its time limit) stops the suite, which keeps the entries it
            # finished (suites.stop_on_signals), not only this baseline as one failed run
            code = launch(cmd, world, grace=GRACE_S, timeout=timeout, out=log, err=log, kill_after=2.0,
                          env=child_env(), chain_signals=True)
        if code:
            raise BaselineRunError(_failure(tmp, code, timeout))
        result = tmp / "result.json"
        if not result.exists():
            raise BaselineRunError("baseline workers exited cleanly but rank 0 wrote no result\n" + _tail(tmp / "log.txt"))
        return json.loads(result.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def nccl_process(rank: int):
    """In a baseline worker: this rank's GPU made current and the NCCL process group started;
    (torch, torch.distributed, the device, the world size)."""
    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world, device_id=dev)
    return torch, dist, dev, world


def worker_function(name: str):
    """"tsgen.bench.MODULE:FUNCTION" -> the function; ValueError for any other name."""
    module, _, function = name.partition(":")
    if not module.startswith("tsgen.bench.") or not function.isidentifier():
        raise ValueError(f"worker {name!r}: not a tsgen.bench.MODULE:FUNCTION")
    return getattr(importlib.import_module(module), function)


def worker_main(cfg_path: str) -> None:
    """One rank: run cfg["worker"], rank 0 writes the rows; leave without teardown."""
    force_no_multicast()
    rank = int(os.environ["RANK"])
    cfg = json.loads(Path(cfg_path).read_text())
    try:
        rows = worker_function(cfg["worker"])(cfg, rank)
        if rank == 0:
            tmp = Path(cfg["result_path"] + ".tmp")
            tmp.write_text(json.dumps(rows))
            tmp.replace(cfg["result_path"])
        code = 0
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        text = f"rank {rank}:\n{traceback.format_exc()}"
        try:
            Path(cfg["error_dir"], f"error-{rank}.txt").write_text(text)
        except OSError:
            pass
        sys.stderr.write(text)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: NCCL / CUDA atexit work can hang


if __name__ == "__main__":
    worker_main(sys.argv[1])
