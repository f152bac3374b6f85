"""Experiment: which CUDA call inside cp_attention's host launcher blocks at a world's first call
on a shared GPU (docs/lab/shared_gpu.md). Runs the cp_attention GPU test of one case in fresh
processes, `--parallel` at a time, with the generated source edited (test-only) so that every
CUDA call of the launcher, and each kernel launch, reports on stderr when it takes over 50 ms.

    TSGEN_SHARE_GPUS=1 python3 tools/exp_cp_first_call.py OUT [--rounds 2] [--parallel 4]

As a pytest plugin (PYTHONPATH=tools, `-p exp_cp_first_call`, EXP_LOG_DIR=DIR) it applies the same
edit to every cp_attention test, times every host launcher call (HOST lines over 50 ms), and
writes each worker's stderr, with the test names and outcomes, to DIR/worker-ID.txt.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TIMED_TRY = r'''#define TSGEN_FUSED_TRY(expr)                                                              \
  do {                                                                                     \
    const auto tsgen_t0_ = std::chrono::steady_clock::now();                               \
    const cudaError_t tsgen_err_ = (expr);                                                 \
    const double tsgen_ms_ =                                                               \
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - tsgen_t0_).count(); \
    if (tsgen_ms_ > 50) fprintf(stderr, "SLOW %.1f ms line %d: %s\n", tsgen_ms_, __LINE__, #expr); \
    if (tsgen_err_ != cudaSuccess) return tsgen_err_;                                      \
  } while (0)
'''


def timed(stmt: str, label: str) -> str:
    return ("{ const auto t0_ = std::chrono::steady_clock::now(); " + stmt + " const double ms_ = "
            "std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count(); "
            f'if (ms_ > 50) fprintf(stderr, "SLOW %.1f ms {label} rank %d\\n", ms_, rank); }}')


def mutate(text: str, strict: bool = True) -> str:
    text = "#include <chrono>\n#include <cstdio>\n" + text
    text = re.sub(r"#define TSGEN_FUSED_TRY\(expr\)(?:.*\\\n)+.*\n", lambda m: TIMED_TRY, text, count=1)
    text = text.replace("SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, ENTRY, 0, count);",
                        timed("SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, ENTRY, 0, count);", "entry launch"))
    text = text.replace("PUSH<<<GATHER_BLOCKS, GATHER_THREADS, 0, l->copy>>>(peers, rank, calls, sig, k, v, k_full, v_full, count);",
                        timed("PUSH<<<GATHER_BLOCKS, GATHER_THREADS, 0, l->copy>>>(peers, rank, calls, sig, k, v, k_full, "
                              "v_full, count);", "push launch"))
    text = text.replace("  const cudaError_t launched = tsgen::attention::launch<Config>(",
                        "  const auto t_att_ = std::chrono::steady_clock::now();\n"
                        "  const cudaError_t launched = tsgen::attention::launch<Config>(")
    text = text.replace("sig + tsgen::cp::READY, tsgen::cp::kv_chunk(g), 0, grid, stream, calls, unwaited);",
                        "sig + tsgen::cp::READY, tsgen::cp::kv_chunk(g), 0, grid, stream, calls, unwaited);\n"
                        "  { const double ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now()"
                        " - t_att_).count(); if (ms_ > 50) fprintf(stderr, \"SLOW %.1f ms attention launch rank %d\\n\","
                        " ms_, rank); }")
    for marker in ("entry launch", "push launch", "attention launch", "SLOW %.1f ms line"):
        assert marker in text or not strict, marker
    return text


def pytest_configure(config) -> None:  # the plugin mode
    import os
    import time

    out = Path(os.environ["EXP_LOG_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    log = open(out / f"worker-{worker}.txt", "a", buffering=1)
    os.dup2(log.fileno(), 2)
    t0 = time.monotonic()

    import tsgen.harness as H
    from tsgen.runtime import world as W

    plain_run = H.run_test

    def run_test(spec, *a, **k):
        if "cp_attention" in str(spec) and k.get("mutate") is None:
            k["mutate"] = lambda s: mutate(s, strict=False)
        return plain_run(spec, *a, **k)

    H.run_test = run_test
    plain_launch = W.Module._host_launch
    calls: dict = {}

    def timed(self, buffers, rank, stream):
        n = calls[(id(self), rank)] = calls.get((id(self), rank), 0) + 1
        s = time.monotonic()
        try:
            return plain_launch(self, buffers, rank, stream)
        finally:
            ms = (time.monotonic() - s) * 1e3
            if ms > 50:
                os.write(2, f"HOST {ms:.1f} ms {self.manifest.name} rank {rank} call {n} at {s - t0:.1f} s\n".encode())

    W.Module._host_launch = timed


def pytest_runtest_logstart(nodeid, location) -> None:
    import os
    import time
    os.write(2, f"TEST {nodeid} start {time.time():.1f}\n".encode())


def pytest_runtest_logreport(report) -> None:
    import os
    if report.when == "call" or report.outcome == "failed":
        os.write(2, f"RESULT {report.nodeid} {report.when} {report.outcome}\n".encode())


def child(case: str, world: int) -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from test_cp_attention_gpu import CASES, SM_SPEC  # noqa: E402

    from tsgen.harness import run_test  # noqa: E402

    params, count = CASES[case]
    lines: list[str] = []
    ok = run_test(SM_SPEC, world, count=count, iters=3, echo=lines.append, mutate=mutate,
                  variant={"name": f"cp_{case}", "params": params, "sync": {"timeout_ms": 3000}})
    print(f"{case} W{world}: {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--child", nargs=2)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], int(a.child[1]))
    a.out.mkdir(parents=True, exist_ok=True)
    cases = [("zigzag_full_hd64", 8), ("zigzag_causal_gqa", 4), ("zigzag_causal_gqa", 8), ("zigzag_full_hd64", 4)]
    for r in range(a.rounds):
        procs = []
        for i in range(a.parallel):
            case, world = cases[i % len(cases)]
            log = open(a.out / f"first_call_r{r}_{i}.txt", "w")
            procs.append((subprocess.Popen([sys.executable, __file__, str(a.out), "--child", case, str(world)],
                                           stdout=log, stderr=subprocess.STDOUT), log))
        for p, log in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
            log.close()
    for f in sorted(a.out.glob("first_call_r*.txt")):
        keep = [ln for ln in f.read_text().splitlines() if ln.startswith(("SLOW", "tsgen: timeout", "zigzag"))
                or "PASS" in ln or "FAIL" in ln or "Error" in ln]
        print(f"== {f.name}\n" + "\n".join(keep[:14]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
