"""tools/cp_clock_probe.py's arithmetic and report on the CPU (its GPU run: docs/design/cp_attention.md, "The clock
beside the rate"): the rate, clock and per-cycle ratios of a phase against its round's ideal, the refused
parameters, the table."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import ROOT


def probe():
    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("cp_clock_probe", ROOT / "tools" / "cp_clock_probe.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def phase(us, slow, mhz0, mhz1, watts=None):
    return {"us_per_call": us, "slow_rank": slow, "gpus": {0: {"mhz": mhz0, "watts": watts, "samples": 9},
                                                           1: {"mhz": mhz1, "watts": watts, "samples": 9}}}


def test_against_pairs_half_the_ideal_and_the_slower_ranks_clock():
    tool = probe()
    ideal = phase(7000.0, 0, 1600, None)
    # cp at 3684.2 us: (7000 / 2) / 3684.2 = 0.95 of the ideal's rate; rank 1 slower at 1520 MHz: clock 0.95
    got = tool.against(phase(3684.2, 1, 1700, 1520), ideal)
    assert got["rate"] == pytest.approx(3500 / 3684.2)
    assert got["clock"] == pytest.approx(1520 / 1600)  # the slower rank's GPU, not rank 0's
    assert got["per_cycle"] == pytest.approx((3500 / 3684.2) / (1520 / 1600))
    none = tool.against(phase(3500.0, 0, None, 1500), ideal)  # no clock sample in the window
    assert none["rate"] == pytest.approx(1.0) and none["clock"] is None and none["per_cycle"] is None


def test_params_that_change_the_work_are_refused(tmp_path):
    tool = probe()
    for key in ("causal=true", "layout=zigzag", "kv_heads=4", "tile={m: 128, n: 64}"):
        with pytest.raises(SystemExit, match="refused"):
            tool.main([str(tmp_path / "out"), "--param", key])
    assert not (tmp_path / "out").exists()  # refused before anything is made


def test_report_names_each_phase_its_round_and_the_medians():
    tool = probe()
    rounds = []
    for k in range(2):
        r = {"cp": phase(3700.0, 0, 1600, 1900, 690.0), "solo": phase(3600.0, 0, 1650, 1950, 688.0),
             "ideal": phase(7000.0, 0, 1650, 1950, 691.0),
             "order": ["cp", "solo", "ideal"] if k == 0 else ["ideal", "cp", "solo"]}
        r["ratios"] = {who: tool.against(r[who], r["ideal"]) for who in ("cp", "solo")}
        rounds.append(r)
    med = {who: {key: tool.median_of([r["ratios"][who] for r in rounds], key) for key in ("rate", "clock", "per_cycle")}
           for who in ("cp", "solo")}
    lines = tool.report(16384, rounds, med, {"cp": 2.4e-3, "solo": 2.4e-3, "ideal": 2.4e-3}, ["cp", "solo"])
    assert lines[0].endswith("(ok)") and "solo 2.40e-03" in lines[0]
    assert len(lines) == 2 + 2 * 2 + 2
    assert lines[3].split()[:2] == ["0", "solo"] and lines[3].endswith("cp,solo,ideal")
    assert lines[5].endswith("ideal,cp,solo")
    assert lines[6].startswith(f"median cp: rate {3500 / 3700:.3f}")
    wrong = tool.report(16384, rounds, med, {"cp": 2.4e-3, "solo": 0.9}, ["cp", "solo"])
    assert wrong[0].endswith("(WRONG)")
