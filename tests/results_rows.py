"""Rows that GPU tests leave for the device scripts' summaries: $TSGEN_RESULTS_DIR/KIND.jsonl (nothing
when the variable is unset). tools/summarize_shared.py reads them into results/tests/."""

from __future__ import annotations

import json
import os
import re

CONTROL_CALLS = 50  # calls (skew schedules) a negative control runs: its detection rate's denominator


def record(kind: str, row: dict) -> None:
    """Append `row` to $TSGEN_RESULTS_DIR/KIND.jsonl."""
    out = os.environ.get("TSGEN_RESULTS_DIR")
    if out:
        with open(os.path.join(out, f"{kind}.jsonl"), "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


def record_control(control: str, seeds: int, caught: int, **extra) -> None:
    """A negative control's detection: of `seeds` calls (each its own skew schedule), `caught` had a
    wrong element. One row per control run, in negative_control.jsonl."""
    record("negative_control", {"control": control, "seeds": seeds, "caught": caught, **extra})


def calls_named(problems: list[str]) -> int:
    """How many distinct calls the problem lines name ('call N: ...', 'pair N of M: ...')."""
    return len({m.group(0) for p in problems for m in [re.match(r"(call|back-to-back pair) \d+", p)] if m})
