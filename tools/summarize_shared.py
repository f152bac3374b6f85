"""Turn one run of tools/gpu_shared.sh ($OUT, unpacked) into
results/tests/shared-gpu/<date>-<commit>.{json,md}, or of tools/gpu_real.sh (one GPU per rank: its
pytest_real.txt) into results/tests/real-gpu/<date>-<commit>.{json,md}: the pytest tally and wall time, the
spec x world rows by world, the dtype matrix, the negative controls (caught or not, with and
without skew), the timeout probes, the ipc tests under MPS and the vendoring example.

What a run left out is kept too: every failed test (or error) with pytest's one-line message and
every skip reason with its count (pytest's short summary: run pytest with -rfEs), and, per
negative control, how often it caught its broken kernel over how many seeds (rows with `control`,
`caught` and `seeds` (or one `seed`) in any *.jsonl of the run: detection = caught / seeds).

Usage: python tools/summarize_shared.py RUN_DIR RESULTS_DIR COMMIT "COMMAND" [--kind KIND]
(KIND: the folder under RESULTS_DIR/tests/; default real-gpu for a gpu_real.sh run, else shared-gpu)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path


def jsonl(run: Path, kind: str) -> list[dict]:
    f = run / f"{kind}.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def gpu_turns(run: Path) -> list[dict]:
    """The turns of tests on a shared GPU (tsgen/harness.py gpu_turn's log): a diagnostic, so a line cut
    off or missing a field is skipped, never the gate's summary."""
    f, rows = run / "gpu_turn.jsonl", []
    for line in f.read_text().splitlines() if f.exists() else []:
        try:
            row = json.loads(line)
            rows.append({"test": str(row.get("test", "?")), "waited_s": float(row["waited_s"]),
                         "held_s": float(row["held_s"])})
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return rows


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def short_summary(text: str) -> tuple[list[dict], list[dict]]:
    """pytest's short test summary (-rfEs): the failed tests and errors ({id, outcome, message}),
    and the skips grouped by reason ({reason, count, where: the file:line of each})."""
    failures = [{"id": m["id"], "outcome": m["outcome"], "message": (m["message"] or "").strip()}
                for m in re.finditer(r"^(?P<outcome>FAILED|ERROR) (?P<id>\S+)(?: - (?P<message>.*))?$", text, re.M)]
    skips: dict[str, dict] = {}
    for m in re.finditer(r"^SKIPPED \[(\d+)\] ([^:\s]+:\d+): (.*)$", text, re.M):
        group = skips.setdefault(m[3].strip(), {"reason": m[3].strip(), "count": 0, "where": []})
        group["count"] += int(m[1])
        if m[2] not in group["where"]:
            group["where"].append(m[2])
    return failures, sorted(skips.values(), key=lambda s: (-s["count"], s["reason"]))


def controls(run: Path) -> list[dict]:
    """Detection per negative control: rows with `control` and `caught` in any *.jsonl of the run,
    each over `seeds` seeds (caught: how many of them caught it) or one `seed` (caught: a bool)."""
    out: dict[str, dict] = {}
    for f in sorted(run.glob("*.jsonl")):
        if f.stem == "gpu_turn":  # the turns' log (gpu_turns), no control's: read leniently there
            continue
        for row in jsonl(run, f.stem):
            if not isinstance(row, dict) or "control" not in row or "caught" not in row:
                continue
            c = out.setdefault(str(row["control"]), {"control": str(row["control"]), "seeds": 0, "caught": 0})
            c["seeds"] += int(row.get("seeds", 1))
            c["caught"] += int(row["caught"])
            if row.get("missed"):  # the seeds (calls) that came out right, where the test recorded them
                c.setdefault("missed", []).extend(row["missed"])
    for c in out.values():
        c["detection"] = round(c["caught"] / c["seeds"], 4) if c["seeds"] else None
    return sorted(out.values(), key=lambda c: c["control"])


def cell(text: str, width: int = 160) -> str:
    """Text for one Markdown table cell: one line, no '|', at most `width` characters."""
    return shorten(" ".join(str(text).split()).replace("|", "/"), width)


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


def missed_calls(control: dict) -> str:
    """A control row's missed seeds by number, where the test recorded them (`missed`: the calls that came out
    right), e.g. ": call 49"."""
    missed = control.get("missed") or []
    return f": call{'s' if len(missed) > 1 else ''} {', '.join(map(str, missed))}" if missed else ""


def summarize(run: Path, commit: str, command: str, part: tuple[int, int] | None = None) -> tuple[dict, str]:
    device = (run / "device.txt").read_text().splitlines() if (run / "device.txt").exists() else []
    stamp = next((i for i, ln in enumerate(device) if re.match(r"\d{4}-\d\d-\d\dT", ln)), None)
    started = device[stamp].strip() if stamp is not None else None  # the run's start, ISO 8601: orders runs of one day
    date = started[:10] if started else "unknown"
    device = device[:stamp]  # what came before the date: a line per GPU (gpu_real.sh), or GPU, libraries, nvcc
    real = (run / "pytest_real.txt").exists()
    log = run / ("pytest_real.txt" if real else "pytest_shared.txt")
    suite = tally(log.read_text()) if log.exists() else {}
    ipc = tally((run / "pytest_ipc_mps.txt").read_text()) if (run / "pytest_ipc_mps.txt").exists() else {}
    failures, skips = short_summary(log.read_text()) if log.exists() else ([], [])
    if (run / "pytest_ipc_mps.txt").exists():  # the ipc tests under MPS: a pytest run of their own
        ipc_failures, ipc_skips = short_summary((run / "pytest_ipc_mps.txt").read_text())
        failures += [dict(f, part="ipc under MPS") for f in ipc_failures]
        skips += [dict(s, part="ipc under MPS") for s in ipc_skips]
    failed = [f["id"] for f in failures if f["outcome"] == "FAILED"]
    families = {kind: jsonl(run, kind) for kind in ("cp_attention", "moe")}
    corr, dtypes = jsonl(run, "correctness"), jsonl(run, "dtype_matrix")
    negs, probes = jsonl(run, "negative_control"), jsonl(run, "timeout_probe")
    vendor = (run / "vendor.txt").read_text().splitlines() if (run / "vendor.txt").exists() else []
    turns = gpu_turns(run)
    # every ipc test's `tsgen launch`: its exit code and last line (kept also when pytest was cut off)
    # a run whose command mutates the kernel (`mutate=`) is a negative control: it must exit 1
    ipc_runs = [{"nproc": r["nproc"], "cmd": shorten(" ".join(["python", *r["cmd"][1:]]), 110), "rc": r["rc"],
                 "expect": 1 if any("mutate=" in a for a in r["cmd"]) else 0,
                 "last": next((ln for ln in reversed((r["stderr"] + "\n" + r["stdout"]).splitlines()) if ln.strip()), "")}
                for r in jsonl(run, "ipc")]
    summary = {
        "suite": suite, "failed_tests": failed, "failures": failures, "skips": skips, "controls": controls(run),
        "ipc_under_mps": ipc, "ipc_runs": ipc_runs,
        "correctness": {"tests": len(corr), "passed": sum(r["pass"] for r in corr),
                        "worlds": dict(sorted(Counter(str(r["world"]) for r in corr).items()))},
        "dtype_matrix": {"tests": len(dtypes), "passed": sum(r["pass"] for r in dtypes)},
        "negative_controls": sorted(({"spec": r["spec"], "skew": r.get("skew"), "caught": not r["pass"]}
                                     for r in negs if "spec" in r and "pass" in r),  # one run each (`controls`: seeds)
                                    key=lambda n: (n["spec"], str(n["skew"] or ""))),  # seeds and schedule names
        "timeout_probes": {"tests": len(probes), "passed": sum(r.get("rc") == 0 for r in probes)},  # rc 0: timed out, printed, trapped
        "vendor": [ln for ln in vendor if "PASS" in ln or "FAIL" in ln],
        "gpu_turns": {"turns": len(turns), **{f"longest_{k}": max(turns, key=lambda r: r[f"{k}_s"]) for k in ("waited", "held")
                                              if turns}},
        "families": {kind: {"tests": len(rows), "passed": sum(bool(r.get("pass")) for r in rows),
                            "controls_caught": sum(bool(r.get("caught")) for r in rows),
                            "worlds": sorted({int(r["world"]) for r in rows if r.get("world") is not None})}
                     for kind, rows in families.items()},
    }
    meta = {"date": started or date, "commit": commit, "command": command, "device": device,
            **({"part": list(part)} if part else {}),
            "mode": "one GPU per rank (TSGEN_SHARE_GPUS unset): worlds larger than the GPU count skip" if real else
                    "every rank of every world on the one GPU (TSGEN_SHARE_GPUS=1), spec variants fitted per test"
                    + (f"; the test processes spread over GPUs {os.environ['TSGEN_SPREAD_GPUS']}, each seeing one of them "
                       "(tools/gpu_gate.sh SPREAD=1)" if os.environ.get("TSGEN_SPREAD_GPUS") else "")}
    title = "GPU suite, one GPU per rank" if real else "GPU suite on one GPU (shared-GPU worlds)"
    timings = "" if real else " Timings of ranks sharing a GPU measure nothing about the ops; none are reported."
    of = f", part {part[0]} of {part[1]} (the tests whose id's CRC-32 is {part[0] - 1} modulo {part[1]})" if part else ""
    md = [f"# {title}, {date}, commit {commit}{of}", "",
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
    if turns:
        t = summary["gpu_turns"]
        md.append(f"| turns on the shared GPU (a test's time limit does not count its wait) | {t['turns']}; "
                  f"longest wait {t['longest_waited']['waited_s']:.0f} s (`{t['longest_waited']['test']}`), "
                  f"longest hold {t['longest_held']['held_s']:.0f} s (`{t['longest_held']['test']}`) |")
    if (run / "vendor.txt").exists():
        md.append(f"| vendoring example (examples/vendor) | {sum('PASS' in v for v in summary['vendor'])} / "
                  f"{len(summary['vendor'])} |")
    elif not real:
        md.append(f"| vendoring example (examples/vendor) | {'in part 1' if part and part[0] != 1 else 'not run'} |")
    if summary["negative_controls"]:
        md += ["", "Negative controls (a broken kernel must FAIL):", "", "| control | skew | caught |", "|---|---|---|"]
        md += [f"| {n['spec']} | {n['skew'] if n['skew'] is not None else 'none'} | {'yes' if n['caught'] else 'NO'} |"
               for n in summary["negative_controls"]]
    if summary["controls"]:
        md += ["", "Negative controls over seeds (a seed is one call under the control's skew schedule; detection = seeds whose outputs came out wrong, i.e. caught the broken kernel, / seeds):", "",
               "| control | seeds | caught | detection |", "|---|---|---|---|"]
        md += [f"| {cell(c['control'])} | {c['seeds']} | {c['caught']} | "
               f"{c['caught']}/{c['seeds']}{'' if c['caught'] == c['seeds'] else ' (MISSED ' + str(c['seeds'] - c['caught']) + missed_calls(c) + ')'} |"
               for c in summary["controls"]]
    if failures:
        md += ["", "Failed tests (pytest's message):", "", "| test | outcome | message |", "|---|---|---|"]
        md += [f"| `{cell(f['id'], 200)}` | {f['outcome']}{' (' + f['part'] + ')' if f.get('part') else ''} | "
               f"{cell(f['message'])} |" for f in failures]
    if skips:
        md += ["", "Skips by reason:", "", "| skipped | reason | where |", "|---|---|---|"]
        md += [f"| {s['count']} | {cell(s['reason'])}{' (' + s['part'] + ')' if s.get('part') else ''} | "
               f"{cell(', '.join(s['where']), 120)} |" for s in skips]
    if ipc_runs:
        md += ["", "ipc runs (`tsgen launch`, one process per rank; a command that mutates the kernel is a negative "
               "control and must exit 1):", "", "| processes | command | exit | expected | last line |", "|---|---|---|---|---|"]
        md += [f"| {r['nproc']} | `{r['cmd'].replace('|', '/')}` | {r['rc']} | "
               f"{'1 (negative control)' if r.get('expect') else 0}{'' if r['rc'] == r.get('expect', 0) else ' UNEXPECTED'} | "
               f"{r['last'][:160].replace('|', '/')} |" for r in ipc_runs]
    return {"meta": meta, "summary": summary, "correctness": corr, "dtype_matrix": dtypes,
            "negative_control": negs, "timeout_probe": probes}, "\n".join(md) + "\n"


def missed_controls(controls: list[dict]) -> list[str]:
    """'control: caught/seeds' of every negative control that missed at some seed (call)."""
    return [f"{c['control']}: {c['caught']}/{c['seeds']}{missed_calls(c)}" for c in controls
            if c["caught"] < c["seeds"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run's folder ($OUT)")
    parser.add_argument("results", type=Path, help="the results folder (results/)")
    parser.add_argument("commit")
    parser.add_argument("command", help="the command that made the run")
    parser.add_argument("--kind", default=None,
                        help="folder under RESULTS/tests/ (default: real-gpu for gpu_real.sh's run, else shared-gpu)")
    parser.add_argument("--part", default=None, metavar="K/N",
                        help="part K of N of the suite (tools/gpu_gate.sh PART=K/N): named <date>-<commit>-partKofN")
    parser.add_argument("--require-controls", action="store_true",
                        help="exit 1 when a negative control missed at any seed (the GPU gate)")
    args = parser.parse_args(argv)
    run, results, commit = args.run, args.results, args.commit
    part = None
    if args.part:
        k, _, n = args.part.partition("/")
        if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
            parser.error(f"--part {args.part!r}: expected K/N with 1 <= K <= N")
        part = int(k), int(n)
    data, md = summarize(run, commit, args.command, part)
    kind = args.kind or ("real-gpu" if (run / "pytest_real.txt").exists() else "shared-gpu")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", kind):
        parser.error(f"--kind {kind!r}: a folder name (letters, digits, '.', '_', '-')")
    folder = results / "tests" / kind
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / (f"{data['meta']['date'][:10]}-{commit}" + (f"-part{part[0]}of{part[1]}" if part else ""))
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    stem.with_suffix(".md").write_text(md)
    print(md)
    if not args.require_controls:
        return 0
    controls = data["summary"]["controls"]
    missed = missed_controls(controls)
    print(f"negative controls: {len(controls) - len(missed)} of {len(controls)} caught at every seed"
          + (f"; MISSED: {', '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
