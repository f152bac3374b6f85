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
