"""Turn one run of tools/gpu_shared.sh ($OUT, unpacked) into
results/tests/shared-gpu/<date>-<commit>.{json,md}, or of tools/gpu_real.sh (one GPU per rank: its
pytest_real.txt) into results/tests/real-gpu/<date>-<commit>.{json,md}: the pytest tally and wall time, the
spec x world rows by world, the dtype matrix, the negative controls (caught or not, with and
without skew), the timeout probes, the ipc tests under MPS and the vendoring example.

Usage: python tools/summarize_shared.py RUN_DIR RESULTS_DIR COMMIT "COMMAND"
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path


def jsonl(run: Path, kind: str) -> list[dict]:
    f = run / f"{kind}.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def tally(text: str) -> dict:
    """pytest's last summary line: {'passed': n, 'failed': n, 'skipped': n, ...} and its seconds."""
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln) and " in " in ln]
    if not lines:  # stopped before pytest's summary: count the progress characters
        progress = "".join(ln.split(" [")[0].split("[gw")[0] for ln in text.splitlines()
                           if re.fullmatch(r"[.sFEx]+(\[gw.*)?( +\[ *\d+%\])?", ln.strip()))
        counts = {"passed": progress.count("."), "failed": progress.count("F") + progress.count("E"),
                  "skipped": progress.count("s"), "stopped": True}
        return counts if any(counts[k] for k in ("passed", "failed", "skipped")) else {}
    last = lines[-1]
    out = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", last)}
    m = re.search(r" in ([\d.]+)s", last)
    if m:
        out["seconds"] = float(m.group(1))
    return out


def summarize(run: Path, commit: str, command: str) -> tuple[dict, str]:
    device = (run / "device.txt").read_text().splitlines() if (run / "device.txt").exists() else []
    stamp = next((i for i, ln in enumerate(device) if re.match(r"\d{4}-\d\d-\d\dT", ln)), None)
    date = device[stamp][:10] if stamp is not None else "unknown"
    device = device[:stamp]  # what came before the date: a line per GPU (gpu_real.sh), or GPU, libraries, nvcc
    real = (run / "pytest_real.txt").exists()
    log = run / ("pytest_real.txt" if real else "pytest_shared.txt")
    suite = tally(log.read_text()) if log.exists() else {}
    ipc = tally((run / "pytest_ipc_mps.txt").read_text()) if (run / "pytest_ipc_mps.txt").exists() else {}
    failed = re.findall(r"^FAILED (\S+)", log.read_text(), re.M) if log.exists() else []
    families = {kind: jsonl(run, kind) for kind in ("cp_attention", "moe")}
    corr, dtypes = jsonl(run, "correctness"), jsonl(run, "dtype_matrix")
    negs, probes = jsonl(run, "negative_control"), jsonl(run, "timeout_probe")
    vendor = (run / "vendor.txt").read_text().splitlines() if (run / "vendor.txt").exists() else []
    # every ipc test's `tsgen launch`: its exit code and last line (kept also when pytest was cut off)
    ipc_runs = [{"nproc": r["nproc"], "cmd": shorten(" ".join(["python", *r["cmd"][1:]]), 110), "rc": r["rc"],
                 "last": next((ln for ln in reversed((r["stderr"] + "\n" + r["stdout"]).splitlines()) if ln.strip()), "")}
                for r in jsonl(run, "ipc")]
    summary = {
        "suite": suite, "failed_tests": failed, "ipc_under_mps": ipc, "ipc_runs": ipc_runs,
        "correctness": {"tests": len(corr), "passed": sum(r["pass"] for r in corr),
                        "worlds": dict(sorted(Counter(str(r["world"]) for r in corr).items()))},
        "dtype_matrix": {"tests": len(dtypes), "passed": sum(r["pass"] for r in dtypes)},
        "negative_controls": sorted(({"spec": r["spec"], "skew": r.get("skew"), "caught": not r["pass"]} for r in negs),
                                    key=lambda n: (n["spec"], n["skew"] or 0)),
        "timeout_probes": {"tests": len(probes), "passed": sum(r.get("rc") == 0 for r in probes)},  # rc 0: timed out, printed, trapped
        "vendor": [ln for ln in vendor if "PASS" in ln or "FAIL" in ln],
        "families": {kind: {"tests": len(rows), "passed": sum(bool(r.get("pass")) for r in rows),
                            "controls_caught": sum(bool(r.get("caught")) for r in rows),
                            "worlds": sorted({int(r["world"]) for r in rows if r.get("world") is not None})}
                     for kind, rows in families.items()},
    }
    meta = {"date": date, "commit": commit, "command": command, "device": device,
            "mode": "one GPU per rank (TSGEN_SHARE_GPUS unset): worlds larger than the GPU count skip" if real else
                    "every rank of every world on the one GPU (TSGEN_SHARE_GPUS=1), spec variants fitted per test"}
    title = "GPU suite, one GPU per rank" if real else "GPU suite on one GPU (shared-GPU worlds)"
    timings = "" if real else " Timings of ranks sharing a GPU measure nothing about the ops; none are reported."
    md = [f"# {title}, {date}, commit {commit}", "",
          f"Device: {'; '.join(device)}. {meta['mode']}.{timings}", "", f"Command: `{command}`", "",
          "| part | result |", "|---|---|",
          "| whole GPU suite (pytest) | not run |" if not log.exists() else
          f"| whole GPU suite (pytest) | {suite.get('passed', 0)} passed, {suite.get('failed', 0)} failed, "
          f"{suite.get('skipped', 0)} skipped "
          + ("(stopped by the call's time limit before the end; counted from pytest's progress) |"
             if suite.get("stopped") else f"in {suite.get('seconds', '?')} s |")]
    c = summary["correctness"]
    md.append(f"| primitives, collectives, fused ops (spec x world) | {c['passed']} / {c['tests']} "
              f"(worlds: {', '.join(f'{w}: {n}' for w, n in c['worlds'].items())}) |")
    d = summary["dtype_matrix"]
    md.append(f"| dtype matrix (collective x dtype x world) | {d['passed']} / {d['tests']} |")
    p = summary["timeout_probes"]
    md.append(f"| timeout probes (the kernel prints who waited for what, then traps) | {p['passed']} / {p['tests']} |")
    if ipc:
        md.append(f"| ipc backend, one process per rank, under MPS | {ipc.get('passed', 0)} passed, "
                  f"{ipc.get('failed', 0)} failed, {ipc.get('skipped', 0)} skipped"
                  f"{' (stopped before the end: counted from its progress line)' if ipc.get('stopped') else ''} |")
    for kind, f in summary["families"].items():
        if f["tests"]:
            md.append(f"| {kind} (rows of its GPU tests; worlds {', '.join(map(str, f['worlds']))}) | {f['passed']} passed"
                      + (f", {f['controls_caught']} negative controls caught" if f["controls_caught"] else "") + " |")
    if (run / "vendor.txt").exists():
        md.append(f"| vendoring example (examples/vendor) | {sum('PASS' in v for v in summary['vendor'])} / "
                  f"{len(summary['vendor'])} |")
    elif not real:
        md.append("| vendoring example (examples/vendor) | not run |")
    md += ["", "Negative controls (a broken kernel must FAIL):", "", "| control | skew | caught |", "|---|---|---|"]
    md += [f"| {n['spec']} | {n['skew'] if n['skew'] is not None else 'none'} | {'yes' if n['caught'] else 'NO'} |"
           for n in summary["negative_controls"]]
    if failed:
        md += ["", "Failed tests:", ""] + [f"- `{t}`" for t in failed]
    if ipc_runs:
        md += ["", "ipc runs (`tsgen launch`, one process per rank):", "", "| processes | command | exit | last line |",
               "|---|---|---|---|"]
        md += [f"| {r['nproc']} | `{r['cmd'].replace('|', '/')}` | {r['rc']} | {r['last'][:160].replace('|', '/')} |" for r in ipc_runs]
    return {"meta": meta, "summary": summary, "correctness": corr, "dtype_matrix": dtypes,
            "negative_control": negs, "timeout_probe": probes}, "\n".join(md) + "\n"


def main() -> None:
    run, results, commit, command = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    data, md = summarize(run, commit, command)
    folder = results / "tests" / ("real-gpu" if (run / "pytest_real.txt").exists() else "shared-gpu")
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"{data['meta']['date']}-{commit}"
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    stem.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
