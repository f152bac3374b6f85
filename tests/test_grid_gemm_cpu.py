"""cannon and summa on the CPU: spec errors (non-square world sizes included), render +
manifest, the copy schedule simulated (every panel written once with the right block, waits
matched, no deadlock on the per-operand copy streams) and rendered as the launcher's table,
the K-block walk of the producer hook on the host, the NumPy reference against the whole
matrices, the sm_90a build (cubin and shared library: no spills, HGMMA, TMA). Needs nvcc / cuobjdump for the build checks, no GPU."""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest

from conftest import ROOT, shared_build_cases
from test_gemm_cpu import needs_nvcc, needs_sass
from tsgen.errors import SpecError
from tsgen.ops import get_family
from tsgen.ops.collectives import to_f64
from tsgen.ops.grid_gemm import FAMILIES, A, B, schedule, walk
from tsgen.render import render
from tsgen.spec import load_spec, spec_variant
from tsgen.headers import include_flags
from tsgen.toolchain import compile_source, dump_sass, find_nvcc, gencode_flags

OPS = [f.kind for f in FAMILIES]  # cannon, summa
SPECS = [ROOT / "specs" / f"{op}.yaml" for op in OPS]


def variant(name, op="cannon", **changes):
    """specs/OP.yaml with some fields changed (nested dicts merge), named NAME: a spec variant
    (tsgen.spec.spec_variant), validated as a spec file is."""
    return spec_variant(load_spec(ROOT / "specs" / f"{op}.yaml"), {**changes, "name": name})


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("changes,expected", [
    ({"world_sizes": [2]}, r"world size 2 is not a perfect square.*q x q process grid"),
    ({"world_sizes": [3, 4]}, "world size 3 is not a perfect square"),
    ({"world_sizes": [1]}, "world_sizes"),
    ({"params": {"n": 8192 + 256}}, r"N = 8448 over a 2 x 2 grid .*multiple of 512"),
    ({"params": {"k": 8192 + 64}}, r"K = 8256 over a 2 x 2 grid .*multiple of 128"),
    ({"params": {"reserve_sms": 3}}, "reserve_sms"),
    ({"params": {"stages": 6}}, "shared"),
])
def test_bad_spec(tmp_path, op, changes, expected):
    with pytest.raises(SpecError, match=expected):
        variant("bad", op, **changes)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_render_and_manifest(path):
    r = render(load_spec(path), base=ROOT)
    m = json.loads(r.manifest)
    assert m["host_launch"] and m["world_sizes"] == [4] and m["count_unit"] == "rows"
    k = m["kernels"][0]
    assert [a["role"] for a in k["launcher_args"]][:5] == ["peers", "peers_host", "rank", "calls", "count"]
    assert [b["name"] for b in m["buffers"]] == ["calls", "a", "b", "c", "a_pan", "b_pan", "sig"]
    sizes = {b["name"]: b["elems"] for b in m["buffers"]}
    assert sizes["a"]["per_count"] == 4096 and sizes["b"]["fixed"] == 4096 * 4096
    assert sizes["c"]["per_count"] == 4096 and sizes["a_pan"]["per_count"] == 8192
    assert sizes["b_pan"]["fixed"] == 8192 * 4096
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in r.source
    assert "tsgen::grid::PanelHook<C::K_BLOCKS, C::KBP>" in r.source
    # the launcher is tsgen::grid::launch (tsgen/grid.cuh: the copies), walking this op's schedule
    assert "return tsgen::grid::launch<" in r.source and f"::STEPS_W4, peers, peers_host, rank" in r.source
    # the launcher's table is the plan's schedule
    table = re.search(r"STEPS_W4\[4\]\[(\d+)\] = \{\n(.*?)\n\};", r.source, re.S)
    rows = [[tuple(map(int, c.split(","))) for c in re.findall(r"\{(-?\d+, -?\d+, -?\d+, -?\d+, -?\d+)\}", line)]
            for line in table.group(2).splitlines()]
    want = [[(c.operand, int(c.from_input), c.slot, c.wait, c.dst) for c in steps]
            for steps in schedule(path.stem, 2)]
    assert rows == want


def simulate(op: str, q: int) -> dict:
    """Run the schedule: per rank, two in-order copy streams (A, B); a copy whose wait is not
    yet met blocks its stream. Returns each rank's panels {(rank, operand, slot): block}."""
    world = q * q
    steps = schedule(op, q)
    queues = {(r, o): [c for c in steps[r] if c.operand == o] for r in range(world) for o in (A, B)}
    panels: dict[tuple[int, int, int], tuple] = {}
    while any(queues.values()):
        progressed = False
        for (r, o), queue in queues.items():
            while queue:
                c = queue[0]
                if c.wait >= 0 and (r, o, c.wait) not in panels:
                    break  # waits for its own panel to arrive
                i, j = divmod(r, q)
                if c.from_input:
                    block = ("A", i, j) if o == A else ("B", i, j)
                else:
                    assert c.wait == c.slot, "forwards only a panel it waited for"
                    block = panels[(r, o, c.slot)]
                key = (c.dst, o, c.slot)
                assert key not in panels, f"panel {key} written twice"
                panels[key] = block
                queue.pop(0)
                progressed = True
        assert progressed, f"{op} q={q}: deadlock with {sum(map(len, queues.values()))} copies left"
    return panels


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("q", [1, 2, 3, 4, 8])
def test_schedule(op, q):
    panels = simulate(op, q)
    assert len(panels) == 2 * q * q * q  # every rank: q panels of A and q of B
    for r in range(q * q):
        i, j = divmod(r, q)
        for s in range(q):
            assert panels[(r, A, s)] == ("A", i, s) and panels[(r, B, s)] == ("B", s, j)
        assert sorted(walk(q, r)) == list(range(q))
    steps = schedule(op, q)
    for r, mine in enumerate(steps):
        i, j = divmod(r, q)
        if op == "cannon":  # neighbour shifts only, after the skew
            for c in mine:
                if not c.from_input:
                    assert c.dst == (i * q + (j - 1) % q if c.operand == A else ((i - 1) % q) * q + j)
        else:  # broadcasts along the row (A) and the column (B), no waits
            assert all(c.from_input and c.wait < 0 for c in mine)
            assert sorted(c.dst for c in mine if c.operand == A) == [i * q + x for x in range(q)]
            assert sorted(c.dst for c in mine if c.operand == B) == [x * q + j for x in range(q)]


def test_cannon_walk_meets_arrivals():
    """Cannon: the panel a rank's GEMM walks first is the one the skew delivers, the (t + 1)-th
    the one its neighbour's t-th shift delivers: arrivals come in walk order."""
    for q in (2, 3, 4):
        steps = schedule("cannon", q)
        for r in range(q * q):
            for o in (A, B):
                got = []
                for mine in steps:
                    forwards = [c for c in mine if c.operand == o and not c.from_input]
                    got += [(0, c.slot) for c in mine if c.operand == o and c.from_input and c.dst == r]
                    got += [(t + 1, c.slot) for t, c in enumerate(forwards) if c.dst == r]
                assert [s for _, s in sorted(got)] == walk(q, r)


@pytest.mark.parametrize("op", OPS)
def test_reference_tiny(tmp_path, op):
    fam = get_family(op)
    spec = variant("tiny", op, params={"n": 1024, "k": 256}).model
    world, count = 4, 5
    inputs = fam.make_inputs(spec, world, count, np.random.default_rng(0), pattern=False)
    assert inputs["a"][0].size == count * 128 and inputs["b"][0].size == 128 * 512
    ref = fam.reference(spec, world, count, inputs)["c"]
    a = np.block([[to_f64(inputs["a"][i * 2 + j], "bfloat16").reshape(count, 128) for j in range(2)]
                  for i in range(2)])
    b = np.block([[to_f64(inputs["b"][i * 2 + j], "bfloat16").reshape(128, 512) for j in range(2)]
                  for i in range(2)])
    c = a @ b  # the whole 10 x 256 x 1024 product
    for r in range(world):
        i, j = divmod(r, 2)
        got = to_f64(ref[r], "bfloat16").reshape(count, 512)
        want = c[i * count:(i + 1) * count, j * 512:(j + 1) * 512]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-2
        # C_ij = sum_s A_is B_sj block by block
        blocks = sum(to_f64(inputs["a"][i * 2 + s], "bfloat16").reshape(count, 128)
                     @ to_f64(inputs["b"][s * 2 + j], "bfloat16").reshape(128, 512) for s in range(2))
        assert np.allclose(blocks, want)
    tol = fam.tolerance(spec, world, count, inputs)["c"]
    assert len(tol) == 4 and tol[0].shape == ref[0].shape
    assert fam.flops(spec, 4, 4096) == 2.0 * 4096 * 512 * 256


@needs_nvcc
@pytest.mark.parametrize("mode,path", shared_build_cases(SPECS))
def test_compiles_without_spills(tmp_path, mode, path):
    r = render(load_spec(path), base=ROOT)
    src = tmp_path / f"{r.name}.cu"
    src.write_text(r.source)
    report = compile_source(src, mode=mode).report
    gemms = {k: v for k, v in report.items() if k.endswith("_gemm")}
    assert len(gemms) == 1
    for name, e in gemms.items():
        assert e["spill_stores"] == 0 and e["spill_loads"] == 0 and e["stack_frame"] == 0, (name, e)


@needs_sass
@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_sass(tmp_path, path):
    r = render(load_spec(path), base=ROOT)
    src = tmp_path / f"{r.name}.cu"
    src.write_text(r.source)
    sass = dump_sass(compile_source(src, mode="shared").output)  # as built and loaded (shared_build_cases)
    assert "HGMMA.64x256x16.F32.BF16" in sass
    assert "UTMALDG.2D" in sass and "UTMASTG.2D" in sass


WALK = r"""
#include "SOURCE"
#include <cstdlib>
// per rank: the K blocks its producer loads for one tile, in order
int main() {
  using C = MODULE::Config<2>;
  using H = tsgen::grid::PanelHook<C::K_BLOCKS, C::KBP>;
  for (int rank = 0; rank < 4; ++rank) {
    const uint32_t first = (rank / 2 + rank % 2) % 2 * C::KBP;
    printf("%d", rank);
    for (int kb = 0; kb < C::K_BLOCKS; ++kb) printf(" %u", H::rotate(kb, first));
    printf("\n");
  }
}
"""


@needs_nvcc
def test_k_block_walk(tmp_path):
    loaded = variant("w", params={"n": 1024, "k": 512})
    r = render(loaded, base=tmp_path)
    src = tmp_path / "w.cu"
    src.write_text(r.source)
    main = tmp_path / "walk.cu"
    main.write_text(WALK.replace("SOURCE", str(src)).replace("MODULE", "w"))
    exe = tmp_path / "walk"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17",
                    "-o", str(exe), str(main)],
                   check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    kbp = 512 // 2 // 64  # K blocks per panel
    for line in out.splitlines():
        rank, *ks = map(int, line.split())
        assert sorted(ks) == list(range(8))  # every K block once
        assert [k // kbp for k in ks[::kbp]] == walk(2, rank)  # panels in walk order, each contiguous
