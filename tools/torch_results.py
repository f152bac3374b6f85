"""Turn what tools/gpu_torch.sh's steps printed into results/torch/<date>-<commit>.{json,md}.

Usage: python tools/torch_results.py RESULTS_DIR COMMIT DEVICE COMMAND LOG_DIR...

Each LOG_DIR holds steps' logs (tools/gpu_torch.sh's, tools/gpu_torchrun.sh's): their `CHECK name RESULT detail`
lines and `tsgen test`'s closing `SPEC: PASS on N GPUs (...)` lines become the checks table and
their `TIME label: X ms/step (R x the twin)` lines the step times (each example's twin and tsgen
variants, one mean per variant, one after the other: a first reading, not a benchmark, as the
file says). tests/torch_checks.py's cp_step_times prints its TIME lines from interleaved rounds
(`TIME cp_attention KEY: X ms/step (Rx the twin; ideal/this F, rounds A-B)`, medians and paired
ratios) and a `RAW cp_attention KEY (...): label=[...] ...` line of every round's samples: the
fraction of ideal goes into the table, the RAW lines into the JSON. Exit 1 when the logs hold no
CHECK line at all (nothing was checked).
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

CHECK = re.compile(r"^CHECK (\S+) ([A-Z]+) ?(.*)$")
# `tsgen test`'s last line (tools/gpu_torchrun.sh runs it under torchrun): "SPEC: PASS on 2 GPUs (BACKEND: ...) (6.4 s)"
TSGEN_TEST = re.compile(r"^(\S+): (PASS|FAIL) on (\d+) GPUs \((\w+): (.+)\) \(([0-9.]+) s\)$")
TIME = re.compile(r"^TIME (\S+) (.+?): ([0-9.]+) ms/step(?: \((.*)\))?$")
TWIN = re.compile(r"([0-9.]+)x the twin")
IDEAL = re.compile(r"ideal/this ([0-9.]+)(?:, rounds ([0-9.]+)-([0-9.]+))?")
RAW = re.compile(r"^RAW (\S+) (\S+) (.*)$")


def read(log_dirs: list[Path]) -> tuple[list[dict], list[dict], list[dict]]:
    checks, times, raw = [], [], []
    for log in [log for d in log_dirs for log in sorted(d.glob("*.log"))]:
        for line in log.read_text(errors="replace").splitlines():
            if m := CHECK.match(line):
                checks.append({"check": m[1], "result": m[2], "detail": m[3]})
            elif m := TSGEN_TEST.match(line):
                checks.append({"check": f"torchrun-tsgen-test-{m[4]}-{m[1]}", "result": m[2],
                               "detail": f"tsgen test under torchrun, {m[3]} GPUs, {m[4]}: {m[5]} ({m[6]} s)"})
            elif m := TIME.match(line):
                note = m[4] or ""
                twin, ideal = TWIN.search(note), IDEAL.search(note)
                times.append({"example": m[1], "variant": m[2], "ms_per_step": float(m[3]),
                              "vs_twin": float(twin[1]) if twin else None,
                              **({"of_ideal": float(ideal[1])} if ideal else {}),
                              **({"of_ideal_rounds": [float(ideal[2]), float(ideal[3])]} if ideal and ideal[2] else {}),
                              **({"note": note} if note and not twin else {})})
            elif m := RAW.match(line):
                raw.append({"example": m[1], "key": m[2], "samples": m[3]})
    return checks, times, raw


def markdown(meta: dict, checks: list[dict], times: list[dict]) -> str:
    lines = [f"# tsgen.torch on {meta['device']}, {meta['date'][:10]}, commit {meta['commit']}", "",
             f"Command: `{meta['command']}` (tests/torch_checks.py, its --probe, the examples/torch/ scripts); "
             "one process per GPU under torchrun (the shared_* checks: 4 processes on one GPU under MPS, "
             "tests/torch_checks.py --shared).", "",
             "Step times: CUDA events around the steps after warm-up, one mean per variant, the variants one "
             "after the other (not interleaved); tsgen's per-call copies in and out included. A first reading, "
             "not a benchmark. Except cp_attention's (tests/torch_checks.py cp_step_times): every implementation "
             "in interleaved rounds (a balanced order, one settling step before each sample), the median per "
             "step, the ratios paired round by round (of ideal: the single-GPU step over S divided by W, over "
             "this one; its min-max over rounds), every round's samples in the JSON (raw).", "",
             "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c['check']} | {c['result']} | {c['detail'].replace('|', chr(92) + '|')} |" for c in checks]
    lines += ["", "| example | variant | ms / step | vs the twin | of ideal (rounds) |", "|---|---|---|---|---|"]

    def ideal(t):
        if "of_ideal" not in t:
            return t.get("note", "")
        rounds = t.get("of_ideal_rounds")
        return f"{t['of_ideal']:.2f}" + (f" ({rounds[0]:.2f}-{rounds[1]:.2f})" if rounds else "")

    lines += [f"| {t['example']} | {t['variant']} | {t['ms_per_step']:.3f} | "
              f"{'' if t['vs_twin'] is None else format(t['vs_twin'], '.2f')} | {ideal(t)} |" for t in times]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 5:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    results, commit, device, command = Path(argv[0]), argv[1], argv[2], argv[3]
    log_dirs = [Path(a) for a in argv[4:]]
    checks, times, raw = read(log_dirs)
    if not checks:
        print(f"torch_results: no CHECK line in {', '.join(map(str, log_dirs))}", file=sys.stderr)
        return 1
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")  # orders runs of one day
    meta = {"date": started, "commit": commit, "command": command, "device": device}
    out = results / "torch"
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{started[:10]}-{commit}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "checks": checks, "times": times, "raw": raw},
                                                    indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(meta, checks, times))
    print(f"torch_results: {len(checks)} checks, {len(times)} step times -> {stem}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
