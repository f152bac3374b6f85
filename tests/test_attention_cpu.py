"""The `attention` op on the CPU: spec errors, rendering and the manifest, the NumPy
reference, the sm_90a build (registers, spills, wgmma serialization, SASS, the launcher
library), and the tile / KV-block walk (causal skipping, masking, offsets, zig-zag) of the
header's own tile_of / block_masked compiled as host code. Needs nvcc (and cuobjdump for
SASS) for the build checks, no GPU."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, compile_test, exhaustive, load_script, missing_tool, rendered_source, spec_problems
from sass_checks import sass_names, sass_ops, vector_to_uniform_copies
from tsgen.ops import get_family
from tsgen.ops.attention import (SMEM_LIMIT, attention_reference, flops, query_positions, smem_bytes, to_bshd,
                                 zigzag)
from tsgen.ops.collectives import to_f64
from tsgen.render import render
from tsgen.shipped import shipped_specs
from tsgen.spec import load_spec, spec_variant
from tsgen.headers import include_flags
from tsgen.toolchain import compile_module, compile_source, dump_sass, find_cuobjdump, find_nvcc, gencode_flags

SPEC = ROOT / "specs" / "attention_hd128.yaml"
SHIPPED = [p.stem for p in shipped_specs(op="attention")]
ATT = "name: a\nop: attention\nworld_sizes: [1]\n"



NO_NVCC = missing_tool(find_nvcc)
NO_SASS = NO_NVCC or missing_tool(find_cuobjdump)
needs_nvcc = compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
needs_sass = compile_test(NO_SASS and f"SASS checks need nvcc and cuobjdump: {NO_SASS}")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TSGEN_CACHE_DIR", str(tmp_path_factory.mktemp("tsgen-cache")))
    yield
    mp.undo()


def variant(name, **changes):
    """specs/attention_hd128.yaml with some fields changed (nested dicts merge), named NAME: a spec
    variant (tsgen.spec.spec_variant), validated as a spec file is."""
    return spec_variant(load_spec(SPEC), {**changes, "name": name})



# ---------------------------------------------------------------------------
# Spec
# ---------------------------------------------------------------------------

BAD = [
    ("head_dim_256", ATT + "params:\n  head_dim: 256\n", ["6:3: params.head_dim: Input should be 64 or 128"]),
    ("head_dim_96", ATT + "params:\n  head_dim: 96\n", ["6:3: params.head_dim: Input should be 64 or 128"]),
    ("kv_heads_divide", ATT + "params:\n  heads: 32\n  kv_heads: 5\n",
     ["7:3: params.kv_heads: 5 KV heads do not divide 32 query heads"]),
    ("kv_heads_more", ATT + "params:\n  kv_heads: 64\n", ["6:3: params.kv_heads: 64 KV heads do not divide 32 query heads"]),
    ("shared_memory", ATT + "params:\n  stages: 4\n",
     [f"6:3: params.stages: 4 stages of K and V blocks of 128 x 128 (+ the 128-row Q tile) need 296088 bytes of "
      f"shared memory; sm_90 has {SMEM_LIMIT} per block: use fewer stages or a smaller tile.n"]),
    ("registers", ATT + "params:\n  tile: {n: 192}\n",
     ["6:10: params.tile.n: head_dim 128 with blocks of 192 keys needs 208 accumulator registers per consumer thread "
      "(S 96, O 64, P 48); at most 200 fit: use a smaller tile.n"]),
    ("tile_m", ATT + "params:\n  tile: {m: 64}\n", ["6:10: params.tile.m: Input should be 128 or 192"]),
    ("tile_m192_threads", ATT + "params:\n  head_dim: 64\n  tile: {m: 192}\n",
     ["2:1: launch.threads: tile.m 192 (3 consumer warpgroups) needs launch.threads 512, not 384"]),
    ("tile_m192_head_dim", ATT + "params:\n  tile: {m: 192}\nlaunch:\n  threads: 512\n",
     ["6:10: params.tile.m: tile.m 192 (three consumer warpgroups of 160 registers) is for head_dim 64: head_dim "
      "128 holds 160 accumulator registers per thread"]),
    ("tile_m192_registers", ATT + "params:\n  head_dim: 64\n  tile: {m: 192, n: 176}\nlaunch:\n  threads: 512\n",
     ["7:18: params.tile.n: tile.m 192 with blocks of 176 keys needs 164 accumulator registers per consumer thread; "
      "at most 128 fit in 160: use tile.n 128"]),
    ("tile_m192_waits", ATT + "params:\n  head_dim: 64\n  kv_waits: true\n  tile: {m: 192}\nlaunch:\n  threads: 512\n",
     ["7:3: params.kv_waits: tile.m 192 has no KV waits (compiled in, they spill the 32-register producer or, "
      "at 40 / 152, the consumers): use tile.m 128"]),
    ("threads_m128", ATT + "launch:\n  threads: 512\n",
     ["6:3: launch.threads: tile.m 128 (2 consumer warpgroups) needs launch.threads 384, not 512"]),
    ("scale", ATT + "params:\n  softmax_scale: 0\n", ["6:3: params.softmax_scale: Input should be greater than 0"]),
    ("dtype", ATT + "dtype: float32\n", ["5:1: dtype: Input should be 'bfloat16' or 'float16'"]),
    ("world_size", "name: a\nop: attention\nworld_sizes: [2]\n", ["4:15: world_sizes[0]: Input should be 1"]),
    ("threads", ATT + "launch:\n  threads: 256\n", ["6:3: launch.threads: Input should be 384 or 512"]),
    ("schedule", ATT + "params:\n  schedule: dynamic\n",
     ["6:3: params.schedule: Input should be 'grid' or 'persistent'"]),
    ("row_max_chains_divide", ATT + "params:\n  tile: {n: 176}\n  row_max_chains: 8\n",
     ["7:3: params.row_max_chains: row_max_chains 8 does not divide the 44 scores per row a consumer thread holds "
      "with blocks of 176 keys (tile.n / 4): use a divisor of it"]),
    ("row_max_chains_power", ATT + "params:\n  row_max_chains: 3\n",
     ["6:3: params.row_max_chains: Input should be 2, 4 or 8"]),
    ("rescale_at_past_the_groups", ATT + "params:\n  tile: {n: 64}\n  rescale_at: 5\n",
     ["7:3: params.rescale_at: rescale_at 5: a block of 64 keys has 4 column groups of exp2 (tile.n / 16); use 0 "
      "to 4"]),
    ("rescale_at_boundary_accepted", ATT + "params:\n  tile: {n: 64}\n  rescale_at: 4\n", []),
    ("rescale_at_negative", ATT + "params:\n  rescale_at: -1\n",
     ["6:3: params.rescale_at: Input should be greater than or equal to 0"]),
    ("exp2_fma_every_one", ATT + "params:\n  exp2_fma_every: 1\n",
     ["6:3: params.exp2_fma_every: Input should be greater than or equal to 2"]),
    ("exp2_fma_every_past_the_groups", ATT + "params:\n  tile: {n: 64}\n  exp2_fma_every: 9\n",
     ["7:3: params.exp2_fma_every: exp2_fma_every 9: a consumer thread holds 8 groups of 4 exponentials of a block "
      "of 64 keys (tile.n / 8), so none would move; use 2 to 8"]),
    ("overlap_needs_persistent", ATT + "params:\n  epilogue_overlap: true\n",
     ["6:3: params.epilogue_overlap: epilogue_overlap overlaps a tile's epilogue with the next tile of the same "
      "CTA: it needs schedule: persistent (a grid of one CTA per tile has no next tile)"]),
    ("overlap_shared_memory", ATT + "params:\n  stages: 3\n  schedule: persistent\n  epilogue_overlap: true\n",
     [f"6:3: params.stages: 3 stages of K and V blocks of 128 x 128 (+ the 128-row Q tile and its O staging "
      f"(epilogue_overlap)) need 263288 bytes of shared memory; sm_90 has {SMEM_LIMIT} per block: use fewer "
      f"stages or a smaller tile.n"]),
]


@pytest.mark.parametrize("text,expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec(tmp_path, text, expected):
    assert spec_problems(tmp_path, text) == expected


def test_shipped_specs():
    for name in SHIPPED:
        spec = load_spec(ROOT / "specs" / f"{name}.yaml").model
        assert smem_bytes(spec) <= SMEM_LIMIT and spec.test.count % spec.params.tile.m != 0, name
    spec = load_spec(SPEC).model
    p = spec.params
    assert (p.head_dim, p.heads, p.kv_heads, p.causal, p.tile.m, p.tile.n, p.stages) == (128, 32, 32, False, 128, 128, 2)
    # Q tile + 2 x (K + V) stages + 10 barriers + the dynamic schedule's tile slot + alignment slack
    assert smem_bytes(spec) == 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + 8 * 10 + 8 + 1024
    sp = load_spec(ROOT / "specs" / "attention_sp.yaml").model
    assert sp.params.kv_waits and sp.params.causal and sp.params.heads // sp.params.kv_heads == 8


# ---------------------------------------------------------------------------
# Module ABI, manifest, rendering
# ---------------------------------------------------------------------------


def test_plan_and_manifest():
    loaded = load_spec(SPEC)
    family = get_family("attention")
    assert family.launched_from_host(loaded.model)
    r = render(loaded, base=ROOT)
    assert r.source == render(loaded, base=ROOT).source, "rendering is deterministic"
    for name in SHIPPED:
        rr = render(load_spec(ROOT / "specs" / f"{name}.yaml"), base=ROOT)
        assert rr.files() == {n: (ROOT / "generated" / n).read_text() for n in rr.files()}, "generated/ is stale"
    m = json.loads(r.manifest)
    assert m["host_launch"] and m["world_sizes"] == [1] and m["count_unit"] == "rows"
    per = 32 * 128
    assert [(b["name"], b["dtype"], b["role"], b["elems"]["per_count"]) for b in m["buffers"]] == [
        ("calls", "uint64", "signal", 0), ("q", "bfloat16", "input", per), ("k", "bfloat16", "input", per),
        ("v", "bfloat16", "input", per), ("o", "bfloat16", "output", per), ("lse", "float32", "output", 32)]
    (k,) = m["kernels"]
    assert [a["name"] for a in k["launcher_args"]] == ["peers", "rank", "calls", "count", "q", "k", "v", "o", "lse"]
    assert k["shared_bytes"] == m["constants"]["SMEM_BYTES"] == smem_bytes(loaded.model)
    assert k["block"] == [384, 1, 1]
    assert "attention_hd128_w1_kernel(const __grid_constant__ CUtensorMap q_map" in r.source
    assert 'extern "C" cudaError_t attention_hd128_w1_forward(const void* q' in r.source
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in r.source
    assert " %64, %65, p, 1, 1, 0, 0;" in r.source, "Q K^T: both operands K-major"
    assert " {%64, %65, %66, %67}, %68, p, 1, 1, 1;" in r.source, "P V: A in registers, V transposed"
    assert f"SCALE_LOG2 = {1 / math.sqrt(128) * math.log2(math.e)!r}f" in r.source


def test_float16_and_scale_render(tmp_path):
    loaded = variant("a16", dtype="float16", params={"softmax_scale": 0.5, "head_dim": 64})
    source = render(loaded, base=tmp_path).source
    assert "m64n64k16.f32.f16.f16" in source and "using Element = __half;" in source
    assert f"SCALE_LOG2 = {0.5 * math.log2(math.e)!r}f" in source


# ---------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------


def by_hand(q, k, v, scale, causal, qpos, kpos):
    b, sq, h, d = q.shape
    g = h // k.shape[2]
    o = np.zeros(q.shape)
    lse = np.full((b, h, sq), -np.inf)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                keys = [j for j in range(k.shape[1]) if not causal or kpos[j] <= qpos[i]]
                if not keys:
                    continue
                s = np.array([scale * float(q[bi, i, hi] @ k[bi, j, hi // g]) for j in keys])
                w = np.exp(s - s.max())
                o[bi, i, hi] = sum(wj * v[bi, j, hi // g] for wj, j in zip(w, keys)) / w.sum()
                lse[bi, hi, i] = s.max() + math.log(w.sum())
    return o, lse


@pytest.mark.parametrize("causal", [False, True])
def test_reference_by_hand(causal):
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 9, 4, 8)), rng.standard_normal((2, 11, 2, 8)), rng.standard_normal((2, 11, 2, 8))
    qpos = query_positions(9, 5, 4, 20)  # a zig-zag-like split: 5..8, then 20..24
    kpos = 3 + np.arange(11)  # keys at 3..13: rows 20.. see all, row 5 sees 3..5
    o, lse = attention_reference(q, k, v, 0.3, causal, qpos, kpos)
    want_o, want_lse = by_hand(q, k, v, 0.3, causal, qpos, kpos)
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    # a query that sees no key: O = 0, LSE = -inf
    o, lse = attention_reference(q, k, v, 0.3, True, query_positions(9), 100 + np.arange(11))
    assert (o == 0).all() and np.isneginf(lse).all()


def test_positions_and_flops():
    assert list(query_positions(6, 10, 3, 40)) == [10, 11, 12, 40, 41, 42]
    z = zigzag(4, 1, 300)
    assert list(query_positions(600, **z)[[0, 299, 300, 599]]) == [300, 599, 1800, 2099]
    assert flops(2, 8192, 8192, 32, 128, False) == 4 * 2 * 32 * 8192**2 * 128
    assert flops(2, 8192, 8192, 32, 128, True) == flops(2, 8192, 8192, 32, 128, False) / 2


def test_family_reference_and_tolerance(tmp_path):
    loaded = variant("tiny", params={"heads": 4, "kv_heads": 2, "head_dim": 64, "causal": True, "batch": 2})
    spec = loaded.model
    family = get_family("attention")
    count = 5
    inputs = family.make_inputs(spec, 1, count, np.random.default_rng(1), pattern=False)
    ref = family.reference(spec, 1, count, inputs)
    q = to_bshd(to_f64(inputs["q"][0], "bfloat16"), 2, count, 4, 64, "bshd")
    k = to_bshd(to_f64(inputs["k"][0], "bfloat16"), 2, count, 2, 64, "bshd")
    v = to_bshd(to_f64(inputs["v"][0], "bfloat16"), 2, count, 2, 64, "bshd")
    want_o, want_lse = by_hand(q, k, v, 1 / 8, True, np.arange(count), np.arange(count))
    np.testing.assert_allclose(to_f64(ref["o"][0], "bfloat16"), want_o.reshape(-1), rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(ref["lse"][0], want_lse.reshape(-1), rtol=1e-6)
    tol = family.tolerance(spec, 1, count, inputs)
    assert tol["o"][0].shape == ref["o"][0].shape and (tol["lse"][0] >= 1e-3).all()


def test_persistent_schedule_renders_the_counter_and_its_reset():
    """params.schedule: persistent (issue 33): the module's own tile counter, handed to the launcher
    with one CTA per SM; the counter's reset is the kernel's (next_tile: the draw of the call's last
    value stores 0), so no host reset and nothing between CUDA graph replays. The default renders
    none of it (the shipped specs' sources are unchanged)."""
    plain = render(load_spec(SPEC), base=ROOT)
    assert "schedule" not in plain.source and "__device__ uint64_t work" not in plain.source
    assert "PERSISTENT" not in json.loads(plain.manifest)["constants"]
    r = render(variant("ps", params={"schedule": "persistent"}), base=ROOT)
    assert "__device__ uint64_t work[tsgen::attention::WORK_SLOTS];" in r.source  # one counter per stream
    assert ("tsgen::attention::persistent<ps::Config>(\n      reinterpret_cast<const void*>(ps_w1_kernel), &ps::work, "
            "stream, &work, &blocks);") in r.source
    assert "kv_expected, blocks, stream, nullptr, -1, work, nullptr, 0,\n" in r.source
    assert "EPILOGUE_OVERLAP" not in r.source
    m = json.loads(r.manifest)
    assert m["constants"]["PERSISTENT"] == 1 and m["constants"]["SMEM_BYTES"] == smem_bytes(load_spec(SPEC).model)
    header = (ROOT / "templates" / "include" / "tsgen" / "attention.cuh").read_text()
    reset = re.search(r"static __device__ __forceinline__ uint32_t next_tile\(.*?\n}\n", header, re.S).group(0)
    assert "atom_add_relaxed_gpu_global_u64(p.work, 1ull)" in reset
    assert "if (i + 1 == (uint64_t)p.tiles) st_relaxed_gpu_global_u64(p.work, 0ull);" in reset
    o = render(variant("po", params={"schedule": "persistent", "epilogue_overlap": True}), base=ROOT)
    assert "static constexpr bool EPILOGUE_OVERLAP = po::EPILOGUE_OVERLAP != 0;" in o.source
    mo = json.loads(o.manifest)
    assert mo["constants"]["EPILOGUE_OVERLAP"] == 1
    assert mo["constants"]["SMEM_BYTES"] == smem_bytes(load_spec(SPEC).model) + 128 * 128 * 2  # O staging


def test_row_max_chains_renders_only_where_set():
    """params.row_max_chains (branch i33ilp): Config::ROW_MAX_CHAINS and the module constant only
    where a spec sets it (the shipped hd 128 spec does since 2026-11-27: 2); unset, neither (the header's default
    is the one serial chain, test_row_max_chains_sass)."""
    plain = render(variant("plain", params={"row_max_chains": None}), base=ROOT)
    assert "ROW_MAX_CHAINS" not in plain.source and "ROW_MAX_CHAINS" not in json.loads(plain.manifest)["constants"]
    r = render(variant("rc", params={"row_max_chains": 4}), base=ROOT)
    assert "static constexpr int ROW_MAX_CHAINS = rc::ROW_MAX_CHAINS;" in r.source
    assert json.loads(r.manifest)["constants"]["ROW_MAX_CHAINS"] == 4
    header = (ROOT / "templates" / "include" / "tsgen" / "attention.cuh").read_text()
    assert "struct row_max_chains_of : std::integral_constant<int, 1> {};" in header


def test_rescale_at_renders_only_where_set():
    """params.rescale_at: Config::RESCALE_AT and the module constant only where a spec sets it (0 included; the hd 128
    not-causal and hd 64 causal specs ship 4 since 2026-11-28); unset, neither, and the header's default is a block's
    every column group (the rescale after every exp2)."""
    plain = render(variant("plain", params={"rescale_at": None}), base=ROOT)  # the hd 128 spec ships 4
    assert "RESCALE_AT" not in plain.source and "RESCALE_AT" not in json.loads(plain.manifest)["constants"]
    for at in (0, 4):
        r = render(variant("ra", params={"rescale_at": at}), base=ROOT)
        assert "static constexpr int RESCALE_AT = ra::RESCALE_AT;" in r.source
        assert json.loads(r.manifest)["constants"]["RESCALE_AT"] == at
    header = (ROOT / "templates" / "include" / "tsgen" / "attention.cuh").read_text()
    assert "struct rescale_at_of : std::integral_constant<int, C::TILE_N / 16> {};" in header


def test_rescale_suite_loads(tool):
    """suites/attention-rescale.yaml: each shipped forward spec beside the other rescale order (and hd 128 not causal
    with the ping-pong, in both orders), cudnn-frontend and flash-attn-4, timed per entry; every rescale variant of
    tools/gpu_attention.py (its `--variants rescale` checks) sets rescale_at (the `_rs_after` ones unset: the order
    before)."""
    from tsgen.bench.suites import load_suite

    s = load_suite(ROOT / "suites" / "attention-rescale.yaml")
    assert s.model.baselines == ["cudnn_frontend", "flash_attn_4"] and s.model.baselines_per_entry
    at = {(e.label or e.loaded.model.name): (e.loaded.model.params.rescale_at, e.loaded.model.params.pingpong)
          for e in s.entries}
    assert at == {"attention_hd128": (4, False), "attention_hd128_rs_after": (None, False),
                  "attention_hd128_pp_rs_after": (None, True), "attention_hd128_pp": (4, True),
                  "attention_hd128_causal_gqa": (None, True), "attention_hd128_causal_gqa_rs4": (4, True),
                  "attention_hd64_causal": (4, True), "attention_hd64_causal_rs_after": (None, True)}
    assert tool.RESCALE_VARIANTS and all((tool.VARIANTS[n]["params"]["rescale_at"] is None) == n.endswith("_rs_after")
                                         for n in tool.RESCALE_VARIANTS)
    assert not set(tool.RESCALE_VARIANTS) & set(tool.TUNE_VARIANTS)  # checked, not in the default run's tuning bench
    # the tool's other variants take the shipped specs' order: rescale_at 4 but at hd 128 causal
    assert "rescale_at" not in tool.VARIANTS["hd128_full_kv32"]["params"]
    assert tool.VARIANTS["hd128_causal_kv8"]["params"]["rescale_at"] is None


def test_ilp_suite_loads(tool):
    """suites/attention-ilp.yaml: the shipped hd 128 specs beside their row_max_chains variants,
    cudnn-frontend and flash-attn-4, timed per entry; every ilp variant of tools/gpu_attention.py
    (its `--variants ilp` checks) sets row_max_chains."""
    from tsgen.bench.suites import load_suite

    s = load_suite(ROOT / "suites" / "attention-ilp.yaml")
    assert s.model.baselines == ["cudnn_frontend", "flash_attn_4"] and s.model.baselines_per_entry
    chains = {(e.label or e.loaded.model.name): e.loaded.model.params.row_max_chains for e in s.entries}
    assert chains == {"attention_hd128": 2, "attention_hd128_ilp1": None, "attention_hd128_ilp8": 8,
                      "attention_hd128_pp": None, "attention_hd128_pp_ilp2": 2,
                      "attention_hd128_causal_gqa": None, "attention_hd128_causal_gqa_ilp2": 2}
    assert [e.label for e in s.entries if e.loaded.model.params.pingpong and not e.loaded.model.params.causal] == [
        "attention_hd128_pp", "attention_hd128_pp_ilp2"]
    assert tool.ILP_VARIANTS and all(tool.VARIANTS[n]["params"]["row_max_chains"] for n in tool.ILP_VARIANTS)


def test_variant_suite_loads_and_its_variants_are_the_schedule():
    """suites/attention-variants.yaml: every entry a valid spec variant, cudnn-frontend and
    flash-attn-4 alone, timed per entry; the shipped specs' entries keep schedule grid."""
    from tsgen.bench.suites import load_suite

    s = load_suite(ROOT / "suites" / "attention-variants.yaml")
    assert s.model.baselines == ["cudnn_frontend", "flash_attn_4"] and s.model.baselines_per_entry
    schedules = {(e.label or e.loaded.model.name): e.loaded.model.params.schedule for e in s.entries}
    assert schedules["attention_hd128"] == "grid" and schedules["attention_hd128_overlap"] == "persistent"
    assert len(schedules) == len(s.entries), "labels are unique"


# ---------------------------------------------------------------------------
# Build: sm_90a cubin and the launchers' shared library
# ---------------------------------------------------------------------------


def ptxas_problems(output: Path) -> list[str]:
    text = Path(str(output) + ".ptxas.txt").read_text()
    return [line for line in text.splitlines() if re.search(r"C75(08|10|12|20)", line)]


@needs_nvcc
@pytest.mark.parametrize("name", SHIPPED)
def test_compiles_without_spills(name):
    """As the runtime loads it (the launchers' shared library): what `tsgen build --compile`
    put in the compile cache (the cubin's SASS is test_sass's)."""
    res = compile_module(ROOT / "generated" / f"{name}.cu")
    entry = res.report[f"{name}_w1_kernel"]
    # setmaxnreg balances at the launch's share: 384 threads x 168 (producer 40, two consumers 232),
    # 512 x 128 at tile.m 192 (producer 32, three consumers 160)
    threads = load_spec(ROOT / "specs" / f"{name}.yaml").model.launch.threads
    assert entry["registers"] == {384: 168, 512: 128}[threads], entry
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry
    assert ptxas_problems(res.output) == [], "no serialized wgmma, no ignored setmaxnreg"


@needs_nvcc
def test_launcher_library():
    lib = compile_module(ROOT / "generated" / "attention_sp.cu").output
    assert lib.suffix == ".so"
    nm, readelf = shutil.which("nm"), shutil.which("readelf")
    if nm is None or readelf is None:
        pytest.skip("nm / readelf not found")
    symbols = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    for sym in ("attention_sp_w1_launch", "attention_sp_w1_forward"):
        assert re.search(rf" T {sym}$", symbols, re.M), sym
    needed = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "libcuda.so" not in needed


@needs_sass
@pytest.mark.parametrize("name,head_dim", [("attention_hd128", 128), ("attention_hd64_causal", 64)])
def test_sass(name, head_dim):
    # the module `tsgen build specs --compile` built (compile cache; the shared library holds the same device
    # code as a cubin of the source): before, a cubin of each in this file's own cache, 2-4 s of nvcc apiece
    sass = dump_sass(compile_module(ROOT / "generated" / f"{name}.cu").output)
    ops = sass_ops(sass)
    names = [o for o, _ in ops]
    hgmma = [o + rest for o, rest in ops if o.startswith("HGMMA")]
    qk = [h for h in hgmma if "tnspB" not in h]
    pv = [h for h in hgmma if "tnspB" in h]
    # S = Q K^T: head_dim / 16 wgmma per block, twice (the first block and the main loop);
    # P V: 8 (blocks of 128 keys) in the loop and after it, A from registers
    assert len(qk) == 2 * head_dim // 16 and all(h.startswith("HGMMA.64x128x16.F32.BF16") for h in qk), hgmma
    assert len(pv) == 2 * 8 and all(h.startswith(f"HGMMA.64x{head_dim}x16.F32.BF16 R") for h in pv), pv
    waits = [o + rest for o, rest in ops if o == "WARPGROUP.DEPBAR"]
    assert len(waits) <= 4, f"the wgmma of one block are batched, not serialized: {waits}"
    for op in ("UTMALDG.4D", "UTMASTG.4D", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT",
               "USETMAXREG.DEALLOC.CTAPOOL", "USETMAXREG.TRY_ALLOC.CTAPOOL", "MUFU.EX2"):
        assert op in names, op
    pingpong = load_spec(ROOT / "specs" / f"{name}.yaml").model.params.pingpong
    assert ("BAR.ARV" in names) == pingpong, "the ping-pong hands turns over with bar.arrive"
    assert not [o for o in names if o.startswith(("LDL", "STL"))], "no local memory"
    assert "CALL" not in " ".join(names), "no calls (they would serialize the wgmma)"
    assert vector_to_uniform_copies(names) == 0, "the descriptors in uniform registers (ptx::warpgroup_id)"


@needs_nvcc
# By default fp16; causal without the ping-pong; persistent with the overlap, bhsd and kv_waits; hd 64 causal with
# blocks of 176 keys and 3 stages (one build per knob; the shipped specs build the rest): the others are `exhaustive`.
@pytest.mark.parametrize("changes", [
    {"dtype": "float16"},
    exhaustive({"params": {"layout": "bhsd", "kv_heads": 4}}),
    {"params": {"pingpong": False, "causal": True}},
    exhaustive({"params": {"head_dim": 64, "kv_waits": True, "kv_wait_scope": "gpu"}}),
    exhaustive({"params": {"tile": {"n": 176}}}),
    exhaustive({"params": {"schedule": "persistent"}}),
    exhaustive({"params": {"schedule": "persistent", "epilogue_overlap": True, "causal": True, "pingpong": True,
                           "kv_heads": 8}}),
    {"params": {"schedule": "persistent", "epilogue_overlap": True, "layout": "bhsd", "kv_waits": True}},
    exhaustive({"params": {"schedule": "persistent", "epilogue_overlap": True, "head_dim": 64, "causal": True,
                           "pingpong": True, "stages": 3}}),
    {"params": {"head_dim": 64, "causal": True, "pingpong": True, "stages": 3, "tile": {"n": 176}}},
], ids=["f16", "bhsd_gqa8", "no_pingpong_causal", "hd64_waits", "blocks_176", "persistent",
        "overlap_causal_gqa8", "overlap_bhsd_waits", "overlap_hd64_causal_s3", "hd64_causal_n176_s3"])
def test_variants_compile(cache, tmp_path, changes):
    res = compile_source(rendered_source(variant("v", **changes), tmp_path))
    entry = res.report["v_w1_kernel"]
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry
    assert ptxas_problems(res.output) == []


def fmnmx_chain(sass: str) -> int:
    """The longest chain of dependent FMNMX that feeds a SHFL (a row max before its reduction over
    the row's 4 threads), walking the SASS in address order."""
    depth, worst = {}, 0
    for op, rest in sass_ops(sass):
        regs = [m.group(1) if (m := re.match(r"-?\|?(R\d+)", a.strip())) else None for a in rest.split(",")]
        if op == "FMNMX":
            depth[regs[0]] = 1 + max(depth.get(r, 0) for r in regs[1:3] if r)
        elif op.startswith("SHFL") and len(regs) > 2:
            worst = max(worst, depth.get(regs[2], 0))
            depth[regs[1]] = 0
        elif regs and regs[0]:
            depth[regs[0]] = 0
    return worst


@needs_sass
@pytest.mark.parametrize("chains,causal", [(None, False), exhaustive(2, False), exhaustive(4, False), exhaustive(8, False),
                                           exhaustive(2, True), (8, True)])
def test_row_max_chains_sass(cache, tmp_path, chains, causal):
    """params.row_max_chains (branch i33ilp) at hd 128, not causal (grid) and causal GQA 32:8
    (persistent, overlap, ping-pong): 168 registers, no spills, the wgmma batched, the same
    HGMMA and MUFU.EX2 count as the shipped kernel, and each row max's chain of dependent FMNMX
    cut from 33 (a -inf seed + a thread's 32 scores of the row) to 32 / chains + log2(chains)."""
    # None: the serial chain (the hd 128 spec ships 2 since 2026-11-27); the rescale after every exp2 (the hd 128 spec
    # ships rescale_at 4 since 2026-11-28, which shares one copy of a block's exp2 between the masked and unmasked steps)
    p = {"row_max_chains": chains, "rescale_at": None}
    if causal:
        p.update(causal=True, kv_heads=8, pingpong=True, schedule="persistent", epilogue_overlap=True)
    res = compile_source(rendered_source(variant("c", params=p), tmp_path))
    entry = res.report["c_w1_kernel"]
    assert entry["registers"] == 168, entry
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry
    assert ptxas_problems(res.output) == []
    sass = dump_sass(res.output)
    names = sass_names(sass)
    assert names.count("MUFU.EX2") == 260 and len([n for n in names if n.startswith("HGMMA")]) == 32
    assert fmnmx_chain(sass) == (33 if chains is None else 32 // chains + chains.bit_length() - 1)
    assert not [o for o in names if o.startswith(("LDL", "STL"))] and "CALL" not in " ".join(names)


@needs_sass
@pytest.mark.parametrize("pingpong", [False, exhaustive(True)], ids=["grid", "pingpong"])
def test_rescale_at_moves_the_pv_wait_into_the_exp2_stream(cache, tmp_path, pingpong):
    """params.rescale_at 4 at hd 128 not causal (the shipped order since 2026-11-28) against the order before (unset):
    168 registers, no spills, the same HGMMA count (the exp2 one block's fewer: the masked and unmasked steps share
    them after prepare). In the loop's block, between its S wait (`wgmma` group 1) and the previous P V's (group 0):
    the order before runs every exp2 of the block there, rescale_at at most 16 (ptxas places the wait itself: any G
    gives 13-14 at hd 128), the O rescale's FMUL and most exp2 after the P V's wait. In both, the only mbarrier arrive
    between the two waits is K's release, and V's stage is released after the P V's wait (a V_EMPTY arrive before it
    would let the producer overwrite V while the P V reads it)."""
    def loop_split(params):
        res = compile_source(rendered_source(variant("r", params={"pingpong": pingpong, **params}), tmp_path))
        entry = res.report["r_w1_kernel"]
        assert entry["registers"] == 168 and entry["spill_stores"] == 0 and entry["stack_frame"] == 0, entry
        ops = sass_ops(dump_sass(res.output))
        names = [op for op, _ in ops]
        waits = [i for i, n in enumerate(names) if n == "WARPGROUP.DEPBAR.LE"] + [len(names)]
        # the loop's P V wait: the first whose stretch (to the next wait) holds O's rescale, 64 FMUL
        k = next(k for k in range(1, len(waits) - 1) if names[waits[k]:waits[k + 1]].count("FMUL") >= 64)
        assert "gsb0, 0x1" in ops[waits[k - 1]][1] and "gsb0, 0x0" in ops[waits[k]][1], (ops[waits[k - 1]], ops[waits[k]])
        before, after = names[waits[k - 1]:waits[k]], names[waits[k]:waits[k + 1]]
        arrives = [sum(n.startswith("SYNCS.ARRIVE") for n in stretch) for stretch in (before, after)]
        return {"exp2": names.count("MUFU.EX2"), "before": before.count("MUFU.EX2"), "after": after.count("MUFU.EX2"),
                "rescale": after.count("FMUL"), "wgmma": len([n for n in names if n.startswith("HGMMA")]),
                "arrives": arrives}
    old, early = loop_split({"rescale_at": None}), loop_split({"rescale_at": 4})
    assert old["wgmma"] == early["wgmma"] == 32 and early["exp2"] == old["exp2"] - 64, (old, early)
    assert old["after"] == 0 and old["before"] >= 64, old  # the order before: every exp2 before the P V's wait
    assert early["before"] <= 16 and early["after"] >= 48 and early["rescale"] >= 64, early  # FA4's order
    assert old["arrives"] == early["arrives"] == [1, 1], (old, early)  # K released before, V after the P V's wait


M192 = {"head_dim": 64, "tile": {"m": 192, "n": 128}}


@needs_sass
@pytest.mark.parametrize("changes", [  # by default ping-pong and not (the shipped hd 64 causal spec builds the overlap)
    exhaustive({"causal": True, "pingpong": True, "stages": 3, "schedule": "persistent", "epilogue_overlap": True}),
    exhaustive({"causal": True, "pingpong": True, "stages": 2, "schedule": "persistent", "epilogue_overlap": True,
                "kv_heads": 8}),
    exhaustive({"causal": False, "pingpong": False}),
    {"causal": False, "pingpong": True, "layout": "bhsd"},
    {"causal": True, "pingpong": False, "schedule": "persistent"},
], ids=["causal_overlap_s3", "causal_overlap_gqa8", "full_grid", "full_pingpong_bhsd", "causal_persistent_nopp"])
def test_tile_m192_compiles_without_spills(cache, tmp_path, changes):
    """tile.m 192 (three consumer warpgroups, 512 threads, setmaxnreg 32 / 160: FlashAttention-3's
    and -4's hd 64 tile): no spills (the 32-bit masks keep the masked steps in 160 registers), 128
    registers at the entry (512 x 128), the wgmma of one block batched, the ping-pong round robin."""
    loaded = variant("m", params={**M192, **changes}, launch={"threads": 512})
    res = compile_source(rendered_source(loaded, tmp_path))
    entry = res.report["m_w1_kernel"]
    assert entry["registers"] == 128, entry
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry
    assert ptxas_problems(res.output) == [], "no serialized wgmma, no ignored setmaxnreg"
    sass = dump_sass(res.output)
    ops = sass_ops(sass)
    names = [o for o, _ in ops]
    hgmma = [o + rest for o, rest in ops if o.startswith("HGMMA")]
    qk = [h for h in hgmma if "tnspB" not in h]
    pv = [h for h in hgmma if "tnspB" in h]
    assert len(qk) == 2 * 64 // 16 and all(h.startswith("HGMMA.64x128x16.F32.BF16") for h in qk), hgmma
    assert len(pv) == 2 * 8 and all(h.startswith("HGMMA.64x64x16.F32.BF16 R") for h in pv), pv
    assert len([o for o in names if o == "WARPGROUP.DEPBAR"]) <= 4, "the wgmma of one block are batched"
    setmaxnreg = [o + rest for o, rest in ops if o.startswith("USETMAXREG")]
    assert any("DEALLOC" in x and "0x20" in x for x in setmaxnreg), setmaxnreg  # producer: 32
    assert any("TRY_ALLOC" in x and "0xa0" in x for x in setmaxnreg), setmaxnreg  # consumers: 160
    assert ("BAR.ARV" in names) == changes["pingpong"]
    assert not [o for o in names if o.startswith(("LDL", "STL"))] and "CALL" not in " ".join(names)


def test_tile_m192_layout(tmp_path):
    """tile.m 192: a 192-row Q tile (and O staging) in shared memory, 512 threads; of the shipped specs
    hd 64 causal takes it (1.11-1.13x the 128-row tile at 8K-16K, docs/design/attention.md), hd 128 keeps 128."""
    loaded = variant("m", params={**M192, "causal": True, "stages": 3, "schedule": "persistent",
                                  "epilogue_overlap": True}, launch={"threads": 512})
    spec = loaded.model
    assert smem_bytes(spec) == 2 * 192 * 64 * 2 + 2 * 3 * 128 * 64 * 2 + 8 * (2 + 4 * 3) + 8 + 1024
    assert get_family("attention").abi(spec)  # the ABI builds (block = launch.threads)
    src = rendered_source(loaded, tmp_path).read_text()
    assert "__launch_bounds__(512, 1)" in src and "TILE_M = 192" in src
    assert {n: load_spec(ROOT / "specs" / f"{n}.yaml").model.params.tile.m for n in SHIPPED} == {
        n: 192 if "hd64" in n else 128 for n in SHIPPED}


@needs_nvcc
def test_printing_wait_diagnostic_serializes(cache, tmp_path):
    """Why kv_wait_diagnostic is off by default: its printf is a call, and ptxas then
    serializes every wgmma of the kernel (C7510)."""
    res = compile_source(rendered_source(variant("d", params={"kv_waits": True,
                                                                       "kv_wait_diagnostic": True}), tmp_path))
    assert any("C7510" in line for line in ptxas_problems(res.output))


# ---------------------------------------------------------------------------
# The tile / block walk (tile_of, block_masked compiled for the host)
# ---------------------------------------------------------------------------

WALK = r"""
#include "SOURCE"
#include <cstdlib>
// Every tile of a problem: "T m0 head batch blocks masked_from", then "B j masked" per KV block
// (block_masked, the definition; walk() checks the kernel's tile.masked_from against it).
// argv[8] (optional): head_group (the dynamic schedule's order); argv[9] (optional) 1: the tiles end-aligned
// (q_shift = end_shift, the single-GPU launchers' causal tiles), printed first as "S q_shift".
int main(int argc, char** argv) {
  using C = MODULE::Config;
  tsgen::attention::Problem p = {};
  p.batch = atoi(argv[1]); p.q_len = atoi(argv[2]); p.kv_len = atoi(argv[3]);
  p.q_offset = atoi(argv[4]); p.q_split = atoi(argv[5]); p.q_offset2 = atoi(argv[6]); p.kv_offset = atoi(argv[7]);
  p.head_group = argc > 8 ? atoi(argv[8]) : 0;
  p.q_shift = argc > 9 && atoi(argv[9]) ? tsgen::attention::end_shift<C>(p.q_len) : 0;
  printf("S %d\n", p.q_shift);
  p.m_tiles = (p.q_len + C::TILE_M - 1) / C::TILE_M;
  p.tiles = p.m_tiles * C::HEADS * p.batch;
  for (uint32_t t = 0; t < p.tiles; ++t) {
    const tsgen::attention::Tile tile = tsgen::attention::tile_of<C>(p, t);
    printf("T %d %u %u %d %d\n", tile.m0, tile.head, tile.batch, tile.blocks, tile.masked_from);
    for (int j = 0; j < tile.blocks; ++j) printf("B %d %d\n", j, (int)tsgen::attention::block_masked<C>(p, tile, j));
  }
}
"""


def walker(source: Path, module: str, tmp: Path) -> Path:
    main = tmp / f"walk_{module}.cu"
    main.write_text(WALK.replace("SOURCE", str(source)).replace("MODULE", module))
    exe = tmp / f"walk_{module}"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17",
                    "-w", "-o", str(exe), str(main)],
                   check=True, capture_output=True)
    return exe


def walk(exe: Path, *args) -> list:
    """[m0, head, batch, blocks, [masked per block]] per tile; asserts that the kernel's test, block j masked
    when j >= tile.masked_from, is block_masked's for every block."""
    return walk_shifted(exe, *args)[1]


def walk_shifted(exe: Path, *args) -> tuple[int, list]:
    """walk's tiles and the problem's q_shift."""
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, check=True).stdout
    tiles, froms, shift = [], [], None
    for line in out.splitlines():
        f = line.split()
        if f[0] == "S":
            shift = int(f[1])
        elif f[0] == "T":
            tiles.append([int(f[1]), int(f[2]), int(f[3]), int(f[4]), []])
            froms.append(int(f[5]))
        else:
            tiles[-1][4].append(int(f[2]))
    for tile, masked_from in zip(tiles, froms):
        assert tile[4] == [int(j >= masked_from) for j in range(tile[3])], ("masked_from", args, tile[:4], masked_from)
    return shift, tiles


PROBLEMS = [  # batch, q_len, kv_len, q_offset, q_split (None: q_len), q_offset2, kv_offset
    (2, 77, 77, 0, None, 0, 0), (1, 1000, 1000, 0, None, 0, 0), (1, 4097, 4097, 0, None, 0, 0),
    (1, 77, 1000, 0, None, 0, 0), (1, 1000, 77, 0, None, 0, 0), (1, 300, 4097, 3797, None, 0, 0),
    (1, 1000, 1000, 500, None, 0, 700), (1, 600, 2400, 300, 300, 1800, 0), (1, 1024, 2048, 0, 512, 1536, 0),
    (1, 512, 4096, 768, 256, 3072, 0), (1, 1000, 1000, 0, None, 0, 5000), (1, 1000, 0, 0, None, 0, 0),
    # offsets below 0, KV lengths at a whole number of blocks (tile.n 176: 176, 352), a split below 0
    (1, 300, 600, 0, None, 0, -300), (1, 500, 352, 100, None, 0, -77), (1, 176, 176, 0, None, 0, 0),
    (1, 400, 704, -200, 200, 300, 0),
]


@needs_nvcc
@pytest.mark.parametrize("causal,M", [(False, 128), exhaustive(True, 128), exhaustive(False, 192), (True, 192)])
def test_walk_covers_tiles_and_masks_exactly(tmp_path, causal, M):
    """Causal also with head_group 2 and 4: the dynamic schedule's order (groups of head_group
    (batch, head) pairs, the last of 3 batches x 2 heads smaller with 4), which must still give
    every tile once; and end-aligned (the single-GPU launchers' q_shift, one query segment): the tiles
    start q_shift rows below 0, q_shift the multiple of 64 at or under m_tiles M - q_len, so the partial
    tile is the first, and every row in [0, q_len) still lies in exactly one tile. M 192: three consumer
    warpgroups (head dim 64, blocks of 128 keys)."""
    name = "w"
    if M == 128:
        loaded = variant(name, params={"causal": causal, "heads": 2, "kv_heads": 1, "tile": {"n": 176}})
    else:
        loaded = variant(name, params={"causal": causal, "heads": 2, "kv_heads": 1, "head_dim": 64,
                                       "tile": {"m": 192, "n": 128}}, launch={"threads": 512})
    exe = walker(rendered_source(loaded, tmp_path), name, tmp_path)
    N = 176 if M == 128 else 128
    problems = PROBLEMS + [(3, 300, 300, 0, None, 0, 0)]
    runs = [(x, g, False) for g in ((0, 2, 4) if causal else (0,)) for x in problems]
    runs += [(x, g, True) for g in (0, 4) for x in problems if causal and x[4] is None]  # one segment
    shifted = 0
    for (b, sq, skv, qo, split, qo2, ko), head_group, aligned in runs:
        split = sq if split is None else split
        shift, tiles = walk_shifted(exe, b, sq, skv, qo, split, qo2, ko, head_group, int(aligned))
        assert shift == ((-(-sq // M) * M - sq) // 64 * 64 if aligned else 0), ("end_shift", sq, shift)
        shifted += shift > 0
        starts = range(-shift, sq, M)
        assert sorted(t[:3] for t in tiles) == sorted([m0, h, bi] for m0 in starts for h in range(2)
                                                      for bi in range(b)), "every tile once"
        if causal and not head_group:  # longest tiles first within each head
            assert [t[0] for t in tiles[: len(starts)]] == sorted(starts, reverse=True)
        elif causal:  # per group: the last query tile of each of its pairs, then the one before, ...
            pairs = [(bi, h) for bi in range(b) for h in range(2)]
            want = [[m0, h, bi] for g in range(0, len(pairs), head_group)
                    for m0 in sorted(starts, reverse=True) for bi, h in pairs[g:g + head_group]]
            assert [t[:3] for t in tiles] == want
        qp, kp = query_positions(sq, qo, split, qo2), ko + np.arange(skv)
        for m0, _, _, blocks, masked in tiles:
            rows = qp[max(m0, 0):min(m0 + M, sq)]
            vis = (kp[None, :] <= rows[:, None]) if causal else np.ones((len(rows), skv), bool)
            cols = np.nonzero(vis.any(axis=0))[0]
            need = cols.max() // N + 1 if len(cols) else 0
            assert blocks == need, ("the blocks loaded are exactly the ones with a visible key", m0, blocks, need)
            for j in range(blocks):
                blk = np.zeros((len(rows), N), bool)
                lo, hi = j * N, min((j + 1) * N, skv)
                blk[:, : hi - lo] = vis[:, lo:hi]
                assert masked[j] == (not blk.all()), ("masked exactly where a key is hidden", m0, j)
    assert shifted or not causal, "no problem here is end-aligned with a shift: the case tests nothing new"


# ---------------------------------------------------------------------------
# tools/gpu_attention.py: the parts that need no GPU
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool():
    return load_script(ROOT / "tools" / "gpu_attention.py")


def test_gpu_tool_variants_are_valid_specs(tmp_path, tool):
    for name in tool.VARIANTS:
        tool.variant_spec(name)  # raises SpecError if the variant is not a valid spec


@pytest.mark.parametrize("name, spec", [
    ("hd128_full_kv32", "specs/attention_hd128.yaml"),
    ("hd128_causal_kv8_overlap", "specs/attention_hd128_causal_gqa.yaml"),
    ("hd64_causal_kv32_m192_rs4", "specs/attention_hd64_causal.yaml"),
])
def test_gpu_tool_variant_is_the_shipped_spec(tool, name, spec):
    """The tool's variants that its profiles and timelines name as a shipped spec's kernel build that spec's params
    and threads (until 2026-11-29 the causal ones kept the hd 128 spec's row_max_chains 2, which no causal spec
    ships: the hd 64 causal profiles of that day measured that kernel; docs/design/attention.md)."""
    from tsgen.spec import load_spec

    built, shipped = tool.variant_spec(name).model, load_spec(ROOT / spec).model
    a, b = built.params.model_dump(), shipped.params.model_dump()
    assert {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)} == {}
    assert built.launch.threads == shipped.launch.threads
    assert set(tool.CHECK_VARIANTS) | set(tool.BENCH_VARIANTS) | set(tool.TUNE_VARIANTS) <= set(tool.VARIANTS)
    assert set(tool.SCHEDULE_VARIANTS) <= set(tool.VARIANTS) and not set(tool.SCHEDULE_VARIANTS) & set(tool.TUNE_VARIANTS)
    assert all(tool.variant_spec(n).model.params.schedule == "persistent" for n in tool.SCHEDULE_VARIANTS
               if "_persistent" in n or "_overlap" in n)


def test_gpu_tool_report(tool):
    row = {"variant": "v", "head_dim": 128, "kv_heads": 32, "causal": False, "seq": 8192, "batch": 2}
    summary = {
        "device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "cudnn": 91900, "date": "2026-11-23 15:19 UTC",
        "command": "python tools/gpu_attention.py out", "all_checks_pass": False, "seconds": 61.0,
        "bench": [{**row, "impl": "tsgen", "ms": 3.3, "tflops": 660.0, "rel_err_vs_sdpa": 1e-3, "suspect": False},
                  {**row, "impl": "SDPA flash", "ms": 6.6, "tflops": 330.0},
                  {**row, "impl": "SDPA cuDNN", "ms": 3.2, "tflops": 680.0}],
        "checks": {"a": {"pass": True, "rows": [{"case": "seq 77", "calls": 1, "rel_err": 2e-3, "lse_err": 1e-7,
                                                  "nan": 0, "lse_inf_mismatch": 0, "guard_written": 0, "pass": True}]},
                   "b": {"pass": False, "crashed": ["CUDA error: unspecified launch failure"]}},
    }
    text = tool.markdown(summary)
    assert "| 128 | 32 | no | 8192 | 660 | 330 | 680 | 0.97 | 1.0e-03 |" in text
    assert "| a | seq 77 | 1 | 2.0e-03 | 1.0e-07 | 0 | 0 | 0 | PASS |" in text
    assert "CRASHED: CUDA error: unspecified launch failure" in text and "All checks: FAIL" in text


def test_o_tolerance_holds_the_kernels_rounding_and_catches_zero_and_stale_outputs():
    """o_tolerance against a float64 emulation of what the kernel rounds (P to bf16 before P V, O
    to bf16): every element within it, with room; an all-zero O and O computed with one stale
    chunk of V (another call's values) fail in many elements (at world 8 the old bound, two units
    of max|v|, let an all-zero O pass in most elements)."""
    from tsgen.ops.attention import attention_reference, o_tolerance
    from tsgen.ops.collectives import from_f64, to_f64

    def bf16(x):
        return to_f64(from_f64(np.ascontiguousarray(x).reshape(-1), "bfloat16"), "bfloat16").reshape(x.shape)

    rng = np.random.default_rng(5)
    b, s, h, d = 1, 256, 2, 64
    q, k, v = (bf16(rng.standard_normal((b, s, h, d))) for _ in range(3))
    scale = d ** -0.5
    o, _, o_abs = attention_reference(q, k, v, scale, False, with_abs=True)
    tol = o_tolerance(o, o_abs, "bfloat16")
    # the kernel: P = exp(s - m) rounded to bf16 for P V, the sum l in fp32 of the unrounded P
    worst = 0.0
    for hi in range(h):
        sc = scale * q[0, :, hi] @ k[0, :, hi].T
        p = np.exp(sc - sc.max(axis=1, keepdims=True))
        got = bf16((bf16(p) @ v[0, :, hi]) / p.sum(axis=1, keepdims=True))
        worst = max(worst, float((np.abs(got - o[0, :, hi]) / tol[0, :, hi]).max()))
    assert worst < 0.5, worst  # within half the bound
    assert (np.abs(0 - o) > tol).mean() > 0.8  # an all-zero O
    stale = v.copy()
    stale[:, : s // 8] = bf16(rng.standard_normal((b, s // 8, h, d)))  # one chunk of 8 from another call
    o_stale, _ = attention_reference(q, k, stale, scale, False)
    assert (np.abs(o_stale - o) > tol).mean() > 0.05


# ---------------------------------------------------------------------------
# The bench's check of timed outputs (issue 33 item 4): rows over the whole sequence, each
# against its own norm, so a kernel that drops the last keys fails
# ---------------------------------------------------------------------------

S_CHECK, KEPT = 16384, 12288  # 16K causal; the broken output ignores every key past 0.75 S


def test_check_rows_spread_over_the_sequence():
    from tsgen.ops.attention import CHECK_ROWS, check_query_rows

    for count in (1, 2, 77, 1000, S_CHECK):
        rows = check_query_rows(count)
        assert rows[0] == 0 and rows[-1] == count - 1 and len(set(rows)) == len(rows)
        assert len(rows) >= min(CHECK_ROWS, count)
        if count >= CHECK_ROWS:  # no stretch of the sequence unseen
            assert np.diff(rows).max() <= -(-count // (CHECK_ROWS - 1)) + 1
            assert count - 2 in rows


def _bf16(x):
    from tsgen.ops.collectives import from_f64

    return from_f64(x, "bfloat16")


def test_check_rows_fails_an_output_that_drops_the_last_keys():
    """At 16K causal, an O computed as if every key past 0.75 S did not exist fails the bench's
    check, the true O (rounded to bf16, as the kernel's) passes. Both are right at every row
    below 0.75 S, so a check of a few rows or of one pooled error passes both (it did before
    issue 33: 4 rows, one norm)."""
    from tsgen.bench.runner import MAX_REL_ERR
    from tsgen.ops.attention import check_query_rows

    loaded = spec_variant(load_spec(ROOT / "specs" / "attention_hd64_causal.yaml"),
                          {"name": "chk", "params": {"heads": 2, "kv_heads": 1}})
    family = get_family("attention")
    rng = np.random.default_rng(7)
    d = 64
    raw = {n: _bf16(rng.standard_normal(S_CHECK * h * d)) for n, h in (("q", 2), ("k", 1), ("v", 1))}
    q, k, v = (to_f64(raw[n], "bfloat16").reshape(1, S_CHECK, -1, d) for n in ("q", "k", "v"))
    rows = check_query_rows(S_CHECK)
    scale = 1 / math.sqrt(d)
    outputs = {}
    for name, keys in (("true", S_CHECK), ("drops keys", KEPT)):
        o = np.zeros((1, S_CHECK, 2, d))
        o[:, rows] = attention_reference(q[:, rows], k[:, :keys], v[:, :keys], scale, True, q_pos=rows)[0]
        outputs[name] = _bf16(o.reshape(-1))

    def check(o):
        bufs = {**raw, "o": o}
        return family.bench.check_rows(family, loaded.model, 1, S_CHECK, lambda n, r, a, b: bufs[n][a:b])

    assert check(outputs["true"]) <= MAX_REL_ERR
    assert check(outputs["drops keys"]) > 10 * MAX_REL_ERR


SLOTS = r"""
#include "tsgen/attention.cuh"
#include <stdio.h>
#include <stdint.h>
// work_slot is host code: no CUDA call, so this runs on a machine without a GPU
int main() {
  using tsgen::attention::work_slot;
  for (int device = 0; device < 2; ++device)
    for (uintptr_t s = 0; s < 70; ++s) printf("%d %lu %u\n", device, (unsigned long)s, work_slot(device, (cudaStream_t)(s * 16)));
  // asked again: the same slots
  for (uintptr_t s = 0; s < 70; ++s) printf("again 0 %lu %u\n", (unsigned long)s, work_slot(0, (cudaStream_t)(s * 16)));
}
"""


@needs_nvcc
def test_persistent_counter_slot_per_stream(tmp_path):
    """The persistent schedule's tile counter of a call is its stream's (tsgen::attention::work_slot):
    the first WORK_SLOTS (64) streams a device sees get 64 different slots, the same stream always
    its own, each device counts apart, and streams past 64 wrap round robin (shared: such calls must
    not overlap, as the launcher's comment says)."""
    src = tmp_path / "slots.cu"
    src.write_text(SLOTS)
    exe = tmp_path / "slots"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17", "-w", "-o", str(exe),
                    str(src)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    first = {(int(d), int(s)): int(x) for d, s, x in (ln.split() for ln in out if ln and not ln.startswith("again"))}
    again = {int(s): int(x) for _, _, s, x in (ln.split() for ln in out if ln.startswith("again"))}
    for device in (0, 1):
        slots = [first[device, s] for s in range(70)]
        assert sorted(slots[:64]) == list(range(64)), slots
        assert slots[64:] == list(range(6)), "past 64 streams: round robin from slot 0"
    assert again == {s: first[0, s] for s in range(70)}


def test_two_stream_check_and_its_control(tmp_path, monkeypatch):
    """tools/gpu_attention.py's schedule checks include the two-stream case's negative control: the
    persistent causal overlap variant built with -DTSGEN_ATTENTION_ONE_WORK_SLOT (every stream on one
    tile counter), marked so that check_variant expects that case to fail; the header's hook returns
    slot 0 before the table."""
    tool = load_script(ROOT / "tools" / "gpu_attention.py")
    assert "hd128_causal_kv8_overlap_one_slot" in tool.SCHEDULE_VARIANTS
    flags = []
    monkeypatch.setattr(tool, "build_loaded", lambda out, loaded, extra=None: flags.append(extra) or {"manifest": "m"})
    assert tool.build(tmp_path, "hd128_causal_kv8_overlap_one_slot")["one_slot"] is True
    assert "one_slot" not in tool.build(tmp_path, "hd128_causal_kv8_overlap")
    assert flags == [["-DTSGEN_ATTENTION_ONE_WORK_SLOT"], None]
    header = (ROOT / "templates" / "include" / "tsgen" / "attention.cuh").read_text()
    hook = header[header.index("static inline uint32_t work_slot("):]
    assert hook.index("#ifdef TSGEN_ATTENTION_ONE_WORK_SLOT") < hook.index("return 0;") < hook.index("static std::mutex")


@pytest.mark.parametrize("baseline", [None, "fa4"])
def test_forward_tool_ncu_source_profiles_one_launch(tmp_path, monkeypatch, baseline):
    """tools/gpu_attention.py --ncu-source VARIANT [--ncu-baseline fa4]: one ncu run over a child that calls the
    variant's forward (or FA4's on the same tensors: child kind one_fa4), one launch of the kernel named by
    SOURCE_KERNELS after a warm call, the clocks left alone; then the source page summarized (tools/ncu_source.py).
    No GPU: the build, ncu and the page are stubs."""
    tool = load_script(ROOT / "tools" / "gpu_attention.py")
    import ncu_source

    runs, pages = [], []
    monkeypatch.setattr(tool, "build", lambda out, name, *a: {"manifest": "m", "library": "l", "softmax_scale": None})

    class Done:
        returncode = 0
        stdout = 'RESULT hd128_causal_kv8 {"pass": true}\n'
        stderr = ""

    monkeypatch.setattr(tool.subprocess, "run", lambda cmd, **kw: runs.append(cmd) or Done())
    monkeypatch.setattr(ncu_source, "page_summary", lambda stem, title: pages.append((stem, title)) or 0)
    argv = ["gpu_attention.py", str(tmp_path), "--ncu-source", "hd128_causal_kv8"]
    monkeypatch.setattr(tool.sys, "argv", argv + (["--ncu-baseline", baseline] if baseline else []))
    assert tool.main() == 0
    (cmd,) = runs
    who = baseline or "tsgen"
    assert cmd[:3] == ["ncu", "--clock-control", "none"] and f"regex:{tool.SOURCE_KERNELS[who]}" in cmd
    assert cmd[cmd.index("--launch-skip") + 1] == "1" and cmd[cmd.index("--launch-count") + 1] == "1"
    assert "SourceCounters" in cmd and cmd[-4:] == [str(tmp_path), "--child", "one_fa4" if baseline else "one",
                                                     "hd128_causal_kv8"]
    assert pages == [(tmp_path / f"src_{who}_hd128_causal_kv8", f"{who} hd128_causal_kv8 S 8192 (forward)")]
    monkeypatch.setattr(tool.sys, "argv", ["gpu_attention.py", str(tmp_path), "--ncu-baseline", "fa4"])
    with pytest.raises(SystemExit):
        tool.main()  # a baseline without the variant


def test_forward_tool_ab_report_and_a_tree_without_tsgen(tool, tmp_path, monkeypatch):
    """--base-tree: the report names the base commit and each build's failed cases, x with its range; a folder
    that holds no tsgen/ is refused before anything builds."""
    s = {"device": "H200", "date": "d", "command": "c", "base": "abc1234", "rounds": 10, "settle": 1,
         "checks": {"attention_hd128": {"pass": True, "rows": [{"case": "seq 77", "pass": True}]},
                    "attention_hd128_base": {"pass": False, "rows": [{"case": "seq 4097", "pass": False}]}},
         "bench": [{"spec": "attention_hd128", "seq": 8192, "batch": 2, "x": {"ratio": 1.021, "min": 0.99, "max": 1.05},
                    "tsgen": {"tflops": 650.4, "rel_err_vs_sdpa": 1e-3, "problems": []},
                    "base": {"tflops": 640.2, "rel_err_vs_sdpa": 2e-3, "problems": ["3 samples dropped"]}},
                   {"spec": "attention_hd64_causal", "seq": 8192, "error": "RuntimeError: launch failed"}],
         "bench_crashed": None, "build_errors": {}, "all_checks_pass": False, "seconds": 1}
    text = tool.markdown_ab(s)
    assert "commit abc1234's tsgen" in text and "| attention_hd128_base | 1 | seq 4097 | NO |" in text
    assert ("| attention_hd128 | 8192 | 650 | 640 | 1.021 (0.990 - 1.050) | 1.0e-03 / 2.0e-03 (problems: base: 3 "
            "samples dropped) |") in text
    assert "| attention_hd64_causal | 8192 | | | failed: RuntimeError: launch failed | |" in text
    monkeypatch.setattr(tool.sys, "argv", ["gpu_attention.py", str(tmp_path / "out"), "--base-tree", str(tmp_path)])
    with pytest.raises(SystemExit):
        tool.main()
    assert not (tmp_path / "out" / "build").exists()


def test_forward_tool_ab_run_stubbed(tool, tmp_path, monkeypatch):
    """run_ab without a GPU (builds, children and bench stubbed): every AB_SPECS spec built both ways, checked, timed
    in one `--child ab` call; exit 0 only when every check passed and no timed row is suspect or failed; a base
    build whose spec fixes other tensors (same_shape) is refused, not timed; --rounds 0 is refused."""
    gen = ROOT / "generated"
    monkeypatch.setattr(tool, "build_ab", lambda out, spec, tree=None: {"manifest": str(gen / f"{spec}.json"),
                                                                      "library": "x", "spec": spec})
    monkeypatch.setattr(tool, "run_children", lambda out, kind, names, deadline, extra: {n: {"pass": True, "rows": []}
                                                                                         for n in names})
    calls = []

    def row(spec, suspect=False):
        side = {"tflops": 600.0, "rel_err_vs_sdpa": 1e-3, "problems": [], "suspect": suspect}
        return {"spec": spec, "seq": 8192, "batch": 2, "x": {"ratio": 1.0, "min": 0.9, "max": 1.1},
                "tsgen": side, "base": dict(side)}

    def child(args, timeout):
        calls.append(args)
        return {"ab": {"rows": [row(s, suspect=bad) for s in tool.AB_SPECS], "device": "H200"}}, ""

    monkeypatch.setattr(tool, "child", child)
    tree = tmp_path / "tree"
    (tree / "tsgen").mkdir(parents=True)
    (tree / "COMMIT").write_text("abc1234\n")
    bad = False
    (tmp_path / "a" / "build").mkdir(parents=True)
    assert tool.run_ab(tmp_path / "a", tree, 10, 1e12, "cmd") == 0
    summary = json.loads((tmp_path / "a" / "attention_ab.json").read_text())
    assert summary["base"] == "abc1234" and summary["all_checks_pass"] and not summary["build_errors"]
    assert calls[-1][calls[-1].index("--child") + 1] == "ab"
    assert sorted(calls[-1][-1].split(",")) == sorted(tool.AB_SPECS + [f"{s}_base" for s in tool.AB_SPECS])
    bad = True
    (tmp_path / "b" / "build").mkdir(parents=True)
    assert tool.run_ab(tmp_path / "b", tree, 10, 1e12, "cmd") == 1
    # the base build of another shape (here: another spec's manifest) is refused before anything runs
    bad = False
    monkeypatch.setattr(tool, "build_ab", lambda out, spec, tree=None: {
        "manifest": str(gen / ("attention_hd64_causal.json" if tree and spec == "attention_hd128" else f"{spec}.json")),
        "library": "x", "spec": spec})
    (tmp_path / "c" / "build").mkdir(parents=True)
    assert tool.run_ab(tmp_path / "c", tree, 10, 1e12, "cmd") == 1
    summary = json.loads((tmp_path / "c" / "attention_ab.json").read_text())
    assert "HEAD_DIM 64 -> 128" in summary["build_errors"]["attention_hd128_base"]
    assert "attention_hd128_base" not in calls[-1][-1].split(",")
    monkeypatch.setattr(tool.sys, "argv", ["gpu_attention.py", str(tmp_path / "d"), "--base-tree", str(tree),
                                           "--rounds", "0"])
    with pytest.raises(SystemExit):
        tool.main()


MASK = r"""
#include "SOURCE"
#include <cstdlib>
// The masked step's test, compiled for the host: per query position (argv[3..]) and KV block j < blocks
// (argv[2]) and lane % 4, one line "M q j l BITS": BITS[i] = 1 where score i of the thread is hidden
// (Softmax::step's score_hidden past score_limit(last, j, lane); last as consume() makes it).
int main(int argc, char** argv) {
  using C = MODULE::Config;
  using L = tsgen::attention::Layout<C>;
  tsgen::attention::Problem p = {};
  p.kv_len = atoi(argv[1]); p.kv_offset = atoll(argv[2]);
  const int blocks = (int)((p.kv_len + C::TILE_N - 1) / C::TILE_N);
  for (int a = 3; a < argc; ++a) {
    const long long q = atoll(argv[a]);
    const long long k = tsgen::attention::last_key<C>(p, q);
    const int32_t last = (int32_t)(k < -1 ? -1 : k);
    for (int j = 0; j < blocks; ++j)
      for (uint32_t lane = 0; lane < 4; ++lane) {
        const int32_t limit = tsgen::attention::score_limit<C>(last, j, lane);
        printf("M %lld %d %u ", q, j, lane);
        for (int i = 0; i < L::S_ACC; i += 2) putchar(tsgen::attention::score_hidden(i, limit) ? '1' : '0');
        for (int i = 1; i < L::S_ACC; i += 2) putchar(tsgen::attention::score_hidden(i, limit) ? '1' : '0');
        putchar('\n');
      }
  }
}
"""


@needs_nvcc
@pytest.mark.parametrize("causal", [True, False])
def test_masked_step_hides_exactly_the_keys_past_each_row(tmp_path, causal):
    """The masked step's per-row limit (last_key, score_limit) against the definition, for every score of every
    lane of every block: key j N + 2 (lane % 4) + 8 (i / 4) + i % 2 is hidden iff it is >= kv_len or (causal) past the
    row's position less kv_offset; positions before, inside and far past the keys, offsets below 0 (to int32's
    reach: Problem.kv_offset) and above."""
    loaded = variant("m", params={"causal": causal, "heads": 2, "kv_heads": 1, "tile": {"n": 176}})
    main = tmp_path / "mask_m.cu"
    main.write_text(MASK.replace("SOURCE", str(rendered_source(loaded, tmp_path))).replace("MODULE", "m"))
    exe = tmp_path / "mask_m"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17", "-w", "-o", str(exe),
                    str(main)], check=True, capture_output=True)
    N, S_ACC = 176, 88
    offsets = [8 * (i // 4) + i % 2 for i in range(0, S_ACC, 2)] + [8 * (i // 4) + i % 2 for i in range(1, S_ACC, 2)]
    for kv_len, kv_offset in ((1000, 0), (352, 0), (177, -300), (1000, 5000), (700, -2_000_000_000)):
        qs = [-5, 0, 1, 175, 176, 177, 351, 500, 999, 1000, 4999, 5175, 6000, 2**40]
        out = subprocess.run([str(exe), str(kv_len), str(kv_offset), *map(str, qs)], capture_output=True, text=True,
                             check=True).stdout.split("\n")
        lines = [l.split() for l in out if l]
        assert len(lines) == len(qs) * -(-kv_len // N) * 4
        for _, q, j, lane, bits in lines:
            q, j, lane = int(q), int(j), int(lane)
            want = "".join("1" if (key := j * N + 2 * lane + off) >= kv_len or (causal and kv_offset + key > q) else "0"
                           for off in offsets)
            assert bits == want, (kv_len, kv_offset, q, j, lane)


def test_exp2_fma_every_renders_only_where_set(tmp_path):
    """params.exp2_fma_every: absent from every shipped spec's source; set, the Config's EXP2_FMA_EVERY (the forward's
    exps take it through attention::exp2_of_group, whose function the backward's tests check on the host)."""
    fam = get_family("attention")
    for name in SHIPPED:
        loaded = load_spec(ROOT / "specs" / f"{name}.yaml")
        assert "EXP2_FMA_EVERY" not in fam.constants(loaded.model), name
    on = variant("e8", params={"exp2_fma_every": 8})
    assert fam.constants(on.model)["EXP2_FMA_EVERY"] == 8
    assert "static constexpr int EXP2_FMA_EVERY = e8::EXP2_FMA_EVERY;" in rendered_source(on, tmp_path).read_text()


def test_rescale_skip_renders_only_where_set(tmp_path):
    """params.rescale_skip: the shipped causal GQA spec sets it (its rescale follows every exp2), no other shipped
    attention spec does (with rescale_at the vote's branch cuts the interleave: 0.92-0.95x, docs/design/attention.md);
    set, the Config's RESCALE_SKIP."""
    fam = get_family("attention")
    on = {name for name in SHIPPED if "RESCALE_SKIP" in fam.constants(load_spec(ROOT / "specs" / f"{name}.yaml").model)}
    assert on == {"attention_hd128_causal_gqa"}, on
    assert load_spec(ROOT / "specs" / "attention_hd128_causal_gqa.yaml").model.params.rescale_at is None
    rs = variant("rs", params={"rescale_skip": True})
    assert fam.constants(rs.model)["RESCALE_SKIP"] == 1
    assert "static constexpr bool RESCALE_SKIP = rs::RESCALE_SKIP != 0;" in rendered_source(rs, tmp_path).read_text()
    assert "RESCALE_SKIP" not in rendered_source(variant("v"), tmp_path).read_text()
