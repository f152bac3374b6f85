"""allgather_gemm on the CPU: spec errors, render + manifest, the NumPy reference, the
sm_90a build (no spills, HGMMA, 3-D TMA), and the batched schedule walked on the
host. Needs nvcc / cuobjdump for the build checks, no GPU."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from conftest import ROOT, shared_build_cases
from test_gemm_cpu import needs_nvcc, needs_sass
from tsgen.errors import SpecError
from tsgen.ops import get_family
from tsgen.ops.collectives import to_f64
from tsgen.render import render
from tsgen.shipped import shipped_specs
from tsgen.spec import load_spec, spec_variant
from tsgen.headers import include_flags
from tsgen.toolchain import compile_source, dump_sass, find_nvcc, gencode_flags

SPECS = shipped_specs(op="allgather_gemm")
BASE = ROOT / "specs" / "allgather_gemm.yaml"


def variant(name, **changes):
    """The shipped spec with some fields changed (nested dicts merge), named NAME: a spec
    variant (tsgen.spec.spec_variant), validated as a spec file is."""
    return spec_variant(load_spec(BASE), {**changes, "name": name})


@pytest.mark.parametrize("changes,expected", [
    ({"params": {"n": 2000}}, "not a multiple of tile.n"),
    ({"params": {"reserve_sms": 3}}, "reserve_sms"),
    ({"params": {"overlap": "dma"}}, "overlap"),
    ({"world_sizes": [1]}, "world_sizes"),
    ({"params": {"stages": 6}}, "shared"),
])
def test_bad_spec(tmp_path, changes, expected):
    with pytest.raises(SpecError, match=expected):
        variant("bad", **changes)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_render_and_manifest(path):
    loaded = load_spec(path)
    r = render(loaded, base=ROOT)
    m = json.loads(r.manifest)
    assert m["host_launch"] and m["world_sizes"] == [2, 3, 4]
    k = m["kernels"][0]
    assert [a["role"] for a in k["launcher_args"]][:5] == ["peers", "peers_host", "rank", "calls", "count"]
    assert [b["name"] for b in m["buffers"]] == ["calls", "a", "b", "c", "a_full", "sig"]
    overlapped = loaded.model.params.overlap != "none"
    # the copies go to side streams iff overlapped: the launcher (tsgen/fused.cuh) takes OVERLAP
    assert f"allgather_gemm_launch<{r.name}::Config<2>, {r.name}::OVERLAP," in r.source
    assert ("GatherHook<allgather_gemm::OVERLAP>" in r.source) or not overlapped
    assert f"constexpr bool OVERLAP = {'true' if overlapped else 'false'};" in r.source
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in r.source


def test_reference_tiny():
    fam = get_family("allgather_gemm")
    spec = spec_variant(load_spec(BASE), {"params": {"n": 256, "k": 64}}).model
    inputs = fam.make_inputs(spec, 3, 5, np.random.default_rng(0), pattern=False)
    ref = fam.reference(spec, 3, 5, inputs)["c"]
    for r in range(3):
        full = np.concatenate([to_f64(inputs["a"][s], "bfloat16").reshape(5, 64) for s in range(3)])
        want = full @ to_f64(inputs["b"][r], "bfloat16").reshape(64, 256)
        got = to_f64(ref[r], "bfloat16").reshape(15, 256)
        assert np.allclose(got, want, rtol=2**-7, atol=1e-6)
    tol = fam.tolerance(spec, 3, 5, inputs)["c"]
    assert len(tol) == 3 and tol[0].shape == ref[0].shape
    assert fam.flops(spec, 4, 2048) == 2.0 * 4 * 2048 * 256 * 64


@needs_nvcc
@pytest.mark.parametrize("mode,path", shared_build_cases(SPECS))
def test_compiles_without_spills(tmp_path, mode, path):
    r = render(load_spec(path), base=ROOT)
    src = tmp_path / f"{r.name}.cu"
    src.write_text(r.source)
    report = compile_source(src, mode=mode).report
    gemms = {k: v for k, v in report.items() if k.endswith("_gemm")}
    if mode == "cubin":
        assert len(gemms) == 3
    for name, e in gemms.items():
        assert e["spill_stores"] == 0 and e["spill_loads"] == 0 and e["stack_frame"] == 0, (name, e)


@needs_sass
def test_sass(tmp_path):
    r = render(load_spec(BASE), base=ROOT)
    src = tmp_path / f"{r.name}.cu"
    src.write_text(r.source)
    sass = dump_sass(compile_source(src, mode="shared").output)  # as built and loaded (shared_build_cases)
    assert "HGMMA.64x256x16.F32.BF16" in sass
    assert "UTMALDG.3D" in sass and "UTMASTG.3D" in sass


WALK = r"""
#include "SOURCE"
#include <cstdlib>
// "cta batch m0 n0" per tile of a grid of `ctas`, starting at batch `first`.
int main(int argc, char** argv) {
  using C = MODULE::Config<WORLD>;
  const uint32_t rows = atoi(argv[1]), ctas = atoi(argv[2]), first = atoi(argv[3]);
  for (uint32_t b = 0; b < ctas; ++b) {
    tsgen::gemm::Scheduler<C> t(rows, b / C::CLUSTER, ctas / C::CLUSTER, b % C::CLUSTER, first);
    uint32_t m0, n0, batch;
    while (t.next(m0, n0, batch)) printf("%u %u %u %u\n", b, batch, m0, n0);
  }
}
"""


@needs_nvcc
def test_batched_schedule(tmp_path):
    loaded = variant("w", params={"n": 512, "k": 128})
    spec = loaded.model
    r = render(loaded, base=tmp_path)
    src = tmp_path / "w.cu"
    src.write_text(r.source)
    main = tmp_path / "walk.cu"
    main.write_text(WALK.replace("SOURCE", str(src)).replace("MODULE", "w").replace("WORLD", "3"))
    exe = tmp_path / "walk"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17",
                    "-o", str(exe), str(main)],
                   check=True, capture_output=True)
    tm, tn = spec.params.tile.m, spec.params.tile.n
    for rows in (1, 129, 259, 1000):
        for ctas in (2, 6, 132):
            for first in (0, 2):
                out = subprocess.run([str(exe), str(rows), str(ctas), str(first)], capture_output=True, text=True,
                                     check=True).stdout
                walk = [tuple(map(int, x.split())) for x in out.splitlines()]
                stored = sorted((b, m0, n0) for _, b, m0, n0 in walk if m0 < rows)
                want = sorted((b, m0, n0) for b in range(3) for m0 in range(0, rows, tm) for n0 in range(0, 512, tn))
                assert stored == want, (rows, ctas, first)
                for cta in range(ctas):  # each CTA walks sources first, first + 1, ... (mod 3)
                    seq = [(b - first) % 3 for c, b, _, _ in walk if c == cta]
                    assert seq == sorted(seq), (rows, ctas, first, cta)
