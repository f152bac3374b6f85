"""Turn a device run's $OUT (jsonl rows from tests/test_gpu.py) into
results/correctness.{json,md}.

Usage: python tools/summarize_gpu.py RUN_DIR RESULTS_DIR "COMMAND" "DEVICE" DATE
"""

import json
import re
import sys
from pathlib import Path


def rows(run: Path, kind: str):
    f = run / f"{kind}.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def main():
    run, out, command, device, date = Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:6]
    corr, probes, negs = rows(run, "correctness"), rows(run, "timeout_probe"), rows(run, "negative_control")
    meta = {"command": command, "device": device, "date": date}
    (out / "correctness.json").write_text(json.dumps(
        {"meta": meta, "correctness": corr, "timeout_probe": probes, "negative_control": negs}, indent=2) + "\n")
    md = [f"# tsgen ops on GPUs (primitives and collectives) ({date})", "", f"Device: {device}", "", f"Command: `{command}`", "",
          "Every call: fresh seeded data (integer pattern on call 0), poisoned outputs, bit-exact compare.", "",
          "| spec | world 2 | world 3 | world 4 |", "|---|---|---|---|"]
    by = {}
    for r in corr:
        wrong = sum(int(m.group(1)) for line in r["lines"] for m in [re.search(r"(\d+) wrong of", line)] if m)
        checked = sum(int(m.group(1)) for line in r["lines"] for m in [re.search(r"wrong of (\d+)", line)] if m)
        by.setdefault(r["spec"], {})[r["world"]] = f"{'PASS' if r['pass'] else 'FAIL'} ({wrong} wrong / {checked})"
    for spec in sorted(by):
        md.append(f"| {spec} | " + " | ".join(by[spec].get(w, "-") for w in (2, 3, 4)) + " |")
    md += ["", "## Negative controls (synchronization removed: must fail)", "",
           "| spec | removed | result |", "|---|---|---|"]
    for r in negs:
        md.append(f"| {r['spec']} | `{r['removed']}` | {'passed (BAD)' if r['pass'] else 'failed, as it must'}: "
                  f"{r['lines'][-1] if r['lines'] else ''} |")
    md += ["", "## Timeout probe (only rank 0 runs; its wait never completes)", ""]
    for r in probes:
        md += [f"`{r['spec']}` (exit {r['rc']}):", "", "```", r["output"].strip(), "```", ""]
    (out / "correctness.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[:60]))


if __name__ == "__main__":
    main()
