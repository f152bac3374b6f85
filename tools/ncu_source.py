"""ncu's warp-stall samples per SASS instruction of one kernel launch (its SourceCounters section), read from the
report's source page and summarized: by stall reason, the hottest instructions, and the stretches between the
instructions where warps wait or hand work to another unit. Shared by tools/gpu_attention_bwd.py and
tools/gpu_attention.py (--ncu-source): tsgen's kernel beside a baseline's from the same tensors, to choose a lever
from where the step waits rather than from instruction counts (docs/design/attention.md). A saved page summarized
again: python tools/ncu_source.py PAGE.csv TITLE."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

# instructions that begin a stretch of the step in the summary: where the warps wait, or hand work to another unit
SOURCE_LANDMARKS = ("HGMMA", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "BAR.SYNC", "BAR.ARV", "SYNCS.", "UBLKRED",
                    "UTMALDG", "DEPBAR")


def source_rows(text: str) -> list[dict]:
    """The rows of ncu's source page in CSV (--page source --csv --print-source sass), as dicts: "address" (int),
    "sass" (the instruction), "samples" (warp stall samples, all), "executed" (warp-level executions, 0 where the
    page lacks "Instructions Executed") and "reasons" ({column: samples} of each stall reason's column, stall_*).
    The page opens with the kernel's name line; its versions name the address column
    "Address" or "# Address", and the samples "Warp Stall Sampling (All Samples)" (older: "(All Cycles)") or
    "# Samples"."""
    lines = text.splitlines()
    header = re.compile(r'^"?(# )?Address"?,')
    start = next((i for i, line in enumerate(lines) if header.match(line)), None)
    if start is None:
        raise ValueError("no table with an Address column in ncu's source page")
    reader = csv.DictReader(lines[start:])
    cols = [c for c in reader.fieldnames or [] if c is not None]
    table = list(reader)
    address = cols[0]
    source = next((c for c in cols if c.strip().lower() == "source"), None)
    samples = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None) or \
        next((c for c in cols if c.strip() == "# Samples"), None)
    if source is None or samples is None:
        raise ValueError(f"ncu's source page lacks a Source or a 'Warp Stall Sampling (All Samples)' column: {cols}")
    # the per-reason columns of all samples (stall_wait, ...), not their not-issued twins ("stall_wait (Not Issued)")
    reasons = [c for c in cols if c.startswith("stall_") and not re.search(r"not[- ]issued", c, re.I)]
    executed = next((c for c in cols if c.strip() == "Instructions Executed"), None)

    def number(x: str) -> float:
        try:
            return float(str(x).replace(",", "") or 0)
        except ValueError:
            return 0.0

    rows = []
    for r in table:
        try:
            at = int(str(r.get(address, "")).strip(), 16)
        except ValueError:
            continue
        rows.append({"address": at, "sass": str(r[source]).strip(), "samples": number(r[samples]),
                     "executed": number(r[executed]) if executed else 0.0,
                     "reasons": {c: n for c in reasons if (n := number(r[c]))}})
    return rows


def stall_summary(rows: list[dict], title: str, top: int = 30) -> str:
    """Where one kernel's warps stalled, from source_rows: the total, by reason, the `top` hottest instructions,
    and by stretch (from one landmark instruction, SOURCE_LANDMARKS, to the next, in address order)."""
    total = sum(r["samples"] for r in rows) or 1.0
    out = [f"# warp stall samples: {title}", f"instructions {len(rows)}, samples {total:.0f}", "", "## by reason"]
    out += [f"{n / total:7.1%}  {c}" for c, n in reasons_of(rows)]
    out += ["", f"## the {top} hottest instructions"]
    for r in sorted(rows, key=lambda r: -r["samples"])[:top]:
        out.append(f"{r['samples'] / total:7.1%}  {r['address']:#07x}  {r['sass']}")
    out += ["", "## by stretch (from a landmark instruction to the next; stretches under 0.5 % left out)"]
    stretch, start, n = 0.0, None, 0
    ordered = sorted(rows, key=lambda r: r["address"])

    def flush():
        if start is not None and stretch / total >= 0.005:
            out.append(f"{stretch / total:7.1%}  {start['address']:#07x} {start['sass'][:60]:60s} ({n} instructions)")

    for r in ordered:
        if start is None or mnemonic(r["sass"]).startswith(SOURCE_LANDMARKS):
            flush()
            stretch, start, n = 0.0, r, 0
        stretch += r["samples"]
        n += 1
    flush()
    return "\n".join(out + executed_summary(rows)) + "\n"


def mnemonic(sass: str) -> str:
    """An instruction's mnemonic without its predicate: "@!P0 SYNCS.ARRIVE.TRANS64 RZ, ..." -> "SYNCS.ARRIVE.TRANS64"."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def opcode(sass: str) -> str:
    """The mnemonic without its modifiers: "@!P0 SYNCS.ARRIVE.TRANS64 ..." -> "SYNCS"."""
    return mnemonic(sass).split(".")[0]


LOOP_PATH = (0.9, 1.1)  # executions per warp-step of the instructions on the main loop's path (executed_summary)


def executed_summary(rows: list[dict], top: int = 16) -> list[str]:
    """The instructions a kernel executes per step of its main loop, where the page has executions: the unit (one
    warp-step) is the executions of the most executed HGMMA (each wgmma of the loop runs once a step), so two
    kernels doing the same wgmma work compare step for step. By band of executions per step (the loop's path at
    about 1, the masked or rarer paths below it) with each band's stall reasons, and, on the loop's path, by opcode
    and the instructions that hold most of its two largest reasons (each with the instruction before it)."""
    step = max((r["executed"] for r in rows if opcode(r["sass"]) == "HGMMA"), default=0.0)
    if step <= 0:
        return []
    lo, hi = LOOP_PATH
    bands = [(f">= {hi} (more than once a step)", hi, float("inf")), (f"{lo} - {hi} (the loop's path)", lo, hi),
             (f"0.3 - {lo}", 0.3, lo), ("0.05 - 0.3", 0.05, 0.3), ("< 0.05 (per tile, prologue, epilogue)", 0.0, 0.05)]
    total = sum(r["samples"] for r in rows) or 1.0
    at_unit = sum(1 for r in rows if opcode(r["sass"]) == "HGMMA" and r["executed"] == step)
    # a loop whose wgmma ptxas duplicated (two copies of the step) would halve the unit: the count says so
    out = ["", f"## executed instructions per warp-step (unit: the most executed HGMMA's count, {step:.0f}, "
               f"which {at_unit} HGMMA instructions share)",
           f"all: {sum(r['executed'] for r in rows) / step:.1f}"]
    loop: list[dict] = []
    for label, low, high in bands:
        inside = [r for r in rows if r["executed"] > 0 and low <= r["executed"] / step < high]
        if (low, high) == LOOP_PATH:
            loop = inside
        out.append(f"{sum(r['executed'] for r in inside) / step:7.1f}  {label}  ({len(inside)} instructions, "
                   f"{sum(r['samples'] for r in inside) / total:.1%} of the samples)")
        by_reason = reasons_of(inside)
        if by_reason:  # where that band's warps waited, in % of all samples: two kernels compare band by band
            out.append("           " + ", ".join(f"{c} {n / total:.1%}" for c, n in by_reason[:4]))
    path: dict[str, int] = {}
    for r in loop:
        op = opcode(r["sass"])
        path[op] = path.get(op, 0) + 1
    out += ["", "on the loop's path, by opcode:"]
    out += [f"{n:7d}  {op}" for op, n in sorted(path.items(), key=lambda kv: (-kv[1], kv[0]))[:top]]
    # the loop path's instructions that hold most of its two largest reasons, each with the one before it (a
    # stall's sample falls on the instruction that waits to issue, so its cause is often the one before it,
    # or, after a BAR.SYNC.DEFER_BLOCKING, the barrier itself)
    ordered = sorted(rows, key=lambda r: r["address"])
    before = {r["address"]: p for p, r in zip(ordered, ordered[1:])}
    for reason, _ in reasons_of(loop)[:2]:
        out += ["", f"on the loop's path, the instructions with the most {reason} (% of all samples; prev: the "
                    "instruction before it)"]
        held = [r for r in loop if r["reasons"].get(reason, 0.0) > 0]
        for r in sorted(held, key=lambda r: -r["reasons"][reason])[:8]:
            prev = before.get(r["address"])
            out.append(f"{r['reasons'][reason] / total:7.1%}  {r['address']:#07x}  {r['sass'][:56]:56s}"
                       + (f"  prev: {prev['sass'][:40]}" if prev else ""))
    return out


def reasons_of(rows: list[dict]) -> list[tuple[str, float]]:
    """The stall reasons' samples summed over `rows`, largest first."""
    total: dict[str, float] = {}
    for r in rows:
        for c, n in r["reasons"].items():
            total[c] = total.get(c, 0.0) + n
    return sorted(total.items(), key=lambda kv: -kv[1])


def source_args(kernel_regex: str, stem: Path) -> list[str]:
    """The ncu arguments of one source-level profile: one launch of the kernel whose name matches `kernel_regex`
    (after those the caller's own arguments skip), its SourceCounters and WarpStateStats, into STEM.ncu-rep."""
    return ["--kernel-name", f"regex:{kernel_regex}", "--launch-count", "1", "--section", "SourceCounters",
            "--section", "WarpStateStats", "--import-source", "no", "-f", "-o", str(stem)]


def page_summary(stem: Path, title: str) -> int:
    """The source page of the report STEM.ncu-rep as CSV (STEM.csv) and its summary (STEM.txt, printed): 0, or ncu's
    exit status (1 where ncu could not run)."""
    try:
        page = subprocess.run(["ncu", "-i", f"{stem}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"ncu: {e}", file=sys.stderr)
        return 1
    stem.with_suffix(".csv").write_text(page.stdout)
    if page.returncode != 0:
        print(page.stderr[-4000:], file=sys.stderr)
        return page.returncode
    summary = stall_summary(source_rows(page.stdout), title)
    stem.with_suffix(".txt").write_text(summary)
    print(summary, flush=True)
    return 0


if __name__ == "__main__":  # a saved page summarized again: python tools/ncu_source.py CSV TITLE
    if len(sys.argv) != 3:
        sys.exit("usage: python tools/ncu_source.py PAGE.csv TITLE")
    print(stall_summary(source_rows(Path(sys.argv[1]).read_text()), sys.argv[2]), end="")
