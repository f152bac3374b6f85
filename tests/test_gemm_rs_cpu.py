"""gemm_reduce_scatter on the CPU: spec errors, render + manifest, the NumPy reference, the
sm_90a build (cubin and shared library: no spills, HGMMA, 3-D TMA), the batched schedule
(own row block last) walked on the host. Needs nvcc / cuobjdump for the build checks, no GPU."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from conftest import ROOT, shared_build_cases
from test_gemm_cpu import needs_nvcc, needs_sass
from tsgen.errors import SpecError
from tsgen.ops import get_family
from tsgen.ops.collectives import from_f64, to_f64
from tsgen.render import render
from tsgen.shipped import shipped_specs
from tsgen.spec import load_spec, spec_variant
from tsgen.headers import include_flags
from tsgen.toolchain import compile_source, dump_sass, find_nvcc, gencode_flags

SPECS = shipped_specs(op="gemm_reduce_scatter")  # OVERLAP names each one's overlap mode
BASE = ROOT / "specs" / "gemm_reduce_scatter.yaml"
OVERLAP = {"gemm_reduce_scatter": "pull", "gemm_reduce_scatter_plain": "none", "gemm_reduce_scatter_push": "push",
           "gemm_reduce_scatter_push_interleaved": "push", "gemm_reduce_scatter_odd_world": "push",
           "gemm_reduce_scatter_push_add": "push add"}


def variant(name, **changes):
    """The shipped spec with some fields changed (nested dicts merge), named NAME: a spec
    variant (tsgen.spec.spec_variant), validated as a spec file is."""
    return spec_variant(load_spec(BASE), {**changes, "name": name})


@pytest.mark.parametrize("changes,expected", [
    ({"world_sizes": [2, 3, 4]}, r"K = 8192 over 3 ranks .*multiple of 3 x 64"),
    ({"params": {"k": 4096 + 64}}, "params.k"),
    ({"params": {"n": 2000}}, "not a multiple of tile.n"),
    ({"params": {"reserve_sms": 15}}, "reserve_sms"),
    ({"params": {"overlap": "scatter"}}, "overlap"),
    ({"params": {"batch_order": "interleaved"}}, "interleaved needs overlap: push"),
    ({"params": {"batch_order": "striped"}}, "batch_order"),
    ({"params": {"reduce": "add"}}, "add needs overlap: push"),
    ({"params": {"overlap": "none", "reduce": "add"}}, "add needs overlap: push"),
    ({"params": {"overlap": "push", "reduce": "max"}}, "reduce"),
    ({"world_sizes": [1]}, "world_sizes"),
    ({"world_sizes": [16]}, "world_sizes"),
    ({"params": {"stages": 6}}, "shared"),
])
def test_bad_spec(tmp_path, changes, expected):
    with pytest.raises(SpecError, match=expected):
        variant("bad", **changes)


def test_reserve_sms_matters_to_pull_only(tmp_path):
    """push and none leave no SMs to a side kernel: an odd reserve_sms is not their problem."""
    assert variant("push15", params={"overlap": "push", "reserve_sms": 15}).model
    with pytest.raises(SpecError, match="reserve_sms"):
        variant("pull15", params={"overlap": "pull", "reserve_sms": 15})


def test_world_3_when_k_divides(tmp_path):
    spec = variant("w3", world_sizes=[2, 3, 4], params={"k": 12288}).model
    assert spec.world_sizes == [2, 3, 4]


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_render_and_manifest(path):
    r = render(load_spec(path), base=ROOT)
    m = json.loads(r.manifest)
    mode, add = OVERLAP[path.stem].split(" ")[0], OVERLAP[path.stem].endswith(" add")
    overlapped = mode != "none"
    assert m["host_launch"] and m["world_sizes"] == load_spec(path).model.world_sizes and m["count_unit"] == "rows"
    k = m["kernels"][0]
    # push encodes a tensor map of every owner's partial: the host copy of the peer table
    leading = ["peers"] + (["peers_host"] if mode == "push" else []) + ["rank", "calls", "count"]
    assert [a["role"] for a in k["launcher_args"]][:len(leading)] == leading
    # reduce: add sums into c itself: no partial slots
    names = ["calls", "a", "b", "c"] + ([] if add else ["partial"]) + (["acc"] if mode == "pull" else []) + ["sig"]
    assert [b["name"] for b in m["buffers"]] == names
    bufs = {b["name"]: b for b in m["buffers"]}
    assert bufs["a"]["elems"] == {"per_count": load_spec(path).model.params.k, "per_world_count": 0, "fixed": 0}
    if not add:
        assert bufs["partial"]["elems"] == {"per_count": 0, "per_world_count": 8192, "fixed": 0}
    assert bufs["c"]["role"] == "output" and bufs["sig"]["elems"]["fixed"] == 26
    assert "K = gemm_reduce_scatter" in r.source
    assert f"constexpr bool OVERLAP = {'true' if overlapped else 'false'};" in r.source
    # the launcher is tsgen::fused::gemm_reduce_scatter_launch (tsgen/fused.cuh), told the protocol by
    # the op's Host::MODE: add (the GEMM zeroes c and raises FREE itself, tiles are added through
    # per-owner maps of c, then a wait for every READY), push (stores through per-owner maps, then
    # the reduce sums the slots), pull (a reduce on a side stream beside the GEMM), plain
    want = {"pull": "PULL", "none": "PLAIN", "push": "PUSH_ADD" if add else "PUSH"}[mode]
    assert f"MODE = tsgen::fused::ScatterMode::{want};" in r.source
    assert r.source.count("tsgen::fused::gemm_reduce_scatter_launch<gemm_reduce_scatter") == len(m["kernels"])
    # what a mode does not use is passed as nullptr: peers_host but for push, partial with add, acc but for pull
    call = r.source.split("tsgen::fused::gemm_reduce_scatter_launch<")[1].split("\n")[0]
    args = call.split(">(", 1)[1].split(", ")
    assert args[1] == ("peers_host" if mode == "push" else "nullptr")
    assert args[8:10] == ["nullptr" if add else "partial", "acc" if mode == "pull" else "nullptr"]
    assert ("tsgen::fused::AddHook hook" in r.source) == add
    assert ("tsgen::fused::PushHook hook" in r.source) == (mode == "push" and not add)
    assert ("_reduce(char* const* peers" in r.source) == (not add)
    if mode == "push":  # stores through per-owner tensor maps; no reserved SMs, no side stream
        assert "constexpr int RESERVE_SMS = 0;" in r.source
    else:
        assert "ScatterHook<gemm_reduce_scatter" in r.source
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in r.source
    assert "cudaMemcpy" not in r.source.split("// ---- world size 2 ----")[1]


def test_reference_tiny():
    fam = get_family("gemm_reduce_scatter")
    spec = spec_variant(load_spec(BASE), {"params": {"n": 256, "k": 256}}).model
    world, count = 4, 5
    inputs = fam.make_inputs(spec, world, count, np.random.default_rng(0), pattern=False)
    assert inputs["a"][0].size == world * count * 64 and inputs["b"][0].size == 256 * 256
    ref = fam.reference(spec, world, count, inputs)["c"]
    full_a = np.concatenate([to_f64(inputs["a"][s], "bfloat16").reshape(world * count, 64) for s in range(world)],
                            axis=1)
    full_b = np.concatenate([to_f64(inputs["b"][s], "bfloat16")[:64 * 256].reshape(64, 256) for s in range(world)])
    want = full_a @ full_b  # the unsharded product
    for r in range(world):
        got = to_f64(ref[r], "bfloat16").reshape(count, 256)
        assert np.allclose(got, want[r * count:(r + 1) * count], rtol=2**-7, atol=1e-4)
    tol = fam.tolerance(spec, world, count, inputs)["c"]
    assert len(tol) == world and tol[0].shape == ref[0].shape and (tol[0] > 0).all()
    assert fam.flops(spec, 4, 2048) == 2.0 * 2048 * 256 * 256
    assert fam.bytes_moved(spec, 4, 2048) == 3 * 2048 * 256 * 2


def test_reference_pattern_exact():
    """Small integers: every product and sum is exact, so the reference is exactly A . B."""
    fam = get_family("gemm_reduce_scatter")
    spec = load_spec(ROOT / "specs" / "gemm_reduce_scatter_plain.yaml").model
    # not a spec variant: n = 64 is below tile.n, too small a shape for a valid spec (the
    # reference alone does not care), so no spec_variant can make it
    spec = spec.model_copy(update={"params": spec.params.model_copy(update={"n": 64, "k": 128})})
    inputs = fam.make_inputs(spec, 2, 3, np.random.default_rng(0), pattern=True)
    ref = fam.reference(spec, 2, 3, inputs)["c"]
    a = np.concatenate([to_f64(inputs["a"][s], "bfloat16").reshape(6, 64) for s in range(2)], axis=1)
    b = np.concatenate([to_f64(inputs["b"][s], "bfloat16")[:64 * 64].reshape(64, 64) for s in range(2)])
    want = a @ b
    for r in range(2):
        assert np.array_equal(to_f64(ref[r], "bfloat16"), to_f64(from_f64(want[3 * r:3 * r + 3].reshape(-1),
                                                                          "bfloat16"), "bfloat16"))


@needs_nvcc
@pytest.mark.parametrize("mode,path", shared_build_cases(SPECS))
def test_compiles_without_spills(tmp_path, path, mode):
    r = render(load_spec(path), base=ROOT)
    src = tmp_path / f"{r.name}.cu"
    src.write_text(r.source)
    report = compile_source(src, mode=mode).report
    kernels = {k: v for k, v in report.items() if k.endswith(("_gemm", "_reduce"))}
    per_world = 1 if OVERLAP[path.stem].endswith(" add") else 2  # add has no reduce kernel
    assert len(kernels) == per_world * len(load_spec(path).model.world_sizes), report.keys()
    for name, e in kernels.items():
        assert e["spill_stores"] == 0 and e["spill_loads"] == 0, (name, e)
        if name.endswith("_gemm"):
            assert e["stack_frame"] == 0, (name, e)


@needs_sass
@pytest.mark.parametrize("path", [BASE] + [ROOT / "specs" / f"gemm_reduce_scatter_{v}.yaml" for v in ("push", "push_add")],
                         ids=lambda p: p.stem)
def test_sass(tmp_path, path):
    r = render(load_spec(path), base=ROOT)
    src = tmp_path / f"{r.name}.cu"
    src.write_text(r.source)
    sass = dump_sass(compile_source(src, mode="shared").output)  # as built and loaded (shared_build_cases)
    assert "HGMMA.64x256x16.F32.BF16" in sass
    add = OVERLAP[path.stem].endswith(" add")  # the epilogue adds its tiles (TMA reduce) instead of storing
    assert "UTMALDG.3D" in sass and ("UTMAREDG.3D" if add else "UTMASTG.3D") in sass


WALK = r"""
#include "SOURCE"
#include <cstdlib>
// "cta batch m0 n0" per tile of a grid of `ctas`, starting at batch `first`.
int main(int argc, char** argv) {
  using C = MODULE::Config<WORLD>;
  const uint32_t rows = atoi(argv[1]), ctas = atoi(argv[2]), first = atoi(argv[3]);
  printf("K %d tiles %u\n", C::K, tsgen::gemm::Scheduler<C>::batch_tiles(rows));
  for (uint32_t b = 0; b < ctas; ++b) {
    tsgen::gemm::Scheduler<C> t(rows, b / C::CLUSTER, ctas / C::CLUSTER, b % C::CLUSTER, first);
    uint32_t m0, n0, batch;
    while (t.next(m0, n0, batch)) printf("%u %u %u %u\n", b, batch, m0, n0);
  }
}
"""


@needs_nvcc
@pytest.mark.parametrize("order", ["blocked", "interleaved"])
def test_schedule_own_block_last(tmp_path, order):
    """blocked: every CTA walks row blocks rank + 1, ..., rank (own last); interleaved: the
    walk deals tiles over the blocks in turn. Either way the arrivals the hook counts per
    block (CTA tiles x consumer warpgroups) match the tiles the schedule hands out."""
    overlap = "push" if order == "interleaved" else "pull"
    loaded = variant("w", params={"n": 512, "k": 512, "overlap": overlap, "batch_order": order})
    spec = loaded.model
    src = tmp_path / "w.cu"
    src.write_text(render(loaded, base=tmp_path).source)
    main = tmp_path / "walk.cu"
    main.write_text(WALK.replace("SOURCE", str(src)).replace("MODULE", "w").replace("WORLD", "4"))
    exe = tmp_path / "walk"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17",
                    "-o", str(exe), str(main)],
                   check=True, capture_output=True)
    tm, tn = spec.params.tile.m, spec.params.tile.n
    for rows in (1, 129, 259):
        for ctas in (2, 6, 132):
            for rank in (0, 3):
                first = (rank + 1) % 4
                lines = subprocess.run([str(exe), str(rows), str(ctas), str(first)], capture_output=True, text=True,
                                       check=True).stdout.splitlines()
                head = lines[0].split()
                assert head[1] == "128"  # K / world
                walk = [tuple(map(int, x.split())) for x in lines[1:]]
                for q in range(4):  # every CTA tile of block q counted: batch_tiles x CLUSTER
                    assert sum(1 for _, b, _, _ in walk if b == q) == int(head[3]) * 2
                stored = sorted((b, m0, n0) for _, b, m0, n0 in walk if m0 < rows)
                want = sorted((b, m0, n0) for b in range(4) for m0 in range(0, rows, tm) for n0 in range(0, 512, tn))
                assert stored == want
                if order == "interleaved":  # tile i of the whole walk belongs to block first + i mod 4
                    clusters = ctas // 2
                    for cta in range(ctas):
                        seq = [b for c, b, _, _ in walk if c == cta]
                        assert seq == [(first + (cta // 2 + j * clusters) % 4) % 4 for j in range(len(seq))]
                    continue
                for cta in range(ctas):
                    seq = [(b - first) % 4 for c, b, _, _ in walk if c == cta]
                    assert seq == sorted(seq)
                    assert not seq or seq[-1] <= 3 and all(b != rank for c, b, _, _ in walk
                                                           if c == cta and (b - first) % 4 < 3)
