"""The `gemm` op on the CPU: spec errors, rendering, the NumPy reference, the
sm_90a build (registers, spills, SASS, the host launcher's library) and the
persistent tile schedule, walked by the header's own Scheduler compiled as host
code. Needs nvcc (and cuobjdump for SASS) for the build checks, no GPU."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, compile_test, exhaustive, missing_tool, rendered_source, shared_build_cases, spec_problems
from sass_checks import sass_ops, vector_to_uniform_copies
from tsgen.ops import get_family
from tsgen.ops.collectives import from_f64, to_f64
from tsgen.ops.gemm import SMEM_LIMIT, smem_bytes
from tsgen.render import render
from tsgen.spec import load_spec, spec_variant
from tsgen.headers import include_flags
from tsgen.toolchain import compile_source, dump_sass, find_cuobjdump, find_nvcc, gencode_flags

SPEC = ROOT / "specs" / "gemm_bf16.yaml"
GEMM = "name: g\nop: gemm\nworld_sizes: [1]\n"



NO_NVCC = missing_tool(find_nvcc)
NO_SASS = NO_NVCC or missing_tool(find_cuobjdump)
needs_nvcc = compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
needs_sass = compile_test(NO_SASS and f"SASS checks need nvcc and cuobjdump: {NO_SASS}")


def variant(name, **changes):
    """The shipped spec with some fields changed (nested dicts merge), named NAME: a spec
    variant (tsgen.spec.spec_variant), validated as a spec file is."""
    return spec_variant(load_spec(SPEC), {**changes, "name": name})



# ---------------------------------------------------------------------------
# Spec
# ---------------------------------------------------------------------------

BAD = [
    ("n_not_whole_tiles", GEMM + "params:\n  n: 8000\n",
     ["6:3: params.n: 8000 is not a multiple of tile.n = 256"]),
    ("k_not_whole_tiles", GEMM + "params:\n  k: 1000\n",
     ["6:3: params.k: 1000 is not a multiple of tile.k = 64"]),
    ("tile_n", GEMM + "params:\n  tile: {m: 128, n: 96}\n",
     ["6:18: params.tile.n: Input should be 64, 128, 192 or 256"]),
    ("tile_k", GEMM + "params:\n  tile: {k: 32}\n",
     ["6:10: params.tile.k: Input should be 64"]),
    ("tile_m_split", GEMM + "params:\n  tile: {m: 64}\n",
     ["6:10: params.tile.m: 64 rows do not split into 64-row wgmma blocks over 2 consumer warpgroups "
      "(launch.threads 384): use a multiple of 128"]),
    ("accumulators", GEMM + "params:\n  tile: {m: 128, n: 256}\nlaunch:\n  threads: 256\n",
     ["6:3: params.tile: 128 x 256 over 1 consumer warpgroup(s) needs 256 fp32 accumulators per thread; "
      "at most 128 fit in registers (use 2 consumers, launch.threads 384, or a smaller tile)"]),
    ("shared_memory", GEMM + "params:\n  stages: 5\n",
     [f"6:3: params.stages: 5 stages of a 128 x 256 x 64 tile need 279632 bytes of shared memory; "
      f"sm_90 has {SMEM_LIMIT} per block: use fewer stages or a smaller tile"]),
    ("dtype", GEMM + "dtype: float32\n", ["5:1: dtype: Input should be 'bfloat16' or 'float16'"]),
    ("world_size", "name: g\nop: gemm\nworld_sizes: [2]\n", ["4:15: world_sizes[0]: Input should be 1"]),
    ("threads", GEMM + "launch:\n  threads: 512\n", ["6:3: launch.threads: Input should be 256 or 384"]),
    ("unroll", GEMM + "launch:\n  unroll: 4\n", ["6:3: launch.unroll: unknown key"]),
    ("blocks_cluster", GEMM + "launch:\n  blocks: 131\n",
     ["6:3: launch.blocks: 131 is not a multiple of the cluster size 2"]),
    ("cluster_along_n", GEMM + "params:\n  n: 768\n  cluster: {size: 2, along: n}\n",
     ["7:22: params.cluster.along: a cluster along n takes 2 column tiles at a time: n = 768 is not a "
      "multiple of 2 x tile.n = 512"]),
    ("cluster_along_m_narrow", GEMM + "params:\n  n: 640\n  tile: {n: 64}\n",
     ["6:3: params.cluster.along: a cluster along m splits the shared B tile into 64-column boxes, one "
      "per CTA: needs tile.n >= 128"]),
]


@pytest.mark.parametrize("text,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec(tmp_path, text, expected):
    assert spec_problems(tmp_path, text) == expected


def test_shipped_spec():
    spec = load_spec(SPEC).model
    p = spec.params
    assert (p.n, p.k, p.tile.m, p.tile.n, p.tile.k, p.stages) == (8192, 8192, 128, 256, 64, 4)
    assert (p.cluster.size, p.cluster.along, spec.launch.threads, spec.dtype) == (2, "m", 384, "bfloat16")
    assert spec.test.count % p.tile.m != 0, "the test M must leave a tail tile"
    assert smem_bytes(spec) == 4 * (128 * 64 + 64 * 256) * 2 + 2 * 2 * 8192 + 64 + 1024 <= SMEM_LIMIT


# ---------------------------------------------------------------------------
# Module ABI, manifest, rendering
# ---------------------------------------------------------------------------


def test_plan_and_manifest():
    loaded = load_spec(SPEC)
    family = get_family("gemm")
    assert family.launched_from_host(loaded.model)
    r = render(loaded, base=ROOT)
    assert r.source == render(loaded, base=ROOT).source, "rendering is deterministic"
    assert r.files() == {n: (ROOT / "generated" / n).read_text() for n in r.files()}, "generated/ is stale"
    import json

    m = json.loads(r.manifest)
    assert m["host_launch"] and m["world_sizes"] == [1] and not m["blocks_wait"]
    assert [(b["name"], b["role"], b["elems"]) for b in m["buffers"]] == [
        ("calls", "signal", {"per_count": 0, "per_world_count": 0, "fixed": 2}),
        ("a", "input", {"per_count": 8192, "per_world_count": 0, "fixed": 0}),
        ("b", "input", {"per_count": 0, "per_world_count": 0, "fixed": 8192 * 8192}),
        ("c", "output", {"per_count": 8192, "per_world_count": 0, "fixed": 0}),
    ]
    (k,) = m["kernels"]
    assert [a["name"] for a in k["launcher_args"]] == ["peers", "rank", "calls", "count", "a", "b", "c"]
    assert k["shared_bytes"] == m["constants"]["SMEM_BYTES"] == smem_bytes(loaded.model)
    assert k["block"] == [384, 1, 1] and k["grid"] == [132, 1, 1]
    # the device kernel takes the descriptors the launcher encodes
    assert ('gemm_bf16_w1_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ '
            'CUtensorMap b_map,') in r.source
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in r.source
    # CUtensorMap's types come from tsgen/gemm.cuh's <cuda.h>; nothing links against libcuda
    header = (ROOT / "templates" / "include" / "tsgen" / "gemm.cuh").read_text()
    assert '#include "tsgen/gemm.cuh"' in r.source and "#include <cuda.h>" in header
    assert "-lcuda" not in r.source + header


def test_float16_renders_f16_wgmma(tmp_path):
    loaded = variant("g16", dtype="float16")
    source = render(loaded, base=tmp_path).source
    assert "m64n256k16.f32.f16.f16" in source and "using Element = __half;" in source


# ---------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reference_on_a_tiny_case(tmp_path, dtype):
    loaded = variant("tiny", dtype=dtype, params={"n": 256, "k": 64})
    spec = loaded.model
    family = get_family("gemm")
    count = 3
    rng = np.random.default_rng(7)
    inputs = family.make_inputs(spec, 1, count, rng, pattern=False)
    a = to_f64(inputs["a"][0], dtype).reshape(count, 64)
    b = to_f64(inputs["b"][0], dtype).reshape(64, 256)
    # by hand: c[i, j] = sum over k of a[i, k] * b[k, j]
    want = np.array([[sum(a[i, k] * b[k, j] for k in range(64)) for j in range(256)] for i in range(count)])
    got = to_f64(family.reference(spec, 1, count, inputs)["c"][0], dtype).reshape(count, 256)
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=0)
    assert np.array_equal(family.reference(spec, 1, count, inputs)["c"][0], from_f64(want.reshape(-1), dtype))
    tol = family.tolerance(spec, 1, count, inputs)["c"][0]
    assert tol.shape == (count * 256,) and (tol > 0).all()
    assert (tol < 0.02 * np.abs(want).max()).all(), "the tolerance still catches a wrong element"
    # the pattern call: small integers, exact in 16 bits, so C is exact too
    pat = family.make_inputs(spec, 1, count, rng, pattern=True)
    pa = to_f64(pat["a"][0], dtype)
    assert set(np.unique(pa)) <= {-2, -1, 0, 1, 2}
    exact = pa.reshape(count, 64) @ to_f64(pat["b"][0], dtype).reshape(64, 256)
    assert np.array_equal(to_f64(family.reference(spec, 1, count, pat)["c"][0], dtype), exact.reshape(-1))


# ---------------------------------------------------------------------------
# Build: sm_90a cubin and the launcher's shared library
# ---------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.parametrize("mode,path", shared_build_cases([ROOT / "specs" / "gemm_bf16.yaml"]))
def test_compiles_without_spills(mode, path):
    res = compile_source(ROOT / "generated" / f"{path.stem}.cu", mode=mode)
    entry = res.report["gemm_bf16_w1_kernel"]
    # setmaxnreg (producer 40, consumers 232 registers) balances only at 384 x 168
    assert entry["registers"] == 168, entry
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry
    ptxas = Path(str(res.output) + ".ptxas.txt").read_text()
    assert "wgmma.mma_async instructions are serialized" not in ptxas, ptxas


@needs_nvcc
def test_launcher_library():
    lib = compile_source(ROOT / "generated" / "gemm_bf16.cu", mode="shared").output
    nm, readelf = shutil.which("nm"), shutil.which("readelf")
    if nm is None or readelf is None:
        pytest.skip("nm / readelf not found; the library built but its symbols are unchecked")
    symbols = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                             check=True).stdout
    assert re.search(r" T gemm_bf16_w1_launch$", symbols, re.M), symbols
    needed = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "libcuda.so" not in needed, "the tensor-map encoder comes through the runtime, not -lcuda"


@needs_sass
def test_sass():
    sass = dump_sass(compile_source(ROOT / "generated" / "gemm_bf16.cu", mode="shared").output)  # shared_build_cases
    ops = sass_ops(sass)
    names = [o for o, _ in ops]
    hgmma = [o + rest for o, rest in ops if o.startswith("HGMMA")]
    assert len(hgmma) == 4 and all(h.startswith("HGMMA.64x256x16.F32.BF16") and ".tnspB" in h for h in hgmma), hgmma
    for op in ("UTMALDG.2D", "UTMALDG.2D.MULTICAST", "UTMASTG.2D", "WARPGROUP.ARRIVE", "SYNCS.ARRIVE.TRANS64",
               "SYNCS.PHASECHK.TRANS64.TRYWAIT", "USETMAXREG.DEALLOC.CTAPOOL", "USETMAXREG.TRY_ALLOC.CTAPOOL"):
        assert op in names, op
    assert not [o for o in names if o.startswith(("LDL", "STL"))], "no local memory"
    assert "CALL" not in " ".join(names), "no calls (they would serialize the wgmma)"
    assert vector_to_uniform_copies(names) == 0, "the descriptors in uniform registers (ptx::warpgroup_id)"


@needs_nvcc
@pytest.mark.parametrize("changes", [  # by default the cluster along n and one consumer; the others `exhaustive`
    exhaustive({"dtype": "float16"}),
    exhaustive({"params": {"cluster": {"size": 1}}}),
    {"params": {"cluster": {"along": "n"}}},
    exhaustive({"params": {"tile": {"m": 256, "n": 128}}}),
    {"params": {"tile": {"m": 128, "n": 128}, "stages": 6}, "launch": {"threads": 256}},
], ids=["f16", "no_cluster", "cluster_n", "tile_256x128", "one_consumer"])
def test_variants_compile(tmp_path, changes):
    source = rendered_source(variant("v", **changes), tmp_path)
    entry = compile_source(source).report["v_w1_kernel"]
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry


# ---------------------------------------------------------------------------
# The persistent schedule (the header's Scheduler, compiled for the host)
# ---------------------------------------------------------------------------

WALK = r"""
#include "SOURCE"
#include <cstdlib>
// Every tile of every CTA of a grid of `ctas`: "cta m0 n0" per line.
int main(int argc, char** argv) {
  using C = MODULE::Config;
  const uint32_t rows = (uint32_t)atoi(argv[1]), ctas = (uint32_t)atoi(argv[2]);
  for (uint32_t b = 0; b < ctas; ++b) {
    tsgen::gemm::Scheduler<C> tiles(rows, b / C::CLUSTER, ctas / C::CLUSTER, b % C::CLUSTER);
    uint32_t m0, n0;
    while (tiles.next(m0, n0)) printf("%u %u %u\n", b, m0, n0);
  }
}
"""


def walker(source: Path, module: str, tmp: Path) -> Path:
    main = tmp / f"walk_{module}.cu"
    main.write_text(WALK.replace("SOURCE", str(source)).replace("MODULE", module))
    exe = tmp / f"walk_{module}"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17",
                    "-o", str(exe), str(main)],
                   check=True, capture_output=True)
    return exe


@needs_nvcc
@pytest.mark.parametrize("params", [
    {},
    {"cluster": {"along": "n"}, "raster_group": 3},
    exhaustive({"cluster": {"size": 1}, "tile": {"m": 256, "n": 128}}),
], ids=["shipped", "cluster_n", "no_cluster"])
def test_schedule_covers_every_tile_once(tmp_path, params):
    loaded = variant("s", params={"n": 2048, "k": 128, **params})
    spec = loaded.model
    p = spec.params
    exe = walker(rendered_source(loaded, tmp_path), "s", tmp_path)
    size, along = p.cluster.size, p.cluster.along
    for rows in (1, 77, 129, 257, 1000, 8192 + 77):
        for ctas in (2, 6, 132):
            out = subprocess.run([str(exe), str(rows), str(ctas)], capture_output=True, text=True, check=True).stdout
            walk = [tuple(map(int, line.split())) for line in out.splitlines()]
            per_cta: dict[int, list[tuple[int, int]]] = {}
            for cta, m0, n0 in walk:
                per_cta.setdefault(cta, []).append((m0, n0))
            stored = sorted((m0, n0) for _, m0, n0 in walk if m0 < rows)
            want = sorted((m0, n0) for m0 in range(0, rows, p.tile.m) for n0 in range(0, p.n, p.tile.n))
            assert stored == want, (rows, ctas)
            # tiles past M only pad a cluster along m to whole row pairs
            assert all(m0 < rows + (p.tile.m if size == 2 and along == "m" else 0) for _, m0, _ in walk)
            for first in range(0, ctas, size):  # the CTAs of a cluster walk in lockstep, sharing an operand
                mine = [per_cta.get(first + r, []) for r in range(size)]
                assert len({len(t) for t in mine}) == 1, (rows, ctas, first)
                for pair in zip(*mine):
                    if size == 2 and along == "m":
                        assert pair[1] == (pair[0][0] + p.tile.m, pair[0][1])
                    elif size == 2:
                        assert pair[1] == (pair[0][0], pair[0][1] + p.tile.n)


# ---------------------------------------------------------------------------
# tests/gemm_checks.py (the GPU checks): the parts that need no GPU
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool():
    import gemm_checks

    return gemm_checks


def test_gpu_tool_variants_are_valid_specs(tmp_path, tool):
    import json

    for name in tool.VARIANTS:
        manifest = json.loads(tool.variant_manifest(tmp_path, name, timeout_ms=3000).read_text())
        assert manifest["host_launch"] and manifest["timeout_ms"] == 3000, name
    assert set(tool.CHECK_VARIANTS) <= set(tool.VARIANTS)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_tool_conversions(tool, dtype):
    def values(bits):  # tsgen's host form: bf16 travels as its bits, fp16 as float16
        return to_f64(bits if dtype == "bfloat16" else bits.view(np.float16), dtype)

    x = np.random.default_rng(3).standard_normal(10000).astype(np.float32)
    bits = tool.from_f32(np, x, dtype)
    assert bits.dtype == np.uint16
    assert np.array_equal(values(bits), to_f64(from_f64(x.astype(np.float64), dtype), dtype))
    assert np.array_equal(tool.to_f32(np, bits, dtype), values(bits).astype(np.float32))
    for call in range(25):
        assert np.isnan(values(np.array([tool.nan_poison(call, dtype)], dtype=np.uint16))).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_tool_uploads_bits_into_runtime_buffers(tool, dtype):
    """The tool writes from_f32's 16-bit patterns into the runtime's buffer views. Those views
    are typed by np_dtype (float16 for fp16, uint16 for bf16): writing bits into a float16
    view converts them as numbers (the run-3 fp16 failure, rel err 8e3..7e7). The tool's
    bits16 view must hold exactly the values the kernel then reads."""
    from tsgen.runtime.world import np_dtype

    class FakeBuffers:  # Buffers.array with NumPy instead of CuPy
        def __init__(self):
            self.heap = {"a": np.zeros(1000, dtype=np_dtype(dtype))}

        def array(self, name, rank):
            return self.heap[name]

    bufs = FakeBuffers()
    x = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    view = tool.bits16(bufs, "a")
    view[...] = tool.from_f32(np, x, dtype)
    typed = bufs.heap["a"]  # what the kernel reads: bf16 bits or fp16 values
    seen = to_f64(typed, dtype)
    assert np.abs(seen - x).max() <= 2.0**-7 * np.abs(x).max()
    assert np.array_equal(tool.to_f32(np, view, dtype), seen.astype(np.float32))
