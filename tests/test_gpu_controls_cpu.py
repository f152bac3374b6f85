"""The negative controls of tests/test_gpu.py edit the rendered source they load; an edit that no
longer matches (a change to what the generator writes) would make the GPU test fail for the wrong
reason, or make the control vacuous. Each edit is applied here, without a GPU, through the path
the GPU test takes (render_to_cache, then harness._mutated); the plan-table edits live in
tests/mutations.py (tests/torch_checks.py uses them too); tests/test_moe_cpu.py does the same for
the MoE controls."""

from __future__ import annotations

import pytest

from conftest import ROOT


def _rendered(spec: str):
    from tsgen.harness import render_to_cache
    from tsgen.spec import load_spec

    return render_to_cache(load_spec(ROOT / spec)).source


@pytest.mark.parametrize("name", sorted(__import__("test_gpu").NEGATIVE_CONTROLS))
def test_each_text_control_edits_its_source_once(name):
    import test_gpu as gpu
    from tsgen.harness import _mutated
    from tsgen.headers import amalgamate

    old, new = gpu.NEGATIVE_CONTROLS[name]
    source = _rendered(f"specs/{name}.yaml")
    assert amalgamate(source.read_text()).count(old) == 1, (name, old)
    edited = _mutated(source, lambda text: text.replace(old, new)).read_text()
    assert old not in edited or new.startswith(old)


def test_the_wrong_chunk_offset_control_edits_one_plan_entry():
    """allgather's W 2 plan: exactly rank 1's put to rank 0 gets destination offset 0; nothing
    else in the source changes (an edit that matched nothing raised only on the GPU before,
    when the generated step tables moved their descriptions to trailing comments)."""
    from mutations import wrong_chunk_offset
    from tsgen.harness import _mutated
    from tsgen.headers import amalgamate

    source = _rendered("specs/allgather.yaml")
    before = amalgamate(source.read_text()).splitlines()
    after = _mutated(source, wrong_chunk_offset).read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 1, changed
    old, new = changed[0]
    assert "// rank 1 step 1: put to rank 0;" in old
    assert old.replace("{0, 2, 0, 1, 1, 0}", "{0, 2, 0, 1, 0, 0}", 1) == new


def test_the_reduce_without_waits_control_edits_every_reduce_step_and_nothing_else():
    """reduce_scatter's plans: every TSGEN_OP_REDUCE entry (each waits for its peers' `arrive`
    counters) gets nwait 0; no other line changes (the copies keep their entry waits)."""
    import re

    from mutations import reduce_without_waits
    from tsgen.harness import _mutated
    from tsgen.headers import amalgamate

    source = _rendered("specs/reduce_scatter.yaml")
    before = amalgamate(source.read_text()).splitlines()
    after = _mutated(source, reduce_without_waits).read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    reduces = [line for line in before if "{TSGEN_OP_REDUCE," in line]
    assert len(before) == len(after) and len(changed) == len(reduces) > 0
    for old, new in changed:
        m = re.search(r"\{TSGEN_OP_REDUCE, (\d+), (\d+), ", old)
        assert m and int(m.group(2)) > 0 and "wait arrive" in old
        assert new == old.replace(m.group(0), f"{{TSGEN_OP_REDUCE, {m.group(1)}, 0, ", 1)


def test_the_gate_parts_split_the_suite_into_disjoint_parts_that_cover_it():
    """tools/gpu_gate.sh PART=k/n: tests/conftest.py keeps a test in exactly one of the n parts."""
    import os
    import subprocess
    import sys

    def collected(part: str | None) -> set[str]:
        env = {k: v for k, v in os.environ.items() if k != "TSGEN_GATE_PART"}
        if part:
            env["TSGEN_GATE_PART"] = part
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "tests/test_gpu_controls_cpu.py", "tests/test_ulysses_gpu.py"],
                             capture_output=True, text=True, env=env, cwd=ROOT)
        assert out.returncode in (0, 5), out.stdout + out.stderr
        return {ln for ln in out.stdout.splitlines() if "::" in ln}

    whole, one, two = collected(None), collected("1/2"), collected("2/2")
    assert len(whole) > 10 and one and two
    assert one | two == whole and not one & two
    bad = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_gpu_controls_cpu.py"],
                         capture_output=True, text=True, env={**os.environ, "TSGEN_GATE_PART": "3/2"}, cwd=ROOT)
    assert bad.returncode != 0 and "TSGEN_GATE_PART='3/2'" in bad.stdout + bad.stderr
