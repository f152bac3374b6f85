"""tsgen.torch on 2 GPUs: tests/torch_checks.py under torchrun (tools/gpu_torch.sh runs the same and
the TP MLP example, with a table). Skipped without torch or with fewer than 2 CUDA GPUs.

`cp`: tests/torch_checks.py --cp, the context-parallel attention's checks (every variant, push= among them,
and their negative controls) with one short timing (S 2048, 2 rounds), so that the gate on 2 GPUs runs the
kv_push kernels its templates build; the modules it loads are compiled first, in parallel, as
tools/gpu_torch.sh does (the ranks would otherwise compile them one after the other under the cache's lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu
# --cp's timing, short: the gate checks the timed results, it does not report speed
CP_ENV = {"CP_TIME_SEQS": "2048", "CP_TIME_ROUNDS": "2", "CP_TIME_VARIANTS": "tsgen tsgen_push ideal"}


def _two_gpus() -> None:
    torch = pytest.importorskip("torch", reason="tsgen.torch needs PyTorch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs visible to torch")


def _cp_specs() -> list[Path]:
    """Every spec tests/torch_checks.py --cp loads (the collectives, each case's attention pair, fused forward and
    kv_push backward)."""
    tc = load_script(ROOT / "tests" / "torch_checks.py")
    specs = [ROOT / "specs" / "allgather.yaml", ROOT / "specs" / "reduce_scatter.yaml"]
    for case in tc.CP_CASES:
        specs += [ROOT / s for s in tc.ATTENTION_PAIRS[case[0]]]
        specs += [ROOT / tc.CP_FUSED[case], ROOT / tc.CP_PUSH[case]]
    return specs


def _compile(specs: list[Path]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from tsgen.harness import render_to_cache
    from tsgen.spec import load_spec
    from tsgen.toolchain import compile_source

    def one(spec: Path):
        return compile_source(render_to_cache(load_spec(spec)).source, mode="shared")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, specs))


TEST_S = 600  # the test's whole budget (pytest-timeout's); torchrun gets what the compile leaves, less a margin


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (by parent links in /proc), whatever session or group it moved to."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = set(), [pid]
    while todo:
        at = todo.pop()
        kids = [c for c, parent in parents.items() if parent == at]
        found.update(kids)
        todo += kids
    return found


def run_group(cmd: list[str], env: dict, timeout: float, grace: float = 20) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `cmd` (torchrun) in a session of its own. Past `timeout` seconds: SIGTERM,
    which torchrun's agent turns into stopping every rank (each rank is in a session of its own, so a signal to
    torchrun's group does not reach them); whatever of it and its descendants is left `grace` seconds later gets
    SIGKILL, so that no rank stays on a GPU. The output so far is returned with exit code -9."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        pass
    below = descendants(proc.pid)  # before the signal: once torchrun exits, its ranks' parent links change
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=grace)
        how = "stopped by SIGTERM"
    except subprocess.TimeoutExpired:
        for pid in below | descendants(proc.pid) | {proc.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, _ = proc.communicate(timeout=grace)
        how = f"killed with its descendants after a {grace:.0f} s grace"
    return -9, f"{out}\n[past its {timeout:.0f} s: {how}]"


@pytest.mark.timeout(TEST_S)
@pytest.mark.parametrize("mode", [[], ["--probe"], ["--cp"]], ids=["checks", "peer_never_arrives", "cp"])
def test_torch_checks(mode):
    _two_gpus()
    start = time.monotonic()
    env = dict(os.environ)
    if mode == ["--cp"]:
        _compile(_cp_specs())
        env.update(CP_ENV)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "torch_checks.py"), *mode]
    left = TEST_S - (time.monotonic() - start) - 30  # 30 s for the kill, the reading and the report
    assert left > 60, f"the compile took {time.monotonic() - start:.0f} s of the test's {TEST_S}"
    rc, out = run_group(cmd, env, left)
    checks = [line for line in out.splitlines() if line.startswith("CHECK ")]
    assert checks, out[-4000:]
    failed = load_script(ROOT / "tests" / "torch_checks.py").failed_checks(out)
    assert rc == 0 and not failed, "\n".join(failed or checks) + out[-4000:]
