"""tools/summarize_shared.py: a device run's folder becomes the results/tests/ summary; a real-GPU
run (tools/gpu_real.sh's pytest_real.txt) and a shared-GPU run (gpu_shared.sh) go to their own
folders with the right tallies."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_dir(tmp: Path, pytest_file: str) -> Path:
    run = tmp / "run"
    run.mkdir()
    gpus = "".join(f"{i}, NVIDIA H200, 580.159.04, 143771 MiB\n" for i in range(4))  # gpu_real.sh: a line per GPU
    (run / "device.txt").write_text(gpus + "2026-11-23T20:14:37Z\nsuite wall time: 13 s, exit 1\n")
    (run / pytest_file).write_text("[gw0] PASSED tests/test_gpu.py::x\nFAILED tests/test_gpu.py::test_y - boom\n"
                                   "========= 1 failed, 7 passed, 3 skipped in 12.50s =========\n")
    rows = {"correctness": [{"spec": "allgather", "world": 2, "pass": True}, {"spec": "put_block", "world": 1, "pass": True}],
            "negative_control": [{"spec": "barrier_all", "removed": "x", "skew": 7, "shared": False, "pass": False}],
            "moe": [{"test": "dispatch_combine", "world": 2, "pass": True},
                    {"test": "negative_control_data_wait", "world": 4, "caught": True}]}
    for kind, rs in rows.items():
        (run / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    return run


def _summarize(run: Path, results: Path) -> str:
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "summarize_shared.py"), str(run), str(results), "abc1234",
                        "bash tools/x.sh"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_real_gpu_run_is_filed_under_real_gpu(tmp_path):
    out = _summarize(_run_dir(tmp_path, "pytest_real.txt"), tmp_path / "results")
    md = tmp_path / "results" / "tests" / "real-gpu" / "2026-11-23-abc1234.md"
    data = json.loads(md.with_suffix(".json").read_text())
    assert md.read_text().strip() == out.strip()
    assert "GPU suite, one GPU per rank" in out and "7 passed, 1 failed, 3 skipped in 12.5 s" in out
    assert "vendoring example" not in out  # a real run has none
    assert data["summary"]["failed_tests"] == ["tests/test_gpu.py::test_y"]
    assert data["summary"]["correctness"] == {"tests": 2, "passed": 2, "worlds": {"1": 1, "2": 1}}
    assert data["summary"]["families"]["moe"] == {"tests": 2, "passed": 1, "controls_caught": 1, "worlds": [2, 4]}
    assert "| barrier_all | 7 | yes |" in out
    assert "Device: 0, NVIDIA H200" in out and "; 3, NVIDIA H200, 580.159.04, 143771 MiB. one GPU per rank" in out


def test_a_shared_gpu_run_is_filed_under_shared_gpu(tmp_path):
    out = _summarize(_run_dir(tmp_path, "pytest_shared.txt"), tmp_path / "results")
    js = tmp_path / "results" / "tests" / "shared-gpu" / "2026-11-23-abc1234.json"
    assert js.exists()  # named by the day; the run's start time is in the file, to order runs of one day
    assert json.loads(js.read_text())["meta"]["date"] == "2026-11-23T20:14:37Z"
    assert "GPU suite on one GPU (shared-GPU worlds)" in out and "vendoring example" in out


def test_an_mps_only_run_lists_each_ipc_launch_and_no_suite(tmp_path):
    """SUITE=0 MPS=1: no pytest_shared.txt (the suite is "not run", not "0 passed"), the ipc tests'
    tally from its progress line, and every `tsgen launch` with its exit code and last line."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "device.txt").write_text("NVIDIA H200, 580.159.04, 143771 MiB\n2026-11-26T07:03:05Z\n")
    (run / "pytest_ipc_mps.txt").write_text(".F\n")
    rows = [{"nproc": 2, "cmd": ["python", "-m", "tsgen", "test", "specs/x.yaml"], "rc": 0, "stdout": "x: PASS\n",
             "stderr": ""},
            {"nproc": 4, "cmd": ["python", "-m", "tsgen", "test", "specs/x.yaml"], "rc": 1, "stdout": "",
             "stderr": "tsgen: rank 3: cudaErrorMpsMaxConnectionsReached | 809\n\n"},
            {"nproc": 2, "cmd": ["python", "-c", "run_test(..., mutate=lambda t: t)"], "rc": 1, "stdout": "x: FAIL\n",
             "stderr": ""}]
    (run / "ipc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _summarize(run, tmp_path / "results")
    assert "| whole GPU suite (pytest) | not run |" in out
    assert "1 passed, 1 failed, 0 skipped (stopped before the end" in out
    assert ("| 4 | `python -m tsgen test specs/x.yaml` | 1 | 0 UNEXPECTED | tsgen: rank 3: "
            "cudaErrorMpsMaxConnectionsReached / 809 |") in out
    assert "| 2 | `python -m tsgen test specs/x.yaml` | 0 | 0 | x: PASS |" in out
    assert "| 2 | `python -c run_test(..., mutate=lambda t: t)` | 1 | 1 (negative control) | x: FAIL |" in out


def test_failed_ids_skip_reasons_and_control_detection_are_kept(tmp_path):
    """pytest's short summary (-rfEs) gives every failed test with its message and every skip
    reason with its count; negative controls run over seeds give caught / seeds per control;
    --kind files the run under results/tests/KIND/ (issue 29: results/tests kept counts only)."""
    run = _run_dir(tmp_path, "pytest_shared.txt")
    (run / "pytest_shared.txt").write_text(
        "...sF.sE\n=========================== short test summary info ============================\n"
        "FAILED tests/test_gpu.py::test_primitive_on_gpus[moe_ll-8] - tsgen.errors.KernelFailed: moe_ll | boom\n"
        "ERROR tests/test_moe_gpu.py::test_x - RuntimeError: fixture broke\n"
        "SKIPPED [3] tests/test_gpu.py:45: needs 4 GPUs; this machine has 2\n"
        "SKIPPED [1] tests/test_gpu_ipc.py:20: needs MPS\n"
        "SKIPPED [2] tests/test_gpu.py:88: needs 4 GPUs; this machine has 2\n"
        "== 1 failed, 3 passed, 6 skipped, 1 error in 9.97s ==\n")
    (run / "negative_control.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"control": "ulysses_pre_a2a arrival wait", "seeds": 50, "caught": 49, "missed": [49]},
        {"control": "barrier_all", "seeds": 25, "caught": 25}, {"control": "barrier_all", "seeds": 25, "caught": 25},
        {"spec": "simple_shift", "removed": "x", "skew": None, "shared": True, "pass": False}]))
    (run / "moe.jsonl").write_text(json.dumps({"control": "moe counts wait", "seed": 3, "caught": True}) + "\n")
    (run / "gpu_turn.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"test": "a", "pid": 1, "waited_s": 2.0, "held_s": 61.5}, {"test": "b", "pid": 2, "waited_s": 140.2, "held_s": 0.1},
        {"test": "c", "pid": 3}]) + '{"test": "d", "waited')  # a row without times, a line cut off: skipped
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "summarize_shared.py"), str(run), str(tmp_path / "res"),
                        "abc1234", "bash tools/gpu_gate.sh", "--kind", "gate-h100"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    md = tmp_path / "res" / "tests" / "gate-h100" / "2026-11-23-abc1234.md"
    s = json.loads(md.with_suffix(".json").read_text())["summary"]
    assert s["failed_tests"] == ["tests/test_gpu.py::test_primitive_on_gpus[moe_ll-8]"]
    assert s["failures"][0]["message"] == "tsgen.errors.KernelFailed: moe_ll | boom"
    assert s["failures"][1] == {"id": "tests/test_moe_gpu.py::test_x", "outcome": "ERROR",
                                "message": "RuntimeError: fixture broke"}
    assert s["skips"] == [{"reason": "needs 4 GPUs; this machine has 2", "count": 5,
                           "where": ["tests/test_gpu.py:45", "tests/test_gpu.py:88"]},
                          {"reason": "needs MPS", "count": 1, "where": ["tests/test_gpu_ipc.py:20"]}]
    assert s["controls"] == [{"control": "barrier_all", "seeds": 50, "caught": 50, "detection": 1.0},
                             {"control": "moe counts wait", "seeds": 1, "caught": 1, "detection": 1.0},
                             {"control": "ulysses_pre_a2a arrival wait", "seeds": 50, "caught": 49, "missed": [49],
                              "detection": 0.98}]
    text = md.read_text()
    assert "| ulysses_pre_a2a arrival wait | 50 | 49 | 49/50 (MISSED 1: call 49) |" in text and "| barrier_all | 50 | 50 | 50/50 |" in text
    assert "| `tests/test_gpu.py::test_primitive_on_gpus[moe_ll-8]` | FAILED | tsgen.errors.KernelFailed: moe_ll / boom |" in text
    assert "| 5 | needs 4 GPUs; this machine has 2 | tests/test_gpu.py:45, tests/test_gpu.py:88 |" in text
    assert "| simple_shift | none | yes |" in text  # the per-run controls' table stays
    assert s["gpu_turns"]["turns"] == 2 and s["gpu_turns"]["longest_waited"]["test"] == "b"
    assert "| 2; longest wait 140 s (`b`), longest hold 62 s (`a`) |" in text


def test_the_gpu_scripts_ask_pytest_for_failures_and_skips():
    """-rs alone drops the FAILED lines from pytest's short summary: the summarizer reads them."""
    for script in ("gpu_shared.sh", "gpu_real.sh"):
        for line in (ROOT / "tools" / script).read_text().splitlines():
            if "-m pytest" in line or line.strip().startswith("--"):
                assert not re.search(r"\s-rs\b", line), (script, line)
        assert "-rfEs" in (ROOT / "tools" / script).read_text(), script


def _fake_gpu_tools(tmp: Path, free: str, cores: int, names: str) -> dict:
    """PATH with a fake nvidia-smi (the free memory, indices and names given; its arguments logged
    to tmp/smi_args) and a fake nproc."""
    import os

    bin_dir = tmp / "bin"
    bin_dir.mkdir(parents=True)
    smi = bin_dir / "nvidia-smi"
    indices = "".join(f"{i}\\n" for i in range(names.count("\n")))
    smi.write_text("#!/bin/sh\n"
                   f"echo \"$*\" >> {tmp / 'smi_args'}\n"
                   "case \"$*\" in\n"
                   "  *memory.free*) printf '" + free.replace("\n", "\\n") + "' ;;\n"
                   f"  *index*) printf '{indices}' ;;\n"
                   "  *name*) printf '" + names.replace("\n", "\\n") + "' ;;\n"
                   "esac\n")
    (bin_dir / "nproc").write_text(f"#!/bin/sh\necho {cores}\n")
    for f in (smi, bin_dir / "nproc"):
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("JOBS", "WORKER_MIB", "CUDA_VISIBLE_DEVICES")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return env


def _gpu_lib(env: dict, call: str) -> str:
    r = subprocess.run(["bash", "-c", f"source tools/gpu_lib.sh && {call}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("free,cores,jobs,expected", [
    ("143000\n120000\n", 16, None, 11),  # the GPU with the least free memory: 120000 // 10240
    ("143000\n", 8, None, 6),  # the cores less 2
    ("5000\n", 16, None, 1),  # at least one worker
    ("143000\n", 3, None, 2),  # up to 4 cores: 2
    ("143000\n", 16, "3", 3),  # JOBS decides
    ("", 16, None, 1),  # nvidia-smi said nothing: one worker's worth (10240 MiB)
])
def test_gpu_workers_follow_the_free_memory(tmp_path, free, cores, jobs, expected):
    """tools/gpu_lib.sh sizes the GPU scripts' pytest workers: the least free memory of the visible
    GPUs over WORKER_MIB, at least 1, at most the cores less 2; JOBS overrides."""
    env = _fake_gpu_tools(tmp_path, free, cores, "NVIDIA H200\n")
    if jobs:
        env["JOBS"] = jobs
    assert _gpu_lib(env, "gpu_workers") == str(expected)
    env["WORKER_MIB"] = "5120"
    if not jobs and free == "143000\n120000\n":
        assert _gpu_lib(env, "gpu_workers") == "14"  # 23 by memory, 14 cores
        env["WORKER_MIB"] = "20480"
        assert _gpu_lib(env, "gpu_workers 2") == "10"  # the gate's SPREAD: 5 workers per GPU on each of 2


def test_gpu_kind_and_the_visible_gpus(tmp_path):
    env = _fake_gpu_tools(tmp_path, "80000\n", 16, "NVIDIA H200\nNVIDIA H200\n")
    assert _gpu_lib(env, "gpu_count") == "2"
    assert _gpu_lib(env, "gpu_kind") == "nvidia-h200-x2"
    env = _fake_gpu_tools(tmp_path / "one", "80000\n", 16, "NVIDIA H100 80GB HBM3\n")
    env["CUDA_VISIBLE_DEVICES"] = "3"
    assert _gpu_lib(env, "gpu_kind") == "nvidia-h100"
    assert all(line.startswith("-i 3 ") for line in (tmp_path / "one" / "smi_args").read_text().splitlines())


def test_gpu_vendor_example_builds_in_a_private_folder_it_removes(tmp_path):
    """The vendoring example builds in a fresh folder only this user reads (mktemp), not a fixed
    /tmp name that another user could own or that an earlier run left; the folder goes after."""
    env = _fake_gpu_tools(tmp_path, "80000\n", 16, "NVIDIA H200\n")
    seen = tmp_path / "seen"
    # cmake -B DIR records DIR's mode and writes the demo there; the build step does nothing
    (tmp_path / "bin" / "cmake").write_text(
        "#!/bin/sh\n"
        "if [ \"$1\" = -S ]; then d=$4; stat -c '%a' \"$d\" > " + str(seen) + "; echo \"$d\" >> " + str(seen) + "\n"
        "  printf '#!/bin/sh\\necho demo $1\\n' > \"$d/allgather_demo\"; chmod +x \"$d/allgather_demo\"; fi\n")
    (tmp_path / "bin" / "cmake").chmod(0o755)
    env["TMPDIR"] = str(tmp_path)
    log = tmp_path / "vendor.txt"
    _gpu_lib(env, f"gpu_vendor_example {log} 2 3")
    mode, folder = seen.read_text().split()
    assert mode == "700" and folder.startswith(str(tmp_path / "tsgen-vendor.")), (mode, folder)
    assert log.read_text() == "demo 2\ndemo 3\n"
    assert not Path(folder).exists()

def test_the_gpu_scripts_share_one_library():
    """The gate, the shared-GPU and the real-GPU scripts size their workers, describe the device and
    build the vendoring example through tools/gpu_lib.sh, not each its own copy."""
    for script in ("gpu_gate.sh", "gpu_shared.sh", "gpu_real.sh"):
        text = (ROOT / "tools" / script).read_text()
        assert 'gpu_lib.sh"' in text, script
        body = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
        for own in ("nproc", "cmake -S", "--query-gpu=name,driver_version", "memory.free"):
            assert own not in body, (script, own)


def test_torch_results_turns_check_and_time_lines_into_a_results_file(tmp_path):
    """tools/torch_results.py: every CHECK line of every log folder is a row (a '|' in a detail
    escaped), every TIME line a step time; logs without a CHECK line are an error, not a file."""
    logs = tmp_path / "torch"
    logs.mkdir()
    (logs / "a.log").write_text("noise\nCHECK grad PASS r0: max |diff| 0\nCHECK ipc FAIL rank 1: boom\n"
                                "TIME tp_mlp S=8 W=2 tsgen eager: 6.268 ms/step (0.86x the twin)\n"
                                "allgather: PASS on 2 GPUs (nvshmem: one process per rank) (6.4 s)\n")
    tool = [sys.executable, str(ROOT / "tools" / "torch_results.py"), str(tmp_path / "res"), "abc1234", "2 x H200", "cmd"]
    done = subprocess.run(tool + [str(logs)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (js,) = (tmp_path / "res" / "torch").glob("*-abc1234.json")
    data = json.loads(js.read_text())
    assert [(c["check"], c["result"]) for c in data["checks"]] == [("grad", "PASS"), ("ipc", "FAIL"),
                                                                    ("torchrun-tsgen-test-nvshmem-allgather", "PASS")]
    assert data["times"] == [{"example": "tp_mlp", "variant": "S=8 W=2 tsgen eager", "ms_per_step": 6.268, "vs_twin": 0.86}]
    assert "max \\|diff\\| 0" in js.with_suffix(".md").read_text()
    # cp_step_times' lines (tests/torch_checks.py): interleaved rounds, the fraction of ideal and its range, RAW samples
    (logs / "b.log").write_text(
        "CHECK cp PASS ok\n"
        "TIME cp_attention zz_w2_s16384_tsgen: 7.370 ms/step (1.96x the twin; ideal/this 0.93, rounds 0.91-0.95)\n"
        "TIME cp_attention zz_w2_s16384_ideal: 6.850 ms/step (single-GPU tsgen attention fwd+bwd over S 16384 / 2)\n"
        "RAW cp_attention zz_w2_s16384 (ms/step per round; steps per sample tsgen 4): tsgen=[7.3, 7.4] ideal=[6.8]\n")
    done = subprocess.run(tool + [str(logs)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    data = json.loads(js.read_text())
    assert data["times"][1:] == [
        {"example": "cp_attention", "variant": "zz_w2_s16384_tsgen", "ms_per_step": 7.37, "vs_twin": 1.96,
         "of_ideal": 0.93, "of_ideal_rounds": [0.91, 0.95]},
        {"example": "cp_attention", "variant": "zz_w2_s16384_ideal", "ms_per_step": 6.85, "vs_twin": None,
         "note": "single-GPU tsgen attention fwd+bwd over S 16384 / 2"}]
    assert data["raw"] == [{"example": "cp_attention", "key": "zz_w2_s16384",
                            "samples": "(ms/step per round; steps per sample tsgen 4): tsgen=[7.3, 7.4] ideal=[6.8]"}]
    assert "| cp_attention | zz_w2_s16384_tsgen | 7.370 | 1.96 | 0.93 (0.91-0.95) |" in js.with_suffix(".md").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "b.log").write_text("TIME x y: 1.0 ms/step (1.00x the twin)\n")
    assert subprocess.run(tool + [str(empty)], capture_output=True, text=True).returncode == 1
