"""The attention backward's wgmma main kernel (params.impl: wgmma, tsgen/attention_bwd_wgmma.cuh) on
the CPU: the spec's defaults and sizes, the sm_90a build of every variant (no spills, no serialized
wgmma), the SASS (the products as HGMMA of the planned shapes and operand sources, TMA loads, fp32
reductions, no local memory), and the walk's causal skip and mask predicate compiled as host code.
The kernel itself runs on a GPU through tools/gpu_attention_bwd.py --impl (beside mma_sync)."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

from conftest import ROOT, compile_test, missing_tool, rendered_source
from test_attention_cpu import ptxas_problems
from tsgen.ops import get_family
from tsgen.ops.attention_backward import IMPLS, WGMMA_STAGES, smem_bytes, threads
from tsgen.spec import load_spec, spec_variant
from tsgen.toolchain import compile_source, dump_sass, find_cuobjdump, find_nvcc

SPEC = ROOT / "specs" / "attention_backward_hd128.yaml"
NO_NVCC = missing_tool(find_nvcc)
needs_nvcc = compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
NO_SASS = NO_NVCC or missing_tool(find_cuobjdump)
needs_sass = compile_test(NO_SASS and f"SASS checks need nvcc and cuobjdump: {NO_SASS}")


def variant(name, params=None, **changes):
    return spec_variant(load_spec(SPEC), {**changes, "name": name, "params": {"impl": "wgmma", **(params or {})}})


VARIANTS = {
    "hd128": {},
    "hd128_f16_causal": {"dtype": "float16", "params": {"causal": True}},
    "hd64_causal_gqa": {"params": {"head_dim": 64, "kv_heads": 8, "causal": True}},
    "hd64_bhsd_f16": {"dtype": "float16", "params": {"head_dim": 64, "layout": "bhsd"}},
}


def test_defaults_and_sizes():
    spec = variant("v").model
    assert spec.params.impl == "wgmma" and spec.launch.threads == 0 and threads(spec) == IMPLS["wgmma"]["threads"]
    assert [k.block for k in get_family("attention_backward").abi(spec).kernels] == [384]
    assert [k.block for k in get_family("attention_backward").abi(load_spec(SPEC).model).kernels] == [128]
    assert load_spec(SPEC).model.params.impl == "mma_sync", "the default stays mma_sync until a GPU proves wgmma"
    # K, V (128 rows), 2 stages of Q and dO (64 rows), two dS^T buffers (128 x 64), LSE2 and D per stage,
    # 5 barriers, 1024 bytes of alignment slack; within the 227 KiB a CTA may opt into
    assert WGMMA_STAGES == 2
    assert smem_bytes(spec) == 2 * (2 * 128 * 128 + 2 * 2 * 64 * 128 + 2 * 128 * 64) + 2 * 4 * 2 * 64 + 40 + 1024
    assert smem_bytes(variant("v", params={"head_dim": 64}).model) == 2 * (2 * 128 * 64 + 2 * 2 * 64 * 64 +
                                                                             2 * 128 * 64) + 1024 + 40 + 1024
    assert smem_bytes(spec) <= 227 * 1024


@needs_nvcc
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_compile_without_spills(tmp_path, monkeypatch, name):
    """The layout's static_assert holds smem_bytes to the header; setmaxnreg (producer 40,
    consumers 232) balances at 384 x 168; no spills, no wgmma serialized (C7510 and friends)."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    res = compile_source(rendered_source(variant("v", **VARIANTS[name]), tmp_path))
    entry = res.report["v_w1_main"]
    assert entry["registers"] == 168, entry
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry
    assert ptxas_problems(res.output) == [], "no serialized wgmma, no ignored setmaxnreg"


@needs_sass
@pytest.mark.parametrize("head_dim", [128, 64])
def test_sass_of_the_main_kernel(tmp_path, monkeypatch, head_dim):
    """S^T and dP^T: 2 x head_dim / 16 HGMMA 64x64 from shared memory, K-major; dV and dK: 2 x 4
    HGMMA 64 x head_dim with A from registers, B transposed (N-major); dQ: HGMMA 64x64 with both
    operands transposed, over 128 keys (hd 128: columns split between the warpgroups) or 64 (hd
    64: keys split); three waits per step at most; TMA loads, fp32 reductions, no local memory."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    source = rendered_source(variant("v", params={"head_dim": head_dim}), tmp_path)
    sass = dump_sass(compile_source(source).output)
    main = sass[sass.index("Function : v_w1_main"):]
    main = main[:main.index("Function :", 10)] if "Function :" in main[10:] else main
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", main)
    names = [o for o, _ in ops]
    hgmma = [re.sub(r"\s+", "", o + rest) for o, rest in ops if o.startswith("HGMMA")]
    ss = [h for h in hgmma if "tnsp" not in h]
    rs = [h for h in hgmma if ".tnspB" in h and "tnspA" not in h]
    dq = [h for h in hgmma if ".tnspA.tnspB" in h]
    assert len(ss) == 2 * head_dim // 16 and all(h.startswith("HGMMA.64x64x16.F32.BF16R") for h in ss), hgmma
    assert len(rs) == 8 and all(re.match(rf"HGMMA\.64x{head_dim}x16\.F32\.BF16R\d+,R\d+,gdesc", h) for h in rs), rs
    assert len(dq) == (128 if head_dim == 128 else 64) // 16 and all(h.startswith("HGMMA.64x64x16") for h in dq), dq
    assert len(hgmma) == len(ss) + len(rs) + len(dq)
    assert names.count("WARPGROUP.DEPBAR.LE") <= 3, "the wgmma of a step are batched, not serialized"
    for op in ("UTMALDG.4D", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "USETMAXREG.DEALLOC.CTAPOOL",
               "USETMAXREG.TRY_ALLOC.CTAPOOL", "MUFU.EX2", "REDG.E.ADD.F32.FTZ.RN.STRONG.GPU"):
        assert op in names, op
    assert not [n for n in names if n.startswith(("LDL", "STL", "ATOM"))], "no local memory, no returned atomics"
    assert "CALL" not in " ".join(names), "no calls (they would serialize the wgmma)"


# ---------------------------------------------------------------------------
# The walk (causal skip) and the mask predicate, compiled as host code
# ---------------------------------------------------------------------------

WALK = r"""
#include "SOURCE"
#include <stdio.h>
#include <stdlib.h>
namespace bw = tsgen::attention_bwd::wgmma;
int main(int argc, char** argv) {
  (void)argc;
  tsgen::attention_bwd::Problem p = {};
  p.q_len = atoi(argv[1]); p.kv_len = atoi(argv[2]);
  p.q_offset = atoi(argv[3]); p.q_split = atoi(argv[4]); p.q_offset2 = atoi(argv[5]); p.kv_offset = atoi(argv[6]);
  const uint32_t hk = atoi(argv[7]);
  for (uint32_t k0 = 0; k0 < p.kv_len; k0 += bw::BLOCK_N) {
    const int32_t first_key = p.kv_offset + (int32_t)k0;
    for (bw::Walk<MODULE::Config> w(p, hk, first_key); !w.done(); w.next(p))
      printf("%u %u %u %d\n", k0, w.hq, w.qb * bw::BLOCK_M,
             (int)bw::step_masked(p, MODULE::Config::CAUSAL, k0, first_key, w.qb * bw::BLOCK_M, w.rows_end(p)));
  }
}
"""


@needs_nvcc
@pytest.mark.parametrize("causal", [True, False])
def test_walk_visits_the_blocks_with_a_visible_key_and_masks_every_step_that_needs_it(tmp_path, causal):
    """Per CTA (block of 128 keys, KV head 1 of 2 over 4 query heads): the walk visits each
    query head of the group and each query block with a visible (query, key) pair, in order, and
    no other; a step the mask predicate calls unmasked has every key < kv_len and every (query <
    q_len, key) pair visible. Positions from 0, offsets, and the zig-zag's two segments."""
    from tsgen.headers import include_flags
    from tsgen.ops.attention import query_positions
    from tsgen.toolchain import gencode_flags

    source = rendered_source(variant("walk", params={"causal": causal, "heads": 4, "kv_heads": 2, "head_dim": 64}),
                             tmp_path)
    main = tmp_path / "walk_main.cu"
    main.write_text(WALK.replace("SOURCE", str(source)).replace("MODULE", "walk"))
    exe = tmp_path / "walk_main"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17", "-w", "-o", str(exe),
                    str(main)], check=True, capture_output=True)
    problems = [(77, 77, 0, None, 0, 0), (1000, 1000, 0, None, 0, 0), (77, 1000, 923, None, 0, 0),
                (1000, 1000, 500, None, 0, 700), (600, 2400, 300, 300, 1800, 0), (1024, 2048, 0, 512, 1536, 0),
                (500, 4096, 768, 250, 3072, 0), (1000, 1000, 0, None, 0, 5000), (100, 100, 0, 70, 30, 0),
                (129, 129, 0, None, 0, 0), (65, 200, 63, None, 0, 0), (256, 256, 0, None, 0, 0)]
    masked_steps = unmasked_steps = 0
    for sq, skv, qo, split, qo2, ko in problems:
        split = sq if split is None else split
        out = subprocess.run([str(exe), *map(str, (sq, skv, qo, split, qo2, ko, 1))], capture_output=True,
                             text=True, check=True).stdout
        qp, kp = query_positions(sq, qo, split, qo2), ko + np.arange(skv)
        got = [tuple(int(x) for x in line.split()) for line in out.splitlines()]
        want = []
        for k0 in range(0, skv, 128):
            for hq in (2, 3):
                for r0 in range(0, sq, 64):
                    vis = kp[None, k0:k0 + 128] <= qp[r0:r0 + 64, None] if causal else np.ones((1, 1), bool)
                    if vis.any():
                        want.append((k0, hq, r0))
        assert [g[:3] for g in got] == want, (sq, skv, qo, split, qo2, ko)
        for k0, _, r0, masked in got:
            full = k0 + 128 <= skv and (not causal or bool((kp[None, k0:k0 + 128] <= qp[r0:r0 + 64, None]).all()))
            assert masked or full, ("an unmasked step needs the mask", sq, skv, qo, split, qo2, ko, k0, r0)
            masked_steps += masked
            unmasked_steps += not masked
    assert masked_steps and unmasked_steps, "both kinds of step occur"


# ---------------------------------------------------------------------------
# tools/gpu_attention_bwd.py --impl (the GPU script the lead runs)
# ---------------------------------------------------------------------------


def test_gpu_tool_runs_the_impls_side_by_side():
    from conftest import load_script
    from tsgen.spec import merge

    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    assert tool.IMPLS == ("mma_sync", "wgmma")
    assert tool.impl_name("hd64_full_kv8", "mma_sync") == "hd64_full_kv8"
    assert tool.impl_name("hd64_full_kv8", "wgmma") == "hd64_full_kv8_wgmma"
    for name in set(tool.CHECK_VARIANTS) | set(tool.BENCH_VARIANTS):  # every variant is a valid wgmma spec
        spec = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], {"params": {"impl": "wgmma"}})).model
        assert spec.params.impl == "wgmma"
    row = {"variant": "v", "seq": 4096, "batch": 4, "tsgen": {"tflops": 100.0},
           "tsgen_wgmma": {"tflops": 400.0, "ratio_mma_sync": 4.0}, "sdpa_cudnn": {"tflops": 500.0, "ratio": 5.0}}
    summary = {"device": "NVIDIA H200", "date": "2026-11-27", "command": "c", "checks": {},
               "bench": {"rows": [row]}}
    text = tool.markdown(summary)
    assert "| variant | S | tsgen | tsgen_wgmma | x | SDPA flash | ratio | SDPA cuDNN | ratio |" in text
    assert "| v | 4096 | 100 | 400 | 4.00 | - | - | 500 | 5.00 |" in text
    # one impl alone: the table as before
    assert "| v | 4096 | 100 | - | - | 500 | 5.00 |" in tool.markdown(
        {**summary, "bench": {"rows": [{k: v for k, v in row.items() if k != "tsgen_wgmma"}]}})
