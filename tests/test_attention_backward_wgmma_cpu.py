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

from conftest import ROOT, compile_test, exhaustive, missing_tool, rendered_source, representative
from test_attention_backward_op_cpu import bf16
from sass_checks import sass_function, sass_names, sass_ops, vector_to_uniform_copies
from test_attention_cpu import ptxas_problems
from tsgen.ops import get_family
from tsgen.ops.attention_backward import DEFAULT_HEAD_GROUP, DQ_STAGING, IMPLS, WGMMA_STAGES, smem_bytes
from tsgen.spec import load_spec, spec_variant
from tsgen.toolchain import compile_source, dump_sass, find_cuobjdump, find_nvcc

SPEC = ROOT / "specs" / "attention_backward_hd128.yaml"
NO_NVCC = missing_tool(find_nvcc)
needs_nvcc = compile_test(NO_NVCC and f"nvcc not found: {NO_NVCC}")
NVCC_MARKS = [pytest.mark.compile, pytest.mark.skipif(bool(NO_NVCC), reason=f"nvcc not found: {NO_NVCC}")]
NO_SASS = NO_NVCC or missing_tool(find_cuobjdump)
needs_sass = compile_test(NO_SASS and f"SASS checks need nvcc and cuobjdump: {NO_SASS}")


def variant(name, params=None, **changes):
    """SPEC's shape in the 64-row default product order and whole items (SPEC ships params.dk_after_dq, and
    params.tail_split is on where it applies; the tests below that want them set them), with `params` and
    `changes`."""
    return spec_variant(load_spec(SPEC), {**changes, "name": name,
                                          "params": {"impl": "wgmma", "dk_after_dq": False, "tail_split": False,
                                                     **(params or {})},
                                          "launch": {"threads": 384}})


VARIANTS = {
    "hd128": {},
    "hd128_f16_causal": {"dtype": "float16", "params": {"causal": True}},
    "hd64_causal_gqa": {"params": {"head_dim": 64, "kv_heads": 8, "causal": True}},
    "hd64_bhsd_f16": {"dtype": "float16", "params": {"head_dim": 64, "layout": "bhsd"}},
    "hd128_causal_atomic": {"params": {"causal": True, "dq_reduce": "atomic"}},
    "hd64_gqa_atomic": {"params": {"head_dim": 64, "kv_heads": 8, "dq_reduce": "atomic"}},
    # params.deterministic: hd 128 (each warpgroup its own column panel), hd 64 (the pair summed first)
    "hd128_causal_det": {"params": {"causal": True, "deterministic": True}},
    "hd64_causal_gqa_f16_det": {"dtype": "float16", "params": {"head_dim": 64, "kv_heads": 8, "causal": True,
                                                               "deterministic": True}},
    # params.head_group: the CTAs in groups of (sequence, KV head) pairs (not with deterministic: refused)
    "hd128_group2": {"params": {"head_group": 2}},
    "hd128_causal_gqa_group1": {"params": {"causal": True, "kv_heads": 8, "head_group": 1}},
    "hd64_causal_group4": {"params": {"head_dim": 64, "causal": True, "head_group": 4}},
    # params.tail_split (the shipped not-causal default): the last wave's items in pieces
    "hd128_tail_dkq": {"params": {"tail_split": True, "dk_after_dq": True}},
    "hd64_bhsd_f16_tail": {"dtype": "float16", "params": {"head_dim": 64, "layout": "bhsd", "tail_split": True}},
    "hd128_gqa_tail_group0": {"params": {"kv_heads": 8, "tail_split": True, "head_group": 0}},
}
# By default one build per knob that the SASS tests below do not build already: fp16 with causal, hd 64 bhsd fp16,
# GQA with head_group 1, deterministic at hd 128 (the default, atomic, deterministic at hd 64, the tail split,
# lookahead, dk_after_dq and step_rows 128 are built by their SASS tests); the other variants are `exhaustive`.
VARIANT_KEEP = ("hd128_f16_causal", "hd64_bhsd_f16", "hd128_causal_gqa_group1", "hd128_causal_det")


def test_defaults_and_sizes():
    spec = variant("v").model
    assert spec.params.impl == "wgmma" and spec.launch.threads == IMPLS["wgmma"]["threads"] == 384
    assert [k.block for k in get_family("attention_backward").abi(spec).kernels] == [384]
    shipped = load_spec(SPEC).model  # wgmma since every check of tools/gpu_attention_bwd.sh passed on an H200
    assert shipped.params.impl == "wgmma" and shipped.params.dq_tiled and shipped.params.dk_after_dq
    mma_sync = spec_variant(load_spec(SPEC), {"params": {"impl": "mma_sync", "dk_after_dq": False},
                                              "launch": {"threads": 128}}).model
    assert [k.block for k in get_family("attention_backward").abi(mma_sync).kernels] == [128]
    # K, V (128 rows), 2 stages of Q and dO (64 rows), two dS^T buffers (128 x 64), the fp32 dQ staging of
    # the two consumer warpgroups (64 x 64 each; dq_reduce bulk, the default), LSE2 and D per stage, 5
    # barriers, 1024 bytes of alignment slack; within the 227 KiB a CTA may opt into
    assert WGMMA_STAGES == 2 and DQ_STAGING == 2 * 64 * 64 * 4
    assert spec.params.dq_reduce is None and spec.params.dq_tiled
    atomic = variant("v", params={"dq_reduce": "atomic"}).model
    assert not atomic.params.dq_tiled and not mma_sync.params.dq_tiled
    assert smem_bytes(atomic) == 2 * (2 * 128 * 128 + 2 * 2 * 64 * 128 + 2 * 128 * 64) + 2 * 4 * 2 * 64 + 40 + 1024
    assert smem_bytes(spec) == smem_bytes(atomic) + 32768
    assert smem_bytes(variant("v", params={"head_dim": 64}).model) == 2 * (2 * 128 * 64 + 2 * 2 * 64 * 64 +
                                                                             2 * 128 * 64) + 32768 + 1024 + 40 + 1024
    assert smem_bytes(spec) <= 227 * 1024
    # deterministic: the same staging (its turns are words of the workspace, not shared memory)
    det = variant("v", params={"deterministic": True, "causal": True}).model
    assert smem_bytes(det) == smem_bytes(spec)
    det64 = variant("v", params={"deterministic": True, "head_dim": 64}).model
    assert smem_bytes(det64) == smem_bytes(variant("v", params={"head_dim": 64}).model)
    fam = get_family("attention_backward")
    assert fam.constants(spec)["DQ_TILED"] == 1 and fam.constants(atomic)["DQ_TILED"] == 0
    mma_bulk = mma_sync.model_copy(update={"params": mma_sync.params.model_copy(update={"dq_reduce": "bulk"})})
    assert [w for w, _ in fam.check(mma_bulk)] == [("params", "dq_reduce")], "bulk needs the wgmma kernel"
    mma_group = mma_sync.model_copy(update={"params": mma_sync.params.model_copy(update={"head_group": 2})})
    assert [w for w, _ in fam.check(mma_group)] == [("params", "head_group")], "groups need the wgmma kernel"
    assert fam.constants(variant("v", params={"head_group": 2}).model)["HEAD_GROUP"] == 2
    # unset: groups of 4 for the wgmma kernel (the shipped specs), none with deterministic or mma_sync; 0: none
    assert fam.constants(spec)["HEAD_GROUP"] == DEFAULT_HEAD_GROUP == 4 and spec.params.head_group is None
    assert "HEAD_GROUP" not in fam.constants(variant("v", params={"head_group": 0}).model)
    assert "HEAD_GROUP" not in fam.constants(variant("v", params={"deterministic": True}).model)
    assert "HEAD_GROUP" not in fam.constants(mma_sync)
    assert fam.check(variant("v", params={"head_group": 0, "deterministic": True}).model) == []
    det_group = spec.model_copy(update={"params": spec.params.model_copy(update={"head_group": 2, "deterministic": True})})
    assert [w for w, _ in fam.check(det_group)] == [("params", "head_group")], "not both: not built"


@needs_nvcc
@pytest.mark.parametrize("name", representative(sorted(VARIANTS), VARIANT_KEEP))
def test_variants_compile_without_spills(tmp_path, monkeypatch, name):
    """The layout's static_assert holds smem_bytes to the header; setmaxnreg (producer 40,
    consumers 232) balances at 384 x 168; no spills, no wgmma serialized (C7510 and friends)."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    res = compile_source(rendered_source(variant("v", **VARIANTS[name]), tmp_path))
    entry = res.report["v_w1_main"]
    assert entry["registers"] == 168, entry
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry
    assert ptxas_problems(res.output) == [], "no serialized wgmma, no ignored setmaxnreg"
    assert serialized(res.output) == [], "nor C7514 / C7518 (SERIALIZED, below)"


@needs_sass
@pytest.mark.parametrize("head_dim,dq_reduce", [(128, "bulk"), exhaustive(64, "bulk"), (128, "atomic")])
def test_sass_of_the_main_kernel(tmp_path, monkeypatch, head_dim, dq_reduce):
    """S^T and dP^T: 2 x head_dim / 16 HGMMA 64x64 from shared memory, K-major; dV and dK: 2 x 4
    HGMMA 64 x head_dim with A from registers, B transposed (N-major); dQ: HGMMA 64x64 with both
    operands transposed, over 128 keys (hd 128: columns split between the warpgroups) or 64 (hd
    64: keys split); four waits per step (S^T, dP^T, dV / dK, dQ); TMA loads, no local memory. dQ's adds: bulk, the
    default: 16 64-bit shared stores per thread and one bulk reduction (UBLKRED) per warpgroup and
    step, its two waits (the staging's reads before DS_READY, all writes before the end), no
    per-element reduction; atomic: the 32 fp32 reductions per thread and step, no bulk reduction.
    Named barriers by immediate ids only: ptxas counts 4 (bulk) or 2 (atomic), not 16."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    source = rendered_source(variant("v", params={"head_dim": head_dim, "dq_reduce": dq_reduce}), tmp_path)
    compiled = compile_source(source)
    sass = dump_sass(compiled.output)
    main = sass_function(sass, "v_w1_main")
    ops = sass_ops(main)
    names = [o for o, _ in ops]
    hgmma = [re.sub(r"\s+", "", o + rest) for o, rest in ops if o.startswith("HGMMA")]
    ss = [h for h in hgmma if "tnsp" not in h]
    rs = [h for h in hgmma if ".tnspB" in h and "tnspA" not in h]
    dq = [h for h in hgmma if ".tnspA.tnspB" in h]
    assert len(ss) == 2 * head_dim // 16 and all(h.startswith("HGMMA.64x64x16.F32.BF16R") for h in ss), hgmma
    assert len(rs) == 8 and all(re.match(rf"HGMMA\.64x{head_dim}x16\.F32\.BF16R\d+,R\d+,gdesc", h) for h in rs), rs
    assert len(dq) == (128 if head_dim == 128 else 64) // 16 and all(h.startswith("HGMMA.64x64x16") for h in dq), dq
    assert len(hgmma) == len(ss) + len(rs) + len(dq)
    # four waits a step: S^T (P's exp2 runs while dP^T is on the tensor pipe), dP^T, dV / dK, dQ;
    # more would mean ptxas serialized a wgmma
    assert names.count("WARPGROUP.DEPBAR.LE") == 4, "the wgmma of a step are batched, not serialized"
    for op in ("UTMALDG.4D", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "USETMAXREG.DEALLOC.CTAPOOL",
               "USETMAXREG.TRY_ALLOC.CTAPOOL", "MUFU.EX2"):
        assert op in names, op
    red = names.count("REDG.E.ADD.F32.FTZ.RN.STRONG.GPU")
    if dq_reduce == "bulk":
        # the writer warp's: one bulk reduction for each consumer warpgroup a step, no element atomics
        assert names.count("UBLKRED.G.S.ADD.F32.RN") == 2 and red == 0
        assert names.count("STS.64") == 16, "the dQ staging: 32 floats per thread as 16 pairs"
        assert names.count("DEPBAR.LE") == 3, "the writer's bulk waits: each staging read (per step), the writes (end)"
        # __syncthreads (0), DS_READY (1), DQ_STAGED of warpgroup 0 and 1 (2, 3: the writer's syncs), DQ_FREE (5, 6:
        # the warpgroups' syncs, predicated, immediate ids); the arrives: DQ_STAGED by the warpgroups, DQ_FREE by
        # the writer (twice at its start, twice a step)
        bars = sorted(int(m, 16) for m in re.findall(r"BAR\.SYNC\.DEFER_BLOCKING (0x[0-9a-f]+)\b", main))
        assert bars == [0, 1, 2, 3, 5, 6], bars
        arrives = sorted(int(m, 16) for m in re.findall(r"BAR\.ARV (0x[0-9a-f]+), 0xa0", main))
        assert arrives == [2, 3, 5, 5, 6, 6], arrives
    else:
        assert red == 32 and "UBLKRED.G.S.ADD.F32.RN" not in names
    assert not {"LDG.E.STRONG.GPU", "REDG.E.ADD.STRONG.GPU"} & set(names), "no dQ semaphore (params.deterministic)"
    # ptxas's count of named barriers (an id in a register would count as all 16)
    elf = subprocess.run([str(find_cuobjdump()), "-elf", str(compiled.output)], capture_output=True, text=True,
                         check=True).stdout
    counts = [int(v, 16) for v in re.findall(r"EIATTR_NUM_BARRIERS\s+Format:\s+\S+\s+Value:\s+(0x[0-9a-f]+)", elf)]
    assert counts == [7 if dq_reduce == "bulk" else 2], counts
    assert not [n for n in names if n.startswith(("LDL", "STL", "ATOM"))], "no local memory, no returned atomics"
    assert "CALL" not in " ".join(names), "no calls (they would serialize the wgmma)"
    assert vector_to_uniform_copies(names) == 0, "the descriptors in uniform registers (ptx::warpgroup_id)"


@needs_sass
@pytest.mark.parametrize("head_dim,dtype,layout,dq_reduce", [(128, "bfloat16", "bshd", "bulk"),
                                                             exhaustive(64, "float16", "bhsd", "bulk"),
                                                             (128, "bfloat16", "bshd", "atomic")])
def test_sass_of_the_convert_kernel(tmp_path, monkeypatch, head_dim, dtype, layout, dq_reduce):
    """The convert pass. bulk (DQ_TILED): straight-line per tile, no division (no CALL, no
    reciprocal): head_dim / 16 loads of 16 bytes and head_dim / 32 stores of 16 bytes per thread (32-byte
    chunks in, 8 columns out), at most 5 instructions per element plus 40; before the rewrite
    (03c9e4b) it did 64-bit divisions by q_len and HEADS per float4 (160 instructions and a CALL).
    atomic (dq_accum in dQ's layout): the grid-stride loop, one 16-byte load and one 8-byte store
    per step, 40 instructions (its SASS is the pre-i35fast one)."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    source = rendered_source(variant("v", dtype=dtype, params={"head_dim": head_dim, "layout": layout,
                                                              "dq_reduce": dq_reduce}), tmp_path)
    sass = dump_sass(compile_source(source).output)
    conv = sass_function(sass, "v_w1_convert")
    names = [n for n in sass_names(conv)
             if n != "NOP"]
    memory = sorted(n for n in names if n.startswith(("LDG", "STG", "LDL", "STL")))
    assert not [n for n in names if n.startswith(("CALL", "RET", "MUFU", "I2F"))], "no division"
    if dq_reduce == "bulk":
        assert memory == ["LDG.E.128"] * (head_dim // 16) + ["STG.E.128"] * (head_dim // 32), memory
        assert len(names) <= 5 * head_dim // 4 + 40, len(names)
    else:
        assert memory == ["LDG.E.128", "STG.E.64"] and len(names) <= 42, (memory, len(names))


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
    using W = bw::Walk<MODULE::Config>;  // W::ROWS: 64, or 128 with params.step_rows
    for (W w(p, hk, first_key); !w.done(); w.next(p))
      printf("%u %u %u %d\n", k0, w.hq, w.qb * W::ROWS,
             (int)bw::step_masked(p, MODULE::Config::CAUSAL, k0, first_key, w.qb * W::ROWS, w.rows_end(p)));
  }
}
"""


@needs_nvcc
@pytest.mark.parametrize("causal,deterministic,rows", [(True, False, 64), exhaustive(False, False, 64),
                                                       exhaustive(True, True, 64), (False, True, 64), (True, False, 128),
                                                       exhaustive(False, False, 128), (False, False, 80)])
def test_walk_visits_the_blocks_with_a_visible_key_and_masks_every_step_that_needs_it(tmp_path, causal,
                                                                                       deterministic, rows):
    """Per CTA (block of 128 keys, KV head 1 of 2 over 4 query heads): the walk visits each
    query head of the group and each query block with a visible (query, key) pair, in order, and
    no other; a step the mask predicate calls unmasked has every key < kv_len and every (query <
    q_len, key) pair visible. Positions from 0, offsets, and the zig-zag's two segments. The order:
    query heads outer, query blocks ascending; params.deterministic (Walk::DESCENDING): query blocks
    descending, the group's query heads inner. rows 128 (params.step_rows): blocks of 128 query rows,
    the zig-zag's split inside one of them in several problems (300, 250, 70; 512 at a block's edge); rows 80
    (head dim 128, not causal): blocks of 80."""
    from tsgen.headers import include_flags
    from tsgen.ops.attention import query_positions
    from tsgen.toolchain import gencode_flags

    tall = {"step_rows": rows} if rows != 64 else {}
    source = rendered_source(variant("walk", params={"causal": causal, "heads": 4, "kv_heads": 2,
                                                     "head_dim": 128 if rows == 80 else 64,
                                                     "deterministic": deterministic, **tall}), tmp_path)
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
            order = ([(hq, r0) for r0 in reversed(range(0, sq, rows)) for hq in (2, 3)] if deterministic
                     else [(hq, r0) for hq in (2, 3) for r0 in range(0, sq, rows)])
            for hq, r0 in order:
                vis = kp[None, k0:k0 + 128] <= qp[r0:r0 + rows, None] if causal else np.ones((1, 1), bool)
                if vis.any():
                    want.append((k0, hq, r0))
        assert [g[:3] for g in got] == want, (sq, skv, qo, split, qo2, ko)
        for k0, _, r0, masked in got:
            full = k0 + 128 <= skv and (not causal or bool((kp[None, k0:k0 + 128] <= qp[r0:r0 + rows, None]).all()))
            assert masked or full, ("an unmasked step needs the mask", sq, skv, qo, split, qo2, ko, k0, r0)
            masked_steps += masked
            unmasked_steps += not masked
    assert masked_steps and unmasked_steps, "both kinds of step occur"


# ---------------------------------------------------------------------------
# params.deterministic: the dQ adds in a fixed order (semaphores after dq_accum)
# ---------------------------------------------------------------------------


def test_deterministic_needs_the_bulk_path():
    """Refused with impl mma_sync or dq_reduce atomic (their per-element atomics have no order to
    fix), in the family's style: the spec field, what it needs, why."""
    from tsgen.errors import SpecError

    for changes in ({"params": {"impl": "mma_sync", "deterministic": True}, "launch": {"threads": 128}},
                    {"params": {"impl": "wgmma", "dq_reduce": "atomic", "deterministic": True}}):
        with pytest.raises(SpecError) as e:
            spec_variant(load_spec(SPEC), changes)
        assert "params.deterministic: deterministic needs params.impl wgmma with dq_reduce bulk" in str(e.value)
    det = variant("v", params={"deterministic": True}).model
    assert det.params.deterministic and det.params.dq_tiled and get_family("attention_backward").check(det) == []
    assert not variant("v").model.params.deterministic, "off by default"


@pytest.mark.parametrize("batch,heads", [(1, 32), (2, 3), (4, 16), (1, 1)])
def test_deterministic_workspace_holds_the_semaphores(batch, heads):
    """dq_accum grows by one word per (sequence, head, 64 query rows) with params.deterministic, and
    only then: workspace_floats (the torch op's, the GPU script's) and the harness's buffer, whose
    size (linear in count) covers the semaphores at every count."""
    from tsgen.ops.attention_backward import dq_semaphores, workspace_floats

    fam = get_family("attention_backward")
    plain = variant("v", params={"batch": batch, "heads": heads, "kv_heads": 1}).model
    det = variant("v", params={"batch": batch, "heads": heads, "kv_heads": 1, "deterministic": True}).model
    accum = {m.params.deterministic: next(b for b in fam.buffers(m) if b.name == "dq_accum") for m in (plain, det)}
    assert "DETERMINISTIC" not in fam.constants(plain) and fam.constants(det)["DETERMINISTIC"] == 1
    for q_len in (1, 63, 64, 65, 1000, 4096, 16385):
        floats = batch * q_len * heads * 128
        sems = dq_semaphores(batch, q_len, heads)
        assert sems == batch * heads * -(-q_len // 64)
        assert workspace_floats(batch, q_len, heads, 128) == (floats, batch * q_len * heads, batch * q_len * heads)
        assert workspace_floats(batch, q_len, heads, 128, True)[0] == floats + sems
        assert accum[False].elems(q_len) == floats
        # over-allocated by less than a word per query row and one per (sequence, head)
        assert floats + sems <= accum[True].elems(q_len) <= floats + sems + q_len + batch * heads, q_len


def test_rendered_source_has_the_semaphores_only_when_deterministic(tmp_path):
    """The Config's DETERMINISTIC member (which switches the header's semaphore code on) and the
    calling convention's words on the grown workspace appear in a deterministic variant only; the
    default renders as before (tools/: every shipped spec rendered byte-identical, checked when the
    mode was built)."""
    det = rendered_source(variant("det", params={"deterministic": True}), tmp_path).read_text()
    plain = rendered_source(variant("plain"), tmp_path).read_text()
    assert "static constexpr bool DETERMINISTIC = det::DETERMINISTIC != 0;" in det
    assert "semaphores (tsgen::attention_bwd::dq_semaphores)" in det and "in a fixed order" in det
    assert "DETERMINISTIC" not in plain and "semaphore" not in plain


@needs_sass
@pytest.mark.parametrize("head_dim", [exhaustive(128), 64])
def test_sass_of_the_deterministic_main_kernel(tmp_path, monkeypatch, head_dim):
    """The semaphore's acquire spins (LDG.STRONG.GPU: the consumers' and the producer's check) and its
    release raises (RED.STRONG.GPU: per step and at the end), one bulk reduction a step; hd 64: warpgroup
    1 hands its partial to warpgroup 0 (bar.arrive 4), and still no local memory, no call."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    source = rendered_source(variant("v", params={"head_dim": head_dim, "causal": True, "deterministic": True}),
                             tmp_path)
    sass = dump_sass(compile_source(source).output)
    main = sass_function(sass, "v_w1_main")
    names = sass_names(main)
    assert names.count("UBLKRED.G.S.ADD.F32.RN") == 1
    assert names.count("LDG.E.STRONG.GPU") >= 2 and names.count("REDG.E.ADD.STRONG.GPU") == 2, names
    assert "FENCE.VIEW.ASYNC.G" in names, "the proxy fences around the turn"
    arrive = re.findall(r"BAR\.ARV (0x[0-9a-f]+)", main)
    assert arrive == (["0x4"] if head_dim == 64 else []), arrive
    assert not [n for n in names if n.startswith(("LDL", "STL", "CALL"))], "no local memory, no call"


# Per CTA of a problem (every KV block of KV head hk of sequence 0): each step's query head and
# block, the semaphore's index (from dq_semaphore) and the CTA's turn (DQ_ADDERS x visitor_rank).
TURNS = r"""
#include "SOURCE"
#include <stdio.h>
#include <stdlib.h>
#include <vector>
namespace bw = tsgen::attention_bwd::wgmma;
int main(int argc, char** argv) {
  (void)argc;
  using C = MODULE::Config;
  tsgen::attention_bwd::Problem p = {};
  p.batch = 1;
  p.q_len = atoi(argv[1]); p.kv_len = atoi(argv[2]);
  p.q_offset = atoi(argv[3]); p.q_split = atoi(argv[4]); p.q_offset2 = atoi(argv[5]); p.kv_offset = atoi(argv[6]);
  const uint32_t hk = atoi(argv[7]);
  std::vector<float> accum((size_t)p.q_len * C::HEADS * C::HEAD_DIM + C::HEADS * ((p.q_len + 63) / 64));
  p.dq_accum = accum.data();
  for (uint32_t k0 = 0; k0 < p.kv_len; k0 += bw::BLOCK_N)
    for (bw::Walk<C> w(p, hk, p.kv_offset + (int32_t)k0); !w.done(); w.next(p))
      printf("%u %u %u %ld %u\n", k0 / bw::BLOCK_N, w.hq, w.qb,
             (long)(bw::dq_semaphore<C>(p, 0, w) - tsgen::attention_bwd::dq_semaphores<C>(p)),
             bw::Layout<C>::DQ_ADDERS * bw::visitor_rank(k0 / bw::BLOCK_N));
}
"""


def simulate_turns(walks, adders, resident):
    """The semaphore protocol over CTAs that start in order, `resident` at a time (a CTA starts when an
    earlier one ended): per step a CTA first passes on its last turn (+adders: its warpgroups' raises),
    then waits until the step's semaphore reaches its turn. True when every CTA ends (no deadlock);
    False at a state where no resident CTA can move."""
    sem, pos, held = {}, [0] * len(walks), [None] * len(walks)
    started, running = min(resident, len(walks)), list(range(min(resident, len(walks))))
    while running:
        moved = False
        for c in list(running):
            if held[c] is not None:  # the deferred raise (a step later, or at the end)
                sem[held[c]] = sem.get(held[c], 0) + adders
                held[c], moved = None, True
            if pos[c] == len(walks[c]):
                running.remove(c)
                if started < len(walks):
                    running.append(started)
                    started += 1
                moved = True
                continue
            index, turn = walks[c][pos[c]]
            if sem.get(index, 0) >= turn:
                held[c], pos[c], moved = index, pos[c] + 1, True
        if not moved:
            return False
    return True


def simulate_timing(walks, resident, wait=True):
    """A unit-step timing model of the turns (docs/design/attention.md, "Deterministic mode": its
    predicted chain cost): CTAs start in order, `resident` at a time (a CTA starts when a resident one
    ends); each step costs 1; a step's add into its query block (walks[c][s]: the semaphore's key) waits
    until the block's previous visitor passed its turn on, a step after that visitor's add (the deferred
    raise), and the CTA's next step starts after the add; a CTA ends a step after its last add. The CTAs'
    end times (wait False: the same schedule without the turns)."""
    import heapq

    slots = [0] * min(resident, len(walks))
    passed, ends, last_start = {}, [], 0
    for walk in walks:
        t = last_start = max(heapq.heappop(slots), last_start)
        for key in walk:
            t += 1
            if wait:
                t = max(t, passed.get(key, 0))
            passed[key] = t + 1
        ends.append(t + 1)
        heapq.heappush(slots, t + 1)
    return ends


def test_timing_model_of_the_walk_orders():
    """The model's chain cost on the bench's GQA causal shape (32 query heads over 8 KV heads, S 4K,
    batch 4, 132 CTAs resident): the default walk's order (query heads outer, query blocks ascending)
    costs about 8 %, the deterministic walk's (blocks descending, heads inner) under 1 %; not causal
    both well under 1 %. The numbers docs/design/attention.md quotes (S 8K and 16K as well: 11 and 12 %
    against 0.3 and 0.0 %), modelled, not measured."""
    def walks(causal, descending, S=4096, heads=32, kv_heads=8, batch=4):
        q_blocks, group = S // 64, heads // kv_heads
        out = []
        for j in range(S // 128):  # KV block major, as the grid
            first = 2 * j if causal else 0  # causal, positions from 0: the blocks below 2j see none of j's keys
            for hk in range(batch * kv_heads):
                hs = range(hk * group, (hk + 1) * group)
                out.append([(h, qb) for qb in reversed(range(first, q_blocks)) for h in hs] if descending
                           else [(h, qb) for h in hs for qb in range(first, q_blocks)])
        return out

    def cost(causal, descending):
        w = walks(causal, descending)
        return max(simulate_timing(w, 132)) / max(simulate_timing(w, 132, wait=False)) - 1

    assert 0.06 < cost(True, False) < 0.11
    assert cost(True, True) < 0.01
    assert cost(False, False) < 0.01 and cost(False, True) < 0.01


@needs_nvcc
@pytest.mark.parametrize("causal,head_dim", [(True, 128), exhaustive(True, 64), (False, 64)])
def test_turns_follow_each_query_blocks_visitors(tmp_path, causal, head_dim):
    """For every (query head, query block): its visitors (the CTAs whose Walk visits it, host-compiled
    from the header) wait for turns DQ_ADDERS x 0, 1, 2, ... in KV-block order, without a gap (a gap
    would wait forever) and on one semaphore of their own (dq_semaphore: distinct per query head and
    block, inside the workspace); the protocol then ends at any number of resident CTAs. Causal
    positions from 0, with offsets, and the zig-zag's two segments (q_split, q_offset2), tails."""
    from tsgen.headers import include_flags
    from tsgen.toolchain import gencode_flags

    source = rendered_source(variant("turns", params={"causal": causal, "heads": 4, "kv_heads": 2,
                                                      "head_dim": head_dim, "deterministic": True}), tmp_path)
    main = tmp_path / "turns_main.cu"
    main.write_text(TURNS.replace("SOURCE", str(source)).replace("MODULE", "turns"))
    exe = tmp_path / "turns_main"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17", "-w", "-o", str(exe),
                    str(main)], check=True, capture_output=True)
    from tsgen.ops.attention import query_positions

    adders = 2 if head_dim == 128 else 1  # hd 64: the pair summed, one reduction per CTA and step
    aligned = 0
    problems = [(1000, 1000, 0, None, 0, 0), (77, 1000, 923, None, 0, 0), (1000, 1000, 500, None, 0, 700),
                (600, 2400, 300, 300, 1800, 0), (1024, 2048, 0, 512, 1536, 0), (500, 4096, 768, 250, 3072, 0),
                (100, 100, 0, 70, 30, 0), (129, 129, 0, None, 0, 0), (65, 200, 63, None, 0, 0)]
    for sq, skv, qo, split, qo2, ko in problems:
        split = sq if split is None else split
        out = subprocess.run([str(exe), *map(str, (sq, skv, qo, split, qo2, ko, 1))], capture_output=True,
                             text=True, check=True).stdout
        rows = [tuple(int(x) for x in line.split()) for line in out.splitlines()]
        q_blocks = -(-sq // 64)
        visitors = {}
        for j, hq, qb, index, turn in rows:
            assert index == hq * q_blocks + qb and 0 <= index < 4 * q_blocks, (j, hq, qb, index)
            visitors.setdefault((hq, qb), []).append((j, turn))
        assert visitors, "some step"
        for key, seen in visitors.items():
            assert [j for j, _ in seen] == sorted(j for j, _ in seen), ("one visit per CTA, in order", key)
            assert [t for _, t in seen] == [adders * r for r in range(len(seen))], (sq, skv, qo, split, qo2, ko, key)
        walks = [[(index, turn) for j2, _, _, index, turn in rows if j2 == j] for j in range(-(-skv // 128))]
        for resident in (1, 2, 3, len(walks)):
            assert simulate_turns(walks, adders, resident), ("deadlock", sq, skv, qo, split, qo2, ko, resident)
        # the walk's order (Walk::DESCENDING): query blocks descending, the group's heads inner; where the
        # rows' latest positions do not fall from one block to the next (positions from 0, offsets, the
        # zig-zag's later second segment), every visitor reaches a query block at the same step of its walk,
        # and in the timing model (all CTAs resident) each CTA lags the previous one by at most a step
        steps = {}
        for j, walk in enumerate(walks):
            seq = [(qb, hq) for j2, hq, qb, _, _ in rows if j2 == j]
            assert seq == sorted(seq, key=lambda x: (-x[0], x[1])), (j, sq, skv)
            for s, (index, _) in enumerate(walk):
                steps.setdefault(index, set()).add(s)
        latest = [max(query_positions(sq, qo, split, qo2)[r0:r0 + 64]) for r0 in range(0, sq, 64)]
        if not causal or latest == sorted(latest):
            aligned += 1
            assert all(len(s) == 1 for s in steps.values()), (sq, skv, qo, split, qo2, ko)
            keys = [[index for index, _ in walk] for walk in walks]
            ends = simulate_timing(keys, len(keys))
            assert all(end <= len(walk) + 1 + j for j, (end, walk) in enumerate(zip(ends, keys))), (ends, sq, skv)
            if causal and (sq, skv, qo, split, ko) == (1000, 1000, 0, 1000, 0):
                # the default walk's order over the same visits: a CTA reaches a (head, block) up to 2 GROUP
                # + 1 steps before the previous visitor, and waits that long
                default = [[i for _, _, _, i, _ in sorted((r for r in rows if r[0] == j), key=lambda r: (r[1], r[2]))]
                           for j in range(len(walks))]
                late = simulate_timing(default, len(default))
                assert max(end - len(walk) - 1 for end, walk in zip(late, default)) > 2 * (len(walks) - 1), late
    assert aligned >= 6, "most problems' walks are aligned"
    # the simulation does find a deadlock: a first turn past 0, a gap in the turns
    assert not simulate_turns([[(0, adders)]], adders, 1)
    assert not simulate_turns([[(0, 0)], [(0, 2 * adders)]], adders, 2)


# ---------------------------------------------------------------------------
# tools/gpu_attention_bwd.py --impl (the GPU script the lead runs)
# ---------------------------------------------------------------------------


def test_gpu_tool_summarizes_ncu_source_page():
    """--ncu-source: the source page's CSV (a preamble line, quoted cells, thousands separators, predicated
    instructions) read into rows, and the summary's totals, reasons, hottest instructions and stretches: the
    samples from a landmark (here the wait for dP and the named barrier) to the next are that stretch's."""
    from conftest import load_script

    tool = load_script(ROOT / "tools" / "ncu_source.py")
    page = "\n".join([
        '"Kernel Name","v_w1_main"',  # the page's first line names the kernel
        '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"stall_barrier","stall_barrier (Not Issued)","stall_wait","stall_wait (Not Issued)"',
        '"0x00001000","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0","10","8","0","0","10","8"',
        '"0x00001010","WARPGROUP.DEPBAR.LE gsb0, 0x0","1,200","1,100","0","0","1,200","1,100"',
        '"0x00001020","FFMA R1, R2, R3, R4","300","100","0","0","0","0"',
        '"0x00001030","@P0 BAR.SYNC.DEFER_BLOCKING 0x1, 0x100","400","390","400","390","0","0"',
        '"0x00001040","IMAD R5, R6, R7, R8","90","0","0","0","0","0"',
        '"not an address","","","","","","",""',
    ])
    rows = tool.source_rows(page)
    assert [r["address"] for r in rows] == [0x1000, 0x1010, 0x1020, 0x1030, 0x1040]
    assert [r["samples"] for r in rows] == [10, 1200, 300, 400, 90]
    assert rows[1]["reasons"] == {"stall_wait": 1200} and rows[3]["reasons"] == {"stall_barrier": 400}
    text = tool.stall_summary(rows, "t", top=2)
    assert "samples 2000" in text
    assert text.index("60.5%  stall_wait") < text.index("20.0%  stall_barrier")
    assert "Not Issued" not in text  # each reason counted once
    hot = text[text.index("hottest"):text.index("by stretch")]
    assert "0x01010" in hot and "0x01030" in hot and "0x01020" not in hot  # the top 2 only
    stretch = text[text.index("by stretch"):]
    # HGMMA alone; the wait with the FFMA after it; the barrier with the IMAD after it
    assert " 0.5%  0x01000" in stretch and "75.0%  0x01010" in stretch and "(2 instructions)" in stretch
    assert "24.5%  0x01030" in stretch
    with pytest.raises(ValueError, match="Address"):
        tool.source_rows("no table here")
    # another ncu version's names: "# Address", "# Samples"
    other = page.replace('"Address"', '"# Address"').replace('"Warp Stall Sampling (All Samples)"', '"# Samples"')
    assert tool.source_rows(other) == rows


def test_ncu_summary_counts_executions_per_warp_step():
    """With "Instructions Executed": the unit is the most executed HGMMA's count (one warp-step); the bands and the
    loop path's opcodes are per step, predicates and modifiers stripped; without the column, no such section."""
    from conftest import load_script

    ncu_source = load_script(ROOT / "tools" / "ncu_source.py")
    page = "\n".join([
        '"Kernel Name","k"',
        '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait"',
        '"0x10","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ","5","1,000","5"',
        '"0x20","@!P0 ULOP3.LUT UR8, UR8, 0x1, URZ, 0xc0, !UPT","3","1,000","3"',
        '"0x30","ULOP3.LUT UR9, UR9, 0x1, URZ, 0xc0, !UPT","2","900","2"',
        '"0x40","ISETP.GE.AND P0, PT, R1, R2, PT","1","100","1"',
        '"0x50","EXIT","1","10","1"',
    ])
    rows = ncu_source.source_rows(page)
    assert [r["executed"] for r in rows] == [1000, 1000, 900, 100, 10]
    text = ncu_source.stall_summary(rows, "t")
    part = text[text.index("executed instructions per warp-step"):]
    assert "count, 1000, which 1 HGMMA instructions share)" in part and "all: 3.0" in part
    assert "    2.9  0.9 - 1.1 (the loop's path)  (3 instructions, 83.3% of the samples)" in part
    assert "    0.1  0.05 - 0.3  (1 instructions" in part and "    0.0  < 0.05" in part
    assert "      2  ULOP3" in part and "      1  HGMMA" in part and "ISETP" not in part.split("by opcode:")[1]
    # each band's reasons, and the loop path's instructions holding most of its largest reason, each with the
    # instruction before it (the wait's cause is often that one)
    assert "    2.9  0.9 - 1.1 (the loop's path)  (3 instructions, 83.3% of the samples)\n           stall_wait 83.3%" in part
    hot = part[part.index("the instructions with the most stall_wait"):]
    assert hot.index("0x00010") < hot.index("0x00020") < hot.index("0x00030") and "0x00040" not in hot
    assert "prev: @!P0 ULOP3.LUT UR8" in hot.split("0x00030")[1].splitlines()[0]
    no_column = page.replace('"Instructions Executed",', '').replace('"1,000",', '').replace('"900",', '') \
        .replace('"100",', '').replace('"10",', '')
    assert "per warp-step" not in ncu_source.stall_summary(ncu_source.source_rows(no_column), "t")


def test_bwd_levers_script_names_what_the_tool_runs():
    """tools/gpu_bwd_levers.sh (the next device call): bash accepts it; its --impl, --bench-shapes and --ncu
    arguments are ones tools/gpu_attention_bwd.py takes (a typo there would cost a device call)."""
    from conftest import load_script

    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    path = ROOT / "tools" / "gpu_bwd_levers.sh"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    impls = re.findall(r"--impl (\S+)", text)
    assert impls and all(set(i.split(",")) <= set(tool.IMPLS) for i in impls), impls
    shapes = re.search(r"^HD64=(\S+)$", text, re.M).group(1).split(",")
    assert all(v in tool.BENCH_VARIANTS and int(n) in tool.BENCH_SEQS and tool.runs(v, "wgmma_m128dkq")
               for v, n in (x.split(":") for x in shapes)), shapes
    for arg in re.findall(r"--ncu (\S+)", text):
        name, _, seq = arg.partition(":")
        assert name in tool.VARIANTS and int(seq) > 0, arg
    assert "--ncu-baseline fa4" in text and "fa4" in tool.SOURCE_KERNELS


def test_gpu_tool_runs_the_impls_side_by_side():
    from conftest import load_script
    from tsgen.spec import merge

    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    assert tool.IMPLS == ("shipped", "mma_sync", "wgmma", "wgmma_red", "wgmma_det", "wgmma_g0", "wgmma_g1",
                          "wgmma_g2", "wgmma_g4", "wgmma_g8", "wgmma_l3", "wgmma_m128", "wgmma_dkq", "wgmma_m128dkq",
                          "shipped_g2", "shipped_g8", "shipped_r80", "shipped_e2", "shipped_e3", "shipped_e4")
    assert tool.impl_name("hd64_full_kv8", "shipped") == "hd64_full_kv8"
    assert tool.impl_name("hd64_full_kv8", "mma_sync") == "hd64_full_kv8_mma_sync"
    assert tool.impl_name("hd64_full_kv8", "wgmma") == "hd64_full_kv8_wgmma"
    assert tool.impl_name("hd64_full_kv8", "wgmma_red") == "hd64_full_kv8_wgmma_red"
    for name in set(tool.CHECK_VARIANTS) | set(tool.BENCH_VARIANTS):  # every variant is a valid wgmma spec
        spec = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], tool.impl_changes("wgmma"))).model
        assert spec.params.impl == "wgmma" and spec.params.dq_tiled and spec.launch.threads == 384
        assert not spec.params.dk_after_dq and not spec.params.tall  # the 64-row default order
        # shipped: the shipped spec of the variant's head dim (at 128 dk_after_dq, at 64 also step_rows 128)
        head_dim = tool.VARIANTS[name]["params"]["head_dim"]
        spec = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], tool.impl_changes("shipped", head_dim))).model
        assert (spec.params.dk_after_dq, spec.params.tall) == (True, head_dim == 64)
        assert get_family("attention_backward").check(spec) == [], name
        for impl, groups in (("shipped_g2", 2), ("shipped_g8", 8)):  # the shipped kernel, its CTAs in other groups
            grouped = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], tool.impl_changes(impl, head_dim))).model
            assert grouped.params.cta_head_group == groups and grouped.params.dk_after_dq
            assert grouped.params.tall == spec.params.tall and grouped.params.split_tail == spec.params.split_tail
            assert get_family("attention_backward").check(grouped) == [], (name, impl)
        if tool.runs(name, "shipped_r80"):  # the shipped kernel in 80-row steps (head dim 128, not causal)
            wide = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], tool.impl_changes("shipped_r80", head_dim))).model
            assert wide.params.wide and wide.params.dk_after_dq and wide.params.split_tail == spec.params.split_tail
            assert get_family("attention_backward").check(wide) == [], name
        mma = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], tool.impl_changes("mma_sync"))).model
        assert mma.params.impl == "mma_sync" and mma.launch.threads == 128 and not mma.params.dk_after_dq
        spec = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], tool.impl_changes("wgmma_red"))).model
        assert spec.params.impl == "wgmma" and not spec.params.dq_tiled and spec.launch.threads == 384
        spec = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], tool.impl_changes("wgmma_det"))).model
        assert spec.params.impl == "wgmma" and spec.params.dq_tiled and spec.params.deterministic
        spec = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], tool.impl_changes("wgmma_g4"))).model
        assert spec.params.impl == "wgmma" and spec.params.head_group == 4 and not spec.params.deterministic
        spec = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], tool.impl_changes("wgmma_g0"))).model
        assert spec.params.cta_head_group is None  # no groups: the KV-block-major order
        spec = spec_variant(load_spec(SPEC), merge(tool.VARIANTS[name], tool.impl_changes("wgmma_l3"))).model
        assert spec.params.lookahead and spec.params.dq_tiled and spec.params.cta_head_group == DEFAULT_HEAD_GROUP
        assert get_family("attention_backward").check(spec) == [], name
    row = {"variant": "v", "seq": 4096, "batch": 4, "tsgen": {"tflops": 100.0},
           "tsgen_wgmma": {"tflops": 400.0, "ratio_ref": 4.0}, "sdpa_cudnn": {"tflops": 500.0, "ratio": 5.0}}
    summary = {"device": "NVIDIA H200", "date": "2026-11-27", "command": "c", "checks": {},
               "bench": {"rows": [row]}}
    text = tool.markdown(summary)
    assert "| variant | S | tsgen | x | tsgen_wgmma | x | SDPA flash | ratio | SDPA cuDNN | ratio |" in text
    assert "| v | 4096 | 100 | ref | 400 | 4.00 | - | - | 500 | 5.00 |" in text
    # one impl alone: the table as before
    assert "| v | 4096 | 100 | - | - | 500 | 5.00 |" in tool.markdown(
        {**summary, "bench": {"rows": [{k: v for k, v in row.items() if k != "tsgen_wgmma"}]}})
    # the old wgmma and the new side by side: x against the first listed, SDPA's ratio against the last
    two = {"variant": "v", "seq": 4096, "batch": 4, "ref": "tsgen_wgmma_red", "last": "tsgen_wgmma",
           "tsgen_wgmma_red": {"tflops": 250.0}, "tsgen_wgmma": {"tflops": 350.0, "ratio_ref": 1.4},
           "sdpa_cudnn": {"tflops": 500.0, "ratio": 1.43}}
    text = tool.markdown({**summary, "bench": {"rows": [two]}})
    assert "ratio = SDPA time / tsgen_wgmma time" in text and "x = tsgen_wgmma_red's time / theirs" in text
    assert "| v | 4096 | 350 | 1.40 | 250 | ref | - | - | 500 | 1.43 |" in text  # no "tsgen" column: none ran


# ---------------------------------------------------------------------------
# One CTA of the wgmma kernel, modelled through its shared-memory addresses (no GPU here)
# ---------------------------------------------------------------------------
#
# Shared memory as the hardware sees it: 16-bit elements at byte addresses, the 128-byte swizzle
# (the 16-byte unit index, address bits 4-6, XORed with bits 7-9, within 1024-byte aligned
# blocks) applied by the TMA writes and by the wgmma reads; the wgmma operand layouts the PTX ISA
# defines for 128B-swizzled descriptors (K-major: 8-row groups SBO = 1024 bytes apart, k16 steps
# 32 bytes along the row; M/N-major: 64 contiguous M/N elements per K row, 8-row K groups SBO
# apart, 64-element blocks LBO apart), the accumulator layout of a warpgroup (row 16 warp + lane / 4
# (+ 8), column 8q + 2 (lane % 4) (+ 1)). The kernel's side is the header's: its layout offsets,
# descriptor starts and steps (restated here, the dS^T store's stmatrix addresses read from the
# header: header_ds_store), the dQ split per head dim, the mask. A wrong swizzle in the dS^T store, a transposed
# read, a wrong dQ column box or key range fails the check against the family's reference.

WG_HEADER = ROOT / "templates" / "include" / "tsgen" / "attention_bwd_wgmma.cuh"
BWD_HEADER = WG_HEADER.with_name("attention_bwd.cuh")


def swizzled(addr):
    return addr ^ (((addr >> 7) & 7) << 4)


class Smem:
    def __init__(self, nbytes):
        self.mem = np.full(nbytes // 2, np.nan)

    def tma_rows(self, base, box_bytes, x, rows):  # TMA: rows [r][c] of 64-column boxes, swizzled
        for r in range(rows.shape[0]):
            for c in range(rows.shape[1]):
                self.mem[swizzled(base + (c // 64) * box_bytes + r * 128 + (c % 64) * 2) // 2] = rows[r, c]

    def k_major(self, start, m_rows):  # [m][16] of a K-major operand from descriptor start
        out = np.empty((m_rows, 16))
        for m in range(m_rows):
            for k in range(16):
                out[m, k] = self.mem[swizzled(start + k * 2 + (m % 8) * 128 + (m // 8) * 1024) // 2]
        return out

    def mn_major(self, start, n_cols, lbo):  # [16][n] of an M/N-major operand from descriptor start
        out = np.empty((16, n_cols))
        for k in range(16):
            for n in range(n_cols):
                at = start + (n % 64) * 2 + (n // 64) * lbo + (k % 8) * 128 + (k // 8) * 1024
                out[k, n] = self.mem[swizzled(at) // 2]
        return out


def header_ds_store():
    """store_ds_t's stmatrix addresses, read from the header: (ds_base, cw, warp, lane, k, DS_PANEL) -> the shared
    memory address lane `lane` gives for k16 step k."""
    x = header_exprs("store_ds_t", m=r"const uint32_t m = (.+?), r", r=r", r = (.+?);",
                     base=r"const uint32_t base = (.+?);", u=r"const uint32_t u = (.+?);",
                     at=r"stmatrix_x4\((.+?), ad\[k\]\);")

    def address(ds_base, cw, warp, lane, k, panel):
        m, r = x["m"](lane=lane), x["r"](lane=lane)
        return x["at"](base=x["base"](ds_base=ds_base, cw=cw, warp=warp, m=m, r=r), u=x["u"](k=k, m=m), r=r,
                       L_DS_PANEL=panel)

    return address


def store_ds_model(mem, ds16: np.ndarray, ds_base: int, cw: int, panel: int) -> None:
    """A warpgroup's dS^T (64 key rows x 16 K query columns, 16-bit) stored as the header's store_ds_t does: per
    k16 step one stmatrix of four 8 x 8 matrices, matrix m (to_operand's fragment order) rows 8 (m % 2) .. + 7 of
    the warp's 16, query unit 2k + m / 2 (8 columns); lane l's address gets row l % 8 of matrix l / 8."""
    address = header_ds_store()
    for warp in range(4):
        for lane in range(32):
            m, r = lane // 8, lane % 8
            for k in range(ds16.shape[1] // 16):
                row, unit = 16 * warp + 8 * (m % 2) + r, 2 * k + m // 2
                at = address(ds_base, cw, warp, lane, k, panel)
                assert at % 16 == 0, "stmatrix rows are 16-byte aligned"
                mem[at // 2:at // 2 + 8] = ds16[row, 8 * unit:8 * unit + 8]


def staged_partial(stage_store, acc: np.ndarray) -> np.ndarray:
    """A warpgroup's 64 x 64 fp32 dQ partial `acc` through the header's staging store (header_dq_staging):
    the staging buffer as the bulk reduction reads it (NaN where no thread wrote). Each thread's registers
    4q + 2h + e hold (row + 8h, column 8q + 2 (lane % 4) + e), as the header's store assumes."""
    staging = np.full(64 * 64, np.nan)
    for warp in range(4):
        for lane in range(32):
            row = 16 * warp + lane // 4
            for h in range(2):
                for qq in range(8):
                    at, reg = stage_store(row, h, lane, qq)
                    for e in range(2):
                        assert (reg + e) // 4 == qq and (reg + e) % 4 == 2 * h + e
                        staging[at // 4 + e] = acc[row + 8 * h, 8 * qq + 2 * (lane % 4) + e]
    return staging


def header_dq_staging():
    """The dQ staging store of the header (dq_reduce bulk): a function (row, h, lane, q) -> (byte offset
    in the warpgroup's staging buffer, register of the first float; the second is the next register)."""
    text = WG_HEADER.read_text()
    at = re.search(r"const uint32_t at = staging \+ (.+);", text)  # each_staged_pair's row address
    pair = re.search(r"for \(int q = 0; q < 8; \+\+q\) f\(at \+ (.+?), (.+?)\);", text)  # chunk, register i
    st = re.search(r"st_shared_v2_f32\(at, dq\[(.+?)\], dq\[(.+?)\]\);", text)  # the store of registers i, i + 1
    assert at and pair and st, "the staging store's address and registers"

    def py(expr):
        return expr.replace(" / ", " // ")

    def store(row, h, lane, q):
        env = {"row": row, "h": h, "lane": lane, "q": q}
        i = eval(py(pair.group(2)), {}, env)
        first, second = eval(py(st.group(1)), {}, {"i": i}), eval(py(st.group(2)), {}, {"i": i})
        assert second == first + 1
        return eval(py(at.group(1)), {}, env) + eval(py(pair.group(1)), {}, env), first

    return store


class OneHeadCase:
    """One head of bf16 Q, K, V, dO with O and LSE from the float64 forward (O rounded to bf16, LSE to fp32 as
    the forward writes them): the inputs the one-CTA models take, and the check of their dQ, dK, dV against
    the family's reference within its per-element tolerance."""

    def __init__(self, rng, rows: int, kv_len: int, d: int, causal: bool):
        from tsgen.ops.attention import attention_reference

        self.scale, self.causal = 1 / np.sqrt(d), causal
        self.q, self.do = (bf16(rng.standard_normal((1, rows, 1, d))) for _ in range(2))
        self.k, self.v = (bf16(rng.standard_normal((1, kv_len, 1, d))) for _ in range(2))
        o, lse = attention_reference(self.q, self.k, self.v, self.scale, causal)
        self.o, self.lse = bf16(o), lse.astype(np.float32).astype(np.float64)

    def model_args(self) -> tuple:
        """q, k, v, dO of the head, LSE in log2 units (+inf for a row that sees no key), D = rowsum(dO * O),
        and the scale in log2 units: the models' leading arguments."""
        dsum = np.einsum("bshd,bshd->bhs", self.do, self.o)[0, 0]
        lse2 = np.where(np.isneginf(self.lse[0, 0]), np.inf, self.lse[0, 0] * np.log2(np.e))
        return (self.q[0, :, 0], self.k[0, :, 0], self.v[0, :, 0], self.do[0, :, 0], lse2, dsum,
                self.scale * np.log2(np.e))

    def check(self, dq, dk, dv) -> None:
        from tsgen.ops.attention import attention_backward_reference, o_tolerance

        want = attention_backward_reference(self.q, self.k, self.v, self.o, self.do, self.lse, self.scale,
                                            self.causal, with_abs=True)
        for name, g, w, a in (("dq", dq * self.scale, want[0], want[3]), ("dk", dk * self.scale, want[1], want[4]),
                              ("dv", dv, want[2], want[5])):
            g = g[None, :, None]
            bad = ~(np.abs(g - w) <= o_tolerance(w, a, "bfloat16"))  # NaN (shared memory never written) is bad
            assert not bad.any(), (name, int(bad.sum()), bad.size)


def model_cta(q, k, v, do, lse2, dsum, scale_log2, d, kv_len, causal, tiled=None):
    """One CTA (keys 0 .. 127 of one KV head; one query head): q, do [rows, d], k, v [kv_len, d]
    (16-bit values), lse2, dsum [rows]. -> dq [rows, d] (unscaled), dk (unscaled), dv [kv_len, d].
    tiled (dq_reduce bulk): the convert pass's dq_accum float of every (row, column) of the head
    (its ConvertTiled map, host-compiled from the header): dQ goes through the staging stores (the
    header's expressions, thread by thread), one bulk reduction of n x 64 floats per warpgroup and
    step into a flat dq_accum, and is read back through the convert's map."""
    BN, BM, boxes = 128, 64, d // 64
    KV_BOX, Q_BOX = BN * 128, BM * 128
    K_OFF, V_OFF = 0, boxes * KV_BOX
    Q_OFF = V_OFF + boxes * KV_BOX
    DO_OFF = Q_OFF + boxes * Q_BOX
    DS_OFF = DO_OFF + boxes * Q_BOX
    split_n = d == 128
    sm = Smem(DS_OFF + 2 * BN * 128)
    pad = np.zeros((BN, d))
    pad[:kv_len] = k
    sm.tma_rows(K_OFF, KV_BOX, 0, pad)
    pad = np.zeros((BN, d))
    pad[:kv_len] = v
    sm.tma_rows(V_OFF, KV_BOX, 0, pad)
    rows = q.shape[0]
    dq = np.zeros((rows, d))
    accum = np.zeros(rows * d)  # dq_accum of the head (tiled)
    stage_store = header_dq_staging() if tiled is not None else None
    dk, dv = np.zeros((2, 64, d)), np.zeros((2, 64, d))  # per warpgroup: its 64 keys
    for step, r0 in enumerate(range(0, rows, BM)):
        n = min(BM, rows - r0)
        for name, src, off in (("q", q, Q_OFF), ("do", do, DO_OFF)):
            tile = np.zeros((BM, d))
            tile[:n] = src[r0:r0 + n]
            sm.tma_rows(off, Q_BOX, 0, tile)
        l2, ds_ = np.full(BM, np.inf), np.zeros(BM)
        l2[:n], ds_[:n] = lse2[r0:r0 + n], dsum[r0:r0 + n]
        ds_base = DS_OFF + (step % 2) * BN * 128
        a_frags = []
        for cw in range(2):
            s, dp = np.zeros((64, BM)), np.zeros((64, BM))
            for kk in range(d // 16):
                kv_step, q_step = (kk // 4) * KV_BOX + (kk % 4) * 32, (kk // 4) * Q_BOX + (kk % 4) * 32
                s += sm.k_major(K_OFF + 64 * cw * 128 + kv_step, 64) @ sm.k_major(Q_OFF + q_step, BM).T
                dp += sm.k_major(V_OFF + 64 * cw * 128 + kv_step, 64) @ sm.k_major(DO_OFF + q_step, BM).T
            key = 64 * cw + np.arange(64)[:, None]
            qrow = r0 + np.arange(BM)[None, :]
            p = np.exp2(s * scale_log2 - l2[None, :])
            seen = (key < kv_len) & ((key <= qrow) if causal else True)
            p = np.where(seen, p, 0.0)
            dsT = p * (dp - ds_[None, :])
            p16, ds16 = bf16(p), bf16(dsT)
            a_frags.append((p16, ds16))
            store_ds_model(sm.mem, ds16, ds_base, cw, 128 * 128)  # the store, lane by lane (one panel)
            for kq in range(BM // 16):  # dV += P^T dO, dK += dS^T Q: B N-major, k16 steps of 2048 bytes
                dv[cw] += p16[:, 16 * kq:16 * kq + 16] @ sm.mn_major(DO_OFF + kq * 2048, d, Q_BOX)
                dk[cw] += ds16[:, 16 * kq:16 * kq + 16] @ sm.mn_major(Q_OFF + kq * 2048, d, Q_BOX)
        for cw in range(2):  # after DS_READY: dQ = dS K
            col_box, key0 = (cw, 0) if split_n else (0, 64 * cw)
            keys = BN if split_n else 64
            acc = np.zeros((BM, 64))
            for kk in range(keys // 16):
                a = sm.mn_major(ds_base + key0 * 128 + kk * 2048, BM, BN * 128).T  # M-major A: [m][k]
                b = sm.mn_major(K_OFF + col_box * KV_BOX + key0 * 128 + kk * 2048, 64, KV_BOX)
                acc += a @ b
            if tiled is None:
                dq[r0:r0 + n, 64 * col_box:64 * col_box + 64] += acc[:n]
                continue
            staging = staged_partial(stage_store, acc)
            base = r0 * d + col_box * n * 64  # the bulk reduction's destination (floats), n x 256 bytes
            accum[base:base + n * 64] += staging[:n * 64]
    if tiled is not None:
        dq = accum[tiled]
    return dq, np.concatenate(list(dk))[:kv_len], np.concatenate(list(dv))[:kv_len]


TILED = r"""
#include "tsgen/attention_bwd.cuh"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
namespace ab = tsgen::attention_bwd;
// The convert pass's DQ_TILED map, CTA by CTA (grid x: 64-row blocks, y: heads, z: sequences) and
// thread by thread: for each dQ element (flat, in dQ's layout) the dq_accum float it is read from.
template <uint32_t H, uint32_t D, bool BHSD>
int convert_map(uint32_t batch, uint32_t q_len) {
  using T = ab::ConvertTiled<H, D, BHSD>;
  std::vector<long long> out((size_t)batch * q_len * H * D, -1);
  for (uint32_t b = 0; b < batch; ++b)
    for (uint32_t h = 0; h < H; ++h)
      for (uint32_t r0 = 0; r0 < q_len; r0 += ab::BLOCK_M) {
        const uint32_t n = T::rows(r0, q_len);
        const uint64_t src = T::src_tile(b, h, r0, q_len), dst = T::dst_tile(b, h, r0, q_len);
        for (uint32_t tid = 0; tid < ab::CONVERT_THREADS; ++tid)
          for (uint32_t x = 0; x < D / 64; ++x)
            for (uint32_t k = 0; k < ab::CONVERT_CHUNKS; ++k) {
              uint32_t row, from, to;
              T::chunk(tid, x, k, n, row, from, to);
              if (row >= n) continue;
              if (from % 8 != 0 || to % 8 != 0) return 2;  // 32-byte reads, 16-byte writes
              for (uint32_t j = 0; j < 8; ++j) {
                const uint64_t at = dst + to + j;
                if (at >= out.size() || out[at] != -1) return 3;  // out of range or written twice
                out[at] = (long long)(src + from + j);
              }
            }
      }
  for (long long v : out) printf("%lld\n", v);
  return 0;
}
int main(int argc, char** argv) {
  (void)argc;
  const uint32_t batch = atoi(argv[2]), heads = atoi(argv[3]), q_len = atoi(argv[4]), d = atoi(argv[5]);
  if (strcmp(argv[1], "offsets") == 0) {
    for (uint32_t b = 0; b < batch; ++b)
      for (uint32_t h = 0; h < heads; ++h)
        for (uint32_t r = 0; r < q_len; ++r)
          for (uint32_t c = 0; c < d; ++c)
            printf("%llu\n", (unsigned long long)ab::dq_tiled_offset(b, h, r, c, heads, q_len, d));
    return 0;
  }
  const int bhsd = atoi(argv[6]);
#define CASE(H, D, L) if (heads == H && d == D && bhsd == L) return convert_map<H, D, L>(batch, q_len);
  CASE(1, 64, 0) CASE(1, 128, 0) CASE(1, 64, 1) CASE(1, 128, 1) CASE(3, 64, 0) CASE(3, 128, 0) CASE(3, 64, 1)
  CASE(3, 128, 1) CASE(4, 64, 0) CASE(4, 128, 0) CASE(4, 64, 1) CASE(4, 128, 1)
  return 1;
}
"""


@pytest.fixture(scope="module")
def tiled_program(tmp_path_factory):
    """dq_tiled_offset and the convert pass's map (tsgen/attention_bwd.cuh's ConvertTiled), host-compiled."""
    from tsgen.headers import include_flags

    if NO_NVCC:
        pytest.skip(f"nvcc not found: {NO_NVCC}")
    tmp = tmp_path_factory.mktemp("tiled")
    (tmp / "tiled.cu").write_text(TILED)
    subprocess.run([str(find_nvcc()), *include_flags(), "-std=c++17", "-w", "-o", str(tmp / "tiled"),
                    str(tmp / "tiled.cu")], check=True, capture_output=True)

    def run(*args):
        out = subprocess.run([str(tmp / "tiled"), *map(str, args)], capture_output=True, text=True, check=True).stdout
        return np.array(out.split(), dtype=np.int64)

    return run


@pytest.fixture(scope="module")
def tiled_offsets(tiled_program):
    """dq_tiled_offset: (batch, heads, q_len, d) -> offsets [batch, heads, q_len, d]."""
    return lambda batch, heads, q_len, d: tiled_program("offsets", batch, heads, q_len, d).reshape(
        batch, heads, q_len, d)


@pytest.fixture(scope="module")
def convert_map(tiled_program):
    """The convert pass (DQ_TILED): (batch, heads, q_len, d, bhsd) -> for each dQ element, flat in dQ's
    layout, the dq_accum float it reads (the program fails on a chunk written twice or out of range)."""
    return lambda batch, heads, q_len, d, bhsd: tiled_program("convert", batch, heads, q_len, d, int(bhsd))


@needs_nvcc
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("heads,d", [(4, 128), (3, 64), (4, 64), (1, 128)])
@pytest.mark.parametrize("q_len", [150, 70, 64, 33, 129, 1])
def test_convert_reads_every_dq_element_from_its_dq_accum_float(tiled_offsets, convert_map, layout, heads, d, q_len):
    """The convert pass's DQ_TILED map (one CTA per 64-row block, head and sequence; 32-byte chunks of
    the tile in order, 16-byte stores of 8 columns), simulated CTA by CTA and thread by thread on the
    host: every dQ element of 2 sequences is written exactly once, from the dq_accum float that
    dq_tiled_offset gives its (sequence, head, row, column), in dQ's layout (bshd or bhsd). GQA needs
    nothing of its own here: the convert sees only the query heads (4 = a GQA group of 2 KV heads x 2)."""
    batch = 2
    off = tiled_offsets(batch, heads, q_len, d)  # [b, h, r, c]
    want = (off if layout == "bhsd" else off.transpose(0, 2, 1, 3)).reshape(-1)
    got = convert_map(batch, heads, q_len, d, layout == "bhsd")
    assert got.size == want.size and (got >= 0).all(), "every dQ element written"
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (bad[:8], got[bad[:8]], want[bad[:8]])


@needs_nvcc
@pytest.mark.parametrize("batch,heads,q_len,d", [(1, 1, 150, 128), (2, 3, 64, 64), (1, 2, 1, 128), (2, 2, 200, 64),
                                                  (1, 1, 129, 128), (3, 1, 63, 64)])
def test_tiled_dq_accum_layout(tiled_offsets, batch, heads, q_len, d):
    """The tiled dq_accum (dq_reduce bulk) uses exactly dQ's number of floats, each once (the
    preprocess zeroes all of it, the workspace keeps its size); every (64-row block, 64-column panel)
    is one contiguous run of n x 64 floats at the kernel's bulk destination ((b heads + h) q_len + r0)
    d + panel n 64 (n: the block's rows, short at the tail), its rows in order, 256 bytes each; the
    convert pass's 4 columns 4k .. 4k + 3 are 4 consecutive floats (one 16-byte load)."""
    off = tiled_offsets(batch, heads, q_len, d)
    assert np.array_equal(np.sort(off.reshape(-1)), np.arange(off.size))
    for b in range(batch):
        for h in range(heads):
            for r0 in range(0, q_len, 64):
                n = min(64, q_len - r0)
                for x in range(d // 64):
                    block = off[b, h, r0:r0 + n, 64 * x:64 * x + 64]
                    base = ((b * heads + h) * q_len + r0) * d + x * n * 64
                    assert np.array_equal(np.sort(block.reshape(-1)), base + np.arange(n * 64))
                    assert np.array_equal(block.min(axis=1) - base, 64 * np.arange(n)), "row i at 256 i bytes"
    quads = off.reshape(-1, 4)
    assert (quads % 4 == [0, 1, 2, 3]).all() and (np.diff(quads, axis=1) == 1).all()


@needs_nvcc
@pytest.mark.parametrize("d,tall", [(128, False), (64, False), (64, True)])
@pytest.mark.parametrize("q_len", [150, 64, 33, 257])
def test_dq_reduction_adds_each_warpgroup_partial_into_its_own_rows_and_panel(tiled_offsets, d, tall, q_len):
    """dq_reduction, read from the header (its rows, panel and destination through attention_bwd.cuh's
    dq_tiled_panel), for every step of 2 sequences x 3 heads (64-row steps, or 128 with params.step_rows 128 at
    head dim 64) and both consumer warpgroups: its n x 256 bytes from dst are exactly the floats dq_tiled_offset
    gives the warpgroup's rows (the step's 64, TALL: its own 64 of the 128; none past q_len) and head-dim columns
    (hd 128: panel cw; hd 64: the one panel, both warpgroups), in the staging's order; every (row, column) of dQ
    covered once a step at hd 128 and TALL, twice at hd 64 (both warpgroups add partials of the same panel)."""
    at = header_tall_consumer()
    batch, heads, rows = 2, 3, 128 if tall else 64
    off = tiled_offsets(batch, heads, q_len, d)
    env = dict(L_TALL=tall, L_DQ_SPLIT_N=d == 128, BLOCK_M=64, C_HEADS=heads, C_HEAD_DIM=d, p_q_len=q_len)
    for b in range(batch):
        for hq in range(heads):
            seen = np.zeros((q_len, d), dtype=np.int64)
            for r0 in range(0, q_len, rows):
                r1 = min(r0 + rows, q_len)
                for cw in range(2):
                    q0 = at["q0"](r0=r0, cw=cw, **env)
                    if at["none_if"](q0=q0, r1=r1, **env):
                        assert tall and q0 >= q_len, (r0, cw)  # only TALL's second half past the rows
                        continue
                    n, box = at["n"](q0=q0, r1=r1, **env), at["box"](cw=cw, **env)
                    dst = at["dst"](b=b, hq=hq, q0=q0, n=n, dq_col_box=box, **env)
                    assert n == min(64, q_len - q0) and at["bytes"](n=n) == 256 * n
                    want = off[b, hq, q0:q0 + n, 64 * box:64 * box + 64]
                    assert np.array_equal(np.sort(want.reshape(-1)), np.arange(dst, dst + 64 * n)), (b, hq, r0, cw)
                    seen[q0:q0 + n, 64 * box:64 * box + 64] += 1
            assert (seen == (2 if d == 64 and not tall else 1)).all(), (b, hq)


@pytest.mark.parametrize("d,causal,tiled", [(128, True, False), (64, False, False), (64, True, False),
                                            pytest.param(128, True, True, marks=NVCC_MARKS),
                                            pytest.param(128, False, True, marks=NVCC_MARKS),
                                            pytest.param(64, True, True, marks=NVCC_MARKS)])
def test_shared_memory_model_of_one_cta(request, d, causal, tiled):
    """100 keys (a tail of the 128-key block) against 150 queries (three steps, a tail; both dS^T
    buffers used), one head: dQ, dK, dV through the modelled operand addresses against the
    family's reference within its tolerance. tiled: dQ through the bulk path (staging stores,
    bulk reductions of the valid rows, the convert's read through its host-compiled map)."""
    rows, kv_len = 150, 100
    case = OneHeadCase(np.random.default_rng(3), rows, kv_len, d, causal)
    offsets = request.getfixturevalue("convert_map")(1, 1, rows, d, False).reshape(rows, d) if tiled else None
    case.check(*model_cta(*case.model_args(), d, kv_len, causal, tiled=offsets))



def header_function(name):
    """The body of the header's function `name` (from its signature to the closing brace at column 0)."""
    text = WG_HEADER.read_text()
    start = re.search(rf" (?:void|uint32_t) {name}\(", text).start()
    return text[start:text.index("\n}\n", start)]


def test_producer_issues_its_tma_before_the_lse2_copies_and_each_lane_arrives_once():
    """produce()'s refill of a stage, read from the header: lane 0 expects the stage's TMA bytes without arriving
    (mbarrier.expect_tx) and issues the Q and dO loads before the lanes' LSE2 / D loads (their global latency runs
    under the TMA's: docs/design/attention.md, "A second cost in the same profiles"), and each of the 32 lanes arrives
    once, after its own stores (q_full counts 32 arrivals: an arrive.expect_tx by lane 0 as well would make its 32nd
    arrival come before the last lane's stores, completing the phase early). A string check of the header's spelling:
    an extra arrival written another way would pass it; the GPU tests see the race."""
    body = header_function("produce")
    step = body[body.index("for (Walk<C> w("):body.index("// Tail:")]
    assert "mbar_arrive_expect_tx(full" not in step and step.count("mbar_expect_tx(full, 2 * L::Q_TILE") == 1
    # with the bulk copies: their bytes in the same expect_tx, the lanes' loop past them (only the padding rows)
    assert "mbar_expect_tx(full, 2 * L::Q_TILE + (bulk ? 8 * n : 0))" in step and "(bulk ? n : 0) + lane" in step
    order = [step.index(s) for s in ("mbar_expect_tx(full", "bulk_load(smem + L::LSE2_OFF",
                                     "load_rows<C>(smem + L::Q_OFF", "p.lse2[row0 + i]",
                                     "st_shared_u32(smem + L::DSUM_OFF", "mbar_arrive(full)")]
    assert order == sorted(order), order
    assert step.count("mbar_arrive(full)") == 1 and "\n    mbar_arrive(full);" in step, "every lane, not under a branch"
    assert re.search(r"mbar_init\(smem \+ L::Q_FULL \+ 8 \* s, 32\)", WG_HEADER.read_text()), "32 arrivals a phase"


def c_expr(expr):
    """A C expression of the header as a function of its names (L::X as L_X, C::X as C_X, p.x as p_x, w.x as
    w_x; casts dropped, integer division, one conditional operator at the top)."""
    code = re.sub(r"\((?:int|int32_t|uint32_t|uint64_t|size_t)\)", "", expr).strip()
    while code.startswith("("):  # parentheses around the whole expression
        depth = 0
        for i, ch in enumerate(code):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        if i != len(code) - 1:
            break
        code = code[1:-1].strip()
    code = re.sub(r"\b([LC])::", r"\1_", code)
    code = re.sub(r"\b([pw])\.", r"\1_", code).replace(" / ", " // ").replace("&&", " and ").replace("||", " or ")
    code = re.sub(r"!(?!=)", " not ", code)
    if "?" in code:
        cond, rest = code.split("?")
        then, other = rest.split(":")
        code = f"({then}) if ({cond}) else ({other})"
    return lambda **env: eval(code, {}, env)


def header_exprs(function: str, **patterns: str) -> dict:
    """The C expressions that `patterns` (name -> a regular expression whose group 1 is the expression) find in
    the header's function `function`, each as c_expr's function of its names; every pattern must match."""
    body = header_function(function)
    found = {name: re.search(pattern, body) for name, pattern in patterns.items()}
    assert all(found.values()), (function, [name for name, m in found.items() if not m])
    return {name: c_expr(m.group(1)) for name, m in found.items()}


def header_tall_producer():
    """produce()'s Q and dO loads for params.step_rows 128, read from the header: (layout, stage, x, h, r0,
    q_len) -> (shared memory offset of the Q box, of the dO box, first row the box loads)."""
    x = header_exprs("produce", box=r"const uint32_t box = (.+);", rows=r"const int rows = (.+);",
                     q=r"load_rows<C>\(smem \+ (L::Q_OFF .*?), q_map, 64 \* x, rows,",
                     do=r"load_rows<C>\(smem \+ (L::DO_OFF .*?), do_map, 64 \* x, rows,")
    box, rows, q, do = x["box"], x["rows"], x["q"], x["do"]

    def load(layout, stage, x, h, r0, q_len):
        b = box(stage=stage, x=x, h=h, **layout)
        return q(box=b, **layout), do(box=b, **layout), rows(r0=r0, h=h, p_q_len=q_len, L_BOX_ROWS=64)

    return load


def header_tall_consumer():
    """consume_tall's shared memory addresses, and its dQ reduction (dq_reduction's rows and destination, write_dq's
    bytes: the writer warp issues it), read from the header: name -> function of the header's names (smem = 0)."""
    out = header_exprs("consume_tall", q_base=r"const uint32_t q_base = smem \+ (.+?), do_base",
                       do_base=r"do_base = smem \+ (.+?);", ds_base=r"const uint32_t ds_base = smem \+ (.+?);",
                       ds_desc=r"const uint64_t ds_desc = sw128_descriptor\((.+?), .+?, 1024\);",
                       ds_lbo=r"const uint64_t ds_desc = sw128_descriptor\(.+?, (.+?), 1024\);")
    out.update(header_exprs("dq_reduction", q0=r"const uint32_t q0 = (.+?);", none_if=r"if \((.+?)\) return 0;",
                            n=r"const uint32_t n = (.+?);", box=r"const uint32_t dq_col_box = (.+?);",
                            dst=r"dst = p\.dq_accum \+ (.+?);"))
    # dq_reduction's destination calls attention_bwd.cuh's dq_tiled_panel (the tiled layout's panel start): read too
    panel = re.search(r"uint64_t dq_tiled_panel\(.*?\{\s*return (.+?);\s*\}", BWD_HEADER.read_text(), re.S)
    panel_of, dst = c_expr(panel.group(1)), out["dst"]

    def dq_tiled_panel(b, h, r0, n, panel, heads, q_len, head_dim):
        return panel_of(b=b, h=h, r0=r0, n=n, panel=panel, heads=heads, q_len=q_len, head_dim=head_dim)

    out["dst"] = lambda **env: dst(dq_tiled_panel=dq_tiled_panel, **env)
    out.update(header_exprs("write_dq", bytes=r"bulk_reduce_add_f32\(dst, smem \+ L::DQ_OFF \+ cw \* L::DQ_BUF, (.+?)\);"))
    return out


LAYOUT = r"""
#include "SOURCE"
#include <stdio.h>
using L = tsgen::attention_bwd::wgmma::Layout<MODULE::Config>;
#define P(X) printf("L_" #X " %lld\n", (long long)L::X);
int main() {
  P(K_OFF) P(V_OFF) P(Q_OFF) P(DO_OFF) P(DS_OFF) P(DQ_OFF) P(KV_BOX) P(Q_BOX) P(Q_TILE) P(HALVES) P(BOXES) P(ROWS)
  P(DS_PANEL) P(DS_BUF) P(DQ_BUF) P(K16) P(TALL) P(DQ_SPLIT_N)
  printf("C_STAGES %lld\nC_HEADS %lld\nC_HEAD_DIM %lld\n", (long long)MODULE::Config::STAGES,
         (long long)MODULE::Config::HEADS, (long long)MODULE::Config::HEAD_DIM);
  return 0;
}
"""


@pytest.fixture(scope="module")
def tall_layout(tmp_path_factory):
    """Layout<Config> of a params.step_rows 128 spec (head dim 64, one head), host-compiled from the header:
    {"L_Q_OFF": .., "C_STAGES": .., ..}."""
    from tsgen.headers import include_flags
    from tsgen.toolchain import gencode_flags

    if NO_NVCC:
        pytest.skip(f"nvcc not found: {NO_NVCC}")
    tmp = tmp_path_factory.mktemp("tall_layout")
    source = rendered_source(variant("lay", params={"head_dim": 64, "heads": 1, "kv_heads": 1, "step_rows": 128}),
                             tmp)
    (tmp / "layout.cu").write_text(LAYOUT.replace("SOURCE", str(source)).replace("MODULE", "lay"))
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17", "-w", "-o",
                    str(tmp / "layout"), str(tmp / "layout.cu")], check=True, capture_output=True)
    out = subprocess.run([str(tmp / "layout")], capture_output=True, text=True, check=True).stdout
    return {name: int(value) for name, value in (line.split() for line in out.splitlines())}


def model_cta_tall(q, k, v, do, lse2, dsum, scale_log2, kv_len, causal, tiled, layout):
    """model_cta for params.step_rows 128 (consume_tall, head dim 64, dq_reduce bulk): steps of 128 query rows
    (two TMA boxes of 64 rows each; a second box wholly past the rows reloads the first, produce()'s rule), S^T
    and dP^T as 64 keys x 128 queries per warpgroup, dS^T stored thread by thread through the header's offset
    into two panels of 64 queries, dV / dK over 8 k16 steps of the 128 queries, and warpgroup w's dQ of queries
    64w .. 64w + 63 over all 128 keys (panel w, M-major) through the staging into its 64-row block's bulk
    reduction (none for a block past the rows); dQ read back through the convert's map `tiled`.
    The addresses are the header's: `layout` is Layout<Config> (host-compiled), produce()'s boxes and rows and
    consume_tall's operand bases, dS^T store, dQ descriptor, query block and reduction are its expressions
    (header_tall_producer, header_tall_consumer). The producer runs as far ahead as the stages let it (step
    i + STAGES loaded right after step i is consumed), so a stage that overlaps another, or a consumer that reads
    a stage the producer did not write for its step, fails."""
    d, BN, ROWS = 64, 128, 128
    L = layout
    assert L["L_ROWS"] == ROWS and L["L_BOXES"] == 1 and L["C_HEAD_DIM"] == d and L["C_STAGES"] >= 2
    produce, at = header_tall_producer(), header_tall_consumer()
    stage_store = header_dq_staging()
    sm = Smem(L["L_DQ_OFF"])
    K_OFF, V_OFF, KV_BOX = L["L_K_OFF"], L["L_V_OFF"], L["L_KV_BOX"]
    for off, src in ((K_OFF, k), (V_OFF, v)):
        pad = np.zeros((BN, d))
        pad[:kv_len] = src
        sm.tma_rows(off, KV_BOX, 0, pad)
    rows = q.shape[0]
    starts = list(range(0, rows, ROWS))
    loaded = {}  # stage -> the step whose Q and dO it holds

    def load(step):  # produce(): every box of the step's stage through the header's offsets and rows
        stage, r0 = step % L["C_STAGES"], starts[step]
        for x in range(L["L_BOXES"]):
            for h in range(L["L_HALVES"]):
                q_at, do_at, start = produce(L, stage, x, h, r0, rows)
                # a box starts in bounds (TMA zero-fills its rows past q_len); a box whose rows r0 + 64 h are past
                # q_len reloads rows of the step instead (P = dS = 0 there), never one wholly out of bounds
                assert r0 <= start < rows, ("a box starts past the rows or outside the step", r0, h, start)
                if r0 + 64 * h < rows:
                    assert start == r0 + 64 * h, (r0, h, start)
                for src, off in ((q, q_at), (do, do_at)):
                    box = np.zeros((64, d))
                    box[:min(64, rows - start)] = src[start:start + 64]
                    sm.tma_rows(off, L["L_Q_BOX"], 0, box)
        loaded[stage] = step

    accum = np.zeros(rows * d)
    dk, dv = np.zeros((2, 64, d)), np.zeros((2, 64, d))
    for step in range(min(L["C_STAGES"], len(starts))):
        load(step)
    for step, r0 in enumerate(starts):
        stage = step % L["C_STAGES"]
        assert loaded[stage] == step
        r1 = min(rows, r0 + ROWS)
        env = dict(L, stage=stage, step=step, r0=r0, r1=r1, BLOCK_M=64, BLOCK_N=BN, p_q_len=rows, b=0, w_hq=0)
        q_base, do_base, ds_base = at["q_base"](**env), at["do_base"](**env), at["ds_base"](**env)
        l2, ds_ = np.full(ROWS, np.inf), np.zeros(ROWS)
        l2[:r1 - r0], ds_[:r1 - r0] = lse2[r0:r1], dsum[r0:r1]
        for cw in range(2):
            s, dp = np.zeros((64, ROWS)), np.zeros((64, ROWS))
            for kk in range(d // 16):  # m64n128k16: B = 128 query rows, K-major
                s += sm.k_major(K_OFF + 64 * cw * 128 + 32 * kk, 64) @ sm.k_major(q_base + 32 * kk, ROWS).T
                dp += sm.k_major(V_OFF + 64 * cw * 128 + 32 * kk, 64) @ sm.k_major(do_base + 32 * kk, ROWS).T
            key = 64 * cw + np.arange(64)[:, None]
            qrow = r0 + np.arange(ROWS)[None, :]
            with np.errstate(over="ignore", invalid="ignore"):
                p = np.exp2(s * scale_log2 - l2[None, :])
            seen = (key < kv_len) & ((key <= qrow) if causal else True)
            p = np.where(seen, p, 0.0)
            dsT = p * (dp - ds_[None, :])
            p16, ds16 = bf16(p), bf16(dsT)
            store_ds_model(sm.mem, ds16, ds_base, cw, L["L_DS_PANEL"])  # two panels of 64 queries
            for kq in range(ROWS // 16):  # dV += P^T dO, dK += dS^T Q: 8 k16 steps of 2048 bytes
                dv[cw] += p16[:, 16 * kq:16 * kq + 16] @ sm.mn_major(do_base + kq * 2048, d, L["L_Q_BOX"])
                dk[cw] += ds16[:, 16 * kq:16 * kq + 16] @ sm.mn_major(q_base + kq * 2048, d, L["L_Q_BOX"])
        for cw in range(2):  # after DS_READY: dQ of queries 64 cw .. over the 128 keys
            start, lbo = at["ds_desc"](ds_base=ds_base, cw=cw, **L), at["ds_lbo"](**L)
            acc = np.zeros((64, 64))
            for kk in range(BN // 16):
                a = sm.mn_major(start + kk * 2048, 64, lbo).T  # M-major A: [m][k]
                b = sm.mn_major(K_OFF + kk * 2048, 64, KV_BOX)
                acc += a @ b
            staging = staged_partial(stage_store, acc)
            q0 = at["q0"](cw=cw, **env)
            if not at["none_if"](q0=q0, **env):  # the block's valid rows; none past the rows
                n = at["n"](q0=q0, **env)
                box = at["box"](cw=cw, **env)
                dst = at["dst"](q0=q0, n=n, dq_col_box=box, hq=0, **env)  # floats from dq_accum
                nbytes = at["bytes"](n=n)
                assert nbytes % 4 == 0 and 0 <= dst and dst + nbytes // 4 <= rows * d
                accum[dst:dst + nbytes // 4] += staging[:nbytes // 4]
        if step + L["C_STAGES"] < len(starts):  # the stage released (q_empty): the producer refills it
            load(step + L["C_STAGES"])
    return accum[tiled], np.concatenate(list(dk))[:kv_len], np.concatenate(list(dv))[:kv_len]


@needs_nvcc
@pytest.mark.parametrize("rows,causal", [(150, True), (300, False), exhaustive(300, True), exhaustive(64, True),
                                        exhaustive(192, False)])
def test_shared_memory_model_of_one_tall_cta(convert_map, tall_layout, rows, causal):
    """params.step_rows 128 (head dim 64): 100 keys (a tail of the 128-key block) against 150 / 300 / 64 / 192 query
    rows (steps of 128 with a tail: 22, 44 and 64 rows, the second 64-row box past the rows reloading the first,
    and warpgroup 1's query block past them reducing nothing; 150, 192: two steps, both stages; 300: three steps,
    stage 0 and the first dS^T buffer reused), one head: dQ, dK, dV through the modelled operand addresses and the
    bulk path against the family's reference within its tolerance. The addresses are the header's: Layout<Config>
    host-compiled, produce()'s box offsets and rows, and consume_tall's stage bases, dS^T store, dQ descriptor,
    query block and reduction read from it (model_cta_tall). A box at the wrong offset or stage stride, a box
    that starts past the rows, a store into the wrong panel or without the swizzle, dQ over the wrong panel or
    keys, or a reduction into the other warpgroup's block fails it."""
    d, kv_len = 64, 100
    case = OneHeadCase(np.random.default_rng(5), rows, kv_len, d, causal)
    offsets = convert_map(1, 1, rows, d, False).reshape(rows, d)
    case.check(*model_cta_tall(*case.model_args(), kv_len, causal, offsets, tall_layout))


KV_CTA = r"""
#include <cstdio>
#include <cstdlib>
#include "tsgen/attention_bwd.cuh"
int main(int argc, char** argv) {
  const uint32_t pairs = atoi(argv[1]), blocks = atoi(argv[2]), group = atoi(argv[3]);
  for (uint32_t c = 0; c < pairs * blocks; ++c) {
    const tsgen::attention_bwd::KvCta k = tsgen::attention_bwd::kv_cta(c, pairs, blocks, group);
    printf("%u %u\n", k.block, k.pair);
  }
  return 0;
}
"""


@needs_nvcc
def test_head_groups_order_the_ctas(tmp_path):
    """params.head_group's CTA order (kv_cta, host-compiled from the header): every (KV block, pair) once;
    group 0 or >= pairs is the shipped order (block j of every pair before block j + 1); with groups, a
    group's CTAs are contiguous, KV block major inside, the last group smaller; and a pair's block j
    always before its block j + 1 (the deterministic turns' assumption)."""
    from tsgen.headers import include_flags

    main = tmp_path / "kv_cta.cu"
    main.write_text(KV_CTA)
    exe = tmp_path / "kv_cta"
    subprocess.run([str(find_nvcc()), *include_flags(), "-std=c++17", "-w", "-o", str(exe), str(main)], check=True,
                   capture_output=True)

    def order(pairs, blocks, group):
        out = subprocess.run([str(exe), str(pairs), str(blocks), str(group)], capture_output=True, text=True,
                             check=True).stdout
        return [tuple(int(x) for x in line.split()) for line in out.splitlines()]

    for pairs, blocks in ((64, 64), (16, 32), (7, 5), (1, 9), (5, 1)):
        shipped = [(c // pairs, c % pairs) for c in range(pairs * blocks)]
        assert order(pairs, blocks, 0) == shipped and order(pairs, blocks, pairs) == shipped
        assert order(pairs, blocks, pairs + 3) == shipped
        for group in (1, 2, 3, 4, 8):
            got = order(pairs, blocks, group)
            assert sorted(got) == sorted(shipped), (pairs, blocks, group)  # each CTA once
            for pair in range(pairs):
                mine = [j for j, p in got if p == pair]
                assert mine == list(range(blocks)), (pairs, blocks, group, pair)  # block j before j + 1
            for g in range(-(-pairs // group)):  # the group's CTAs contiguous, KV block major inside
                members = list(range(g * group, min(pairs, (g + 1) * group)))
                start = g * group * blocks
                chunk = got[start:start + len(members) * blocks]
                assert chunk == [(j, p) for j in range(blocks) for p in members], (pairs, blocks, group, g)

def test_a_variant_over_the_shared_memory_limit_is_refused_by_name(monkeypatch):
    """The spec check names the shared memory a CTA would need when it exceeds what a Hopper CTA may use
    (the deterministic variant at hd 128 is under it): a clear error, not a launch failure."""
    import tsgen.ops.attention_backward as ab

    spec = variant("v", params={"deterministic": True}).model
    assert get_family("attention_backward").check(spec) == []
    monkeypatch.setattr(ab, "SMEM_LIMIT", smem_bytes(spec) - 1)
    problems = get_family("attention_backward").check(spec)
    assert [w for w, _ in problems] == [("params",)] and "shared memory" in problems[0][1], problems


# ---------------------------------------------------------------------------
# params.lookahead (consume_lookahead): the next step's S^T and dP^T under this step's dQ tail
# ---------------------------------------------------------------------------

# every ptxas "Potential Performance Loss" about wgmma: C7514 (accumulators read in flight) and C7518 (a
# wait in a divergent path) serialize every wgmma as well as the C7508 / C7510 / C7512 / C7520 that
# ptxas_problems names; the refuted s_prefetch (0952bc9) compiled with C7518 (40 waits for 40 HGMMA)
SERIALIZED = re.compile(r"\(C75\d\d\)")


def serialized(output) -> list[str]:
    from pathlib import Path

    text = Path(str(output) + ".ptxas.txt").read_text()
    return [line for line in text.splitlines() if SERIALIZED.search(line)]


def tool_cases(impl: str = "wgmma_l3"):
    """The (variant, spec changes) of every case tools/gpu_attention_bwd.py checks or benches with --impl
    `impl`."""
    from conftest import load_script
    from tsgen.spec import merge

    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    return {name: merge(tool.VARIANTS[name], tool.impl_changes(impl))
            for name in sorted(set(tool.CHECK_VARIANTS) | set(tool.BENCH_VARIANTS)) if tool.runs(name, impl)}


def main_kernel_ops(output, kernel: str) -> tuple[str, list]:
    """`kernel`'s SASS in `output` and its instructions as (address, predicate, opcode, operands)."""
    sass = dump_sass(output)
    main = sass_function(sass, kernel)
    return main, re.findall(r"/\*([0-9a-f]{4,6})\*/\s+((?:@!?U?P\w+\s+)?)([A-Z][A-Z0-9_.]*)([^;]*);", main)


def loop_body(ops, sts: bool = False) -> list[list]:
    """The consumers' loop (from the target of the backward branch around the first RS product to that branch)
    as events, runs of one event kept once with their count: the products SS, RS, dQ; the warpgroup waits
    wait0 / wait1; the named barriers DS_READY, DQ_STAGED (a sync, or the writer warp's arrive), DQ_FREE; q_empty,
    q_full; the staging's STS.64; UBLKRED;
    EX2; and with `sts` dS^T's stores (STSM: stmatrix, four 8 x 8 matrices each)."""
    def event(o, rest):
        r = re.sub(r"\s+", "", rest)
        if o.startswith("HGMMA"):
            return "dQ" if ".tnspA.tnspB" in r else ("RS" if ".tnspB" in r else "SS")
        if o == "WARPGROUP.DEPBAR.LE":
            return "wait" + r[-1]
        if o == "BAR.SYNC.DEFER_BLOCKING":
            return {"0x1,0x100": "DS_READY", "0x2,0x80": "DQ_STAGED", "0x3,0x80": "DQ_STAGED",
                    "0x5,0xa0": "DQ_FREE", "0x6,0xa0": "DQ_FREE"}.get(r, "BAR" + r)
        if o == "BAR.ARV":  # DQ_WRITER: the staging written, for the writer warp (a consumer warpgroup and it: 160)
            return {"0x2,0xa0": "DQ_STAGED", "0x3,0xa0": "DQ_STAGED"}.get(r, "ARV" + r)
        return {"SYNCS.ARRIVE.TRANS64.A1T0": "q_empty", "SYNCS.PHASECHK.TRANS64.TRYWAIT": "q_full",
                "STS.64": "STS.64", "UBLKRED.G.S.ADD.F32.RN": "UBLKRED", "MUFU.EX2": "EX2",
                **({"STSM.16.M88.4": "STSM"} if sts else {})}.get(o)

    last = int(ops[-1][0], 16)
    events = [(int(a, 16), e) for a, _, o, rest in ops if (e := event(o, rest)) is not None]
    rs_at = next(a for a, e in events if e == "RS")
    def target(rest):  # a branch's target: its last operand ("0x...", after a predicate operand "P1," where one is)
        word = rest.replace(",", " ").split()[-1] if rest.strip() else ""
        return int(word, 16) if word.startswith("0x") else None

    back = [(int(a, 16), t) for a, _, o, rest in ops
            if o == "BRA" and (t := target(rest)) is not None and t < int(a, 16) <= last]
    edge, top = next((a, t) for a, t in back if t < rs_at < a)  # the consumers' loop: its back edge
    body = []
    for a, e in events:
        if top <= a <= edge:
            if body and body[-1][0] == e:
                body[-1][1] += 1
            else:
                body.append([e, 1])
    return body


def test_lookahead_renders_only_where_set_and_is_refused_elsewhere(tmp_path):
    fam = get_family("attention_backward")
    shipped = [ROOT / "specs" / "attention_backward_hd128.yaml",
               ROOT / "specs" / "attention_backward_hd64_causal_gqa.yaml",
               ROOT / "examples" / "torch" / "specs" / "attention_backward_hd128_causal_gqa.yaml",
               ROOT / "examples" / "torch" / "specs" / "attention_backward_hd64_causal.yaml"]
    for path in shipped:  # unset in every shipped spec: its source has no LOOKAHEAD (tsgen build: 0 files)
        loaded = load_spec(path)
        assert not loaded.model.params.lookahead and "LOOKAHEAD" not in fam.constants(loaded.model)
        assert "LOOKAHEAD" not in rendered_source(loaded, tmp_path).read_text(), path
    on = variant("la", params={"lookahead": True})
    assert fam.constants(on.model)["LOOKAHEAD"] == 1 and fam.check(on.model) == []
    text = rendered_source(on, tmp_path).read_text()
    assert "static constexpr bool LOOKAHEAD = la::LOOKAHEAD != 0;" in text
    # the same shared memory, threads and workspace as the default
    assert smem_bytes(on.model) == smem_bytes(variant("v").model)
    assert text.replace("la::", "v::").count("HEAD_GROUP") == rendered_source(variant("v"), tmp_path).read_text().count(
        "HEAD_GROUP")
    # refused: mma_sync, dq_reduce atomic, deterministic (by name)
    spec = variant("v").model
    for update in ({"impl": "mma_sync"}, {"dq_reduce": "atomic"}, {"deterministic": True, "head_group": 0}):
        bad = spec.model_copy(update={"params": spec.params.model_copy(update={"lookahead": True, **update})})
        problems = [w for w, _ in fam.check(bad) if w == ("params", "lookahead")]
        assert problems == [("params", "lookahead")], (update, fam.check(bad))
    for name, changes in tool_cases().items():  # every case of the GPU tool's wgmma_l3 is a valid spec
        loaded = spec_variant(load_spec(SPEC), changes)
        assert loaded.model.params.lookahead and fam.check(loaded.model) == [], name


# by default hd 64 causal (the SASS tests build hd 128: lookahead not causal, dk_after_dq causal); every other
# tool case is `exhaustive`
TOOL_KEEP = ("hd64_causal_kv32",)


@needs_nvcc
@pytest.mark.parametrize("name", representative(sorted(tool_cases()), TOOL_KEEP))
def test_lookahead_compiles_without_spills_for_every_tool_case(tmp_path, monkeypatch, name):
    """Each shape tools/gpu_attention_bwd.py runs with --impl wgmma_l3 (hd 128 / 64, causal or not, GQA 32:32,
    32:8, 32:4, bhsd, fp16): 168 registers at entry (setmaxnreg 40 / 232), no spills, no stack, and no
    serialized wgmma of any kind (SERIALIZED)."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    loaded = spec_variant(load_spec(SPEC), {**tool_cases()[name], "name": "v"})
    res = compile_source(rendered_source(loaded, tmp_path))
    entry = res.report["v_w1_main"]
    assert entry["registers"] == 168, entry
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry
    assert serialized(res.output) == [], "no serialized wgmma"


@needs_sass
@pytest.mark.parametrize("head_dim", [128, exhaustive(64)])
def test_sass_of_the_lookahead_main_kernel(tmp_path, monkeypatch, head_dim):
    """params.lookahead: S^T and dP^T issued twice (before the walk, and in each step for the next one), dV /
    dK and dQ once; six warpgroup waits (two before the loop, four a step: no wgmma waited for alone); and
    the order the overlap rests on, in the loop: dV / dK, DS_READY, dQ, wait (dV / dK), q_empty, q_full, the
    next S^T, wait (dQ), the 16 staging stores, the next dP^T, DQ_STAGED, the bulk reduction, wait (S^T),
    P's exp2, wait (dP^T), and the back edge there (nothing in flight across it). The default kernel keeps
    four waits a step and issues S^T only after its dQ's staging and reduction."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    compiled = compile_source(rendered_source(variant("v", params={"head_dim": head_dim, "lookahead": True}), tmp_path))
    assert serialized(compiled.output) == []
    main, ops = main_kernel_ops(compiled.output, "v_w1_main")
    names = [o for _, _, o, _ in ops]
    assert not [n for n in names if n.startswith(("LDL", "STL", "CALL"))], "no local memory, no calls"
    body = loop_body(ops)
    every = [(o, rest) for _, _, o, rest in ops if o.startswith("HGMMA")]
    ss = sum(1 for o, r in every if "tnsp" not in r)
    assert ss == 2 * 2 * head_dim // 16 and sum(1 for o, r in every if ".tnspB" in r and "tnspA" not in r) == 8
    assert sum(1 for o, r in every if ".tnspA.tnspB" in r) == (128 if head_dim == 128 else 64) // 16
    assert names.count("WARPGROUP.DEPBAR.LE") == 6 and len(every) == ss + 8 + (8 if head_dim == 128 else 4)
    want = ["RS", "DS_READY", "dQ", "wait1", "q_empty", "q_full", "SS", "wait1", "STS.64", "SS", "DQ_STAGED",
            "UBLKRED", "wait1", "EX2", "wait0"]
    got = [e for e, _ in body]
    assert got == want, got
    assert dict((e, n) for e, n in body if e in ("STS.64", "EX2")) == {"STS.64": 16, "EX2": 64}
    assert [n for e, n in body if e == "SS"] == [head_dim // 16] * 2, "the next S^T, then the next dP^T"
    # the default: S^T of a step issued after the last step's dQ was waited for and staged
    base = dump_sass(compile_source(rendered_source(variant("b", params={"head_dim": head_dim}), tmp_path)).output)
    base = base[base.index("Function : b_w1_main"):]
    assert len(re.findall(r"WARPGROUP\.DEPBAR\.LE", base[:base.index("Function :", 10)] if "Function :" in
                          base[10:] else base)) == 4



# ---------------------------------------------------------------------------
# params.dk_after_dq: FlashAttention-3's order of a step's last products
# ---------------------------------------------------------------------------


def test_dk_after_dq_renders_only_where_set_and_is_refused_elsewhere(tmp_path):
    """Set in every shipped spec (head dim 128's 64-row steps, 64's 128-row ones); set, the constant and the Config's
    flag, the same shared memory; refused by name with mma_sync, dq_reduce atomic, deterministic and lookahead;
    accepted with step_rows 128 (consume_tall's DK_AFTER_DQ order); every case of the tool's wgmma_dkq and
    wgmma_m128dkq is a valid spec."""
    fam = get_family("attention_backward")
    for path in SHIPPED_BACKWARD:  # set in each
        loaded = load_spec(path)
        assert loaded.model.params.dk_after_dq and "DK_AFTER_DQ" in fam.constants(loaded.model)
        assert "DK_AFTER_DQ" in rendered_source(loaded, tmp_path).read_text(), path
    assert "DK_AFTER_DQ" not in fam.constants(variant("off").model)  # unset: not in the source
    on = variant("dkq", params={"dk_after_dq": True})
    assert fam.constants(on.model)["DK_AFTER_DQ"] == 1 and fam.check(on.model) == []
    assert "static constexpr bool DK_AFTER_DQ = dkq::DK_AFTER_DQ != 0;" in rendered_source(on, tmp_path).read_text()
    assert smem_bytes(on.model) == smem_bytes(variant("v").model)
    spec = variant("v").model
    for update in ({"impl": "mma_sync"}, {"dq_reduce": "atomic"}, {"deterministic": True, "head_group": 0},
                   {"lookahead": True}):
        bad = spec.model_copy(update={"params": spec.params.model_copy(update={"dk_after_dq": True, **update})})
        assert ("params", "dk_after_dq") in [w for w, _ in fam.check(bad)], (update, fam.check(bad))
    tall = variant("t", params={"head_dim": 64, "step_rows": 128, "dk_after_dq": True})
    assert tall.model.params.tall and fam.check(tall.model) == [] and fam.constants(tall.model)["DK_AFTER_DQ"] == 1
    for impl in ("wgmma_dkq", "wgmma_m128dkq"):
        for name, changes in tool_cases(impl).items():
            loaded = spec_variant(load_spec(SPEC), changes)
            assert loaded.model.params.dk_after_dq and fam.check(loaded.model) == [], (impl, name)


@needs_nvcc
@pytest.mark.parametrize("name", representative(sorted(tool_cases("wgmma_dkq")), TOOL_KEEP))
def test_dk_after_dq_compiles_without_spills_for_every_tool_case(tmp_path, monkeypatch, name):
    """Each shape the tool runs with --impl wgmma_dkq: 168 registers at entry, no spills, no stack, and no
    serialized wgmma (dS^T's registers stay live under dV, the dQ and dK without ptxas serializing them)."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    loaded = spec_variant(load_spec(SPEC), {**tool_cases("wgmma_dkq")[name], "name": "v"})
    res = compile_source(rendered_source(loaded, tmp_path))
    entry = res.report["v_w1_main"]
    assert entry["registers"] == 168, entry
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry
    assert serialized(res.output) == [], "no serialized wgmma"


# The dQ writer warp's protocol, in the order it must keep: sync on DQ_STAGED + 0 (warpgroup 0's staging is in),
# issue its bulk reduction, the same for warpgroup 1 (DQ_STAGED + 1), then wait until the first reduction has read
# its staging and free it (DQ_FREE + 0), then the second (DQ_FREE + 1). Arriving before the wait, or the waits
# swapped, lets a warpgroup overwrite staging a reduction still reads.
WRITER_ORDER = ["BAR.SYNC 0x2", "UBLKRED", "BAR.SYNC 0x3", "UBLKRED", "DEPBAR.LE SB0,0x1", "BAR.ARV 0x5",
                "DEPBAR.LE SB0,0x0", "BAR.ARV 0x6"]


def writer_events(ops) -> list[str]:
    """The writer warp's barriers, bulk reductions and bulk waits, from the DQ_STAGED + 0 sync before the kernel's
    first UBLKRED to the DQ_FREE + 1 arrive after its last (ops: main_kernel_ops)."""
    first = next(i for i, (_, _, o, _) in enumerate(ops) if o.startswith("UBLKRED"))
    start = max(i for i, (_, _, o, r) in enumerate(ops[:first]) if o.startswith("BAR.SYNC") and r.strip().startswith("0x2,"))
    end = next(i for i, (_, _, o, r) in enumerate(ops) if i > first and o == "BAR.ARV" and r.strip().startswith("0x6,"))
    events = []
    for _, _, o, r in ops[start:end + 1]:
        arg = re.sub(r"\s+", "", r).split(";")[0]
        if o.startswith("BAR.SYNC") or o == "BAR.ARV":
            events.append(f"{o.split('.DEFER')[0]} {arg.split(',')[0]}")
        elif o.startswith("UBLKRED"):
            events.append("UBLKRED")
        elif o == "DEPBAR.LE":
            events.append(f"DEPBAR.LE {arg}")
    return events


@needs_sass
@pytest.mark.parametrize("head_dim, causal", [exhaustive(128, False), (128, True), exhaustive(64, True)])
def test_sass_of_the_dk_after_dq_main_kernel(tmp_path, monkeypatch, head_dim, causal):
    """params.dk_after_dq, the loop in the order the overlap rests on: S^T and dP^T, wait, half of P's exp2, wait,
    the other half beside dS^T, dS^T's stores (stmatrix), dV alone, DS_READY, dQ, wait (dV), dK, wait (dQ),
    DQ_FREE (the writer warp has read the last staging), the 16 staging stores, DQ_STAGED (arrive: the writer warp
    issues the bulk reduction), and only then wait (dK) and q_empty (dV read dO, dK read Q). The default in the
    same place: dV and dK together before DS_READY, dQ, both waits before the staging. The writer warp's own
    order: WRITER_ORDER."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    params = {"head_dim": head_dim, "causal": causal}
    compiled = compile_source(rendered_source(variant("v", params={**params, "dk_after_dq": True}), tmp_path))
    assert serialized(compiled.output) == []
    _, ops = main_kernel_ops(compiled.output, "v_w1_main")
    names = [o for _, _, o, _ in ops]
    assert not [n for n in names if n.startswith(("LDL", "STL", "CALL"))], "no local memory, no calls"
    body = loop_body(ops, sts=True)
    got = [e for e, _ in body]
    assert got == ["q_full", "SS", "wait1", "EX2", "wait0", "EX2", "STSM", "RS", "DS_READY", "dQ", "wait1", "RS", "wait1",
                   "DQ_FREE", "STS.64", "DQ_STAGED", "wait0", "q_empty"], got
    assert [n for e, n in body if e == "RS"] == [4, 4], "dV, then dK: four k16 steps each over the 64 queries"
    # half of P's exp2 before dP^T's wait, half after it beside dS^T (each in the masked and the unmasked path)
    assert [n for e, n in body if e == "EX2"] == [32, 32], body
    base = compile_source(rendered_source(variant("b", params=params), tmp_path))
    got = [e for e, _ in loop_body(main_kernel_ops(base.output, "b_w1_main")[1], sts=True)]
    assert got == ["q_full", "SS", "wait1", "EX2", "wait0", "EX2", "STSM", "RS", "DS_READY", "dQ", "wait1", "q_empty",
                   "wait0", "DQ_FREE", "STS.64", "DQ_STAGED"], got
    assert writer_events(ops) == WRITER_ORDER and writer_events(main_kernel_ops(base.output, "b_w1_main")[1]) == WRITER_ORDER


# ---------------------------------------------------------------------------
# params.step_rows 128 (consume_tall): steps of 128 query rows at head dim 64
# ---------------------------------------------------------------------------

SHIPPED_BACKWARD = [ROOT / "specs" / "attention_backward_hd128.yaml",
                    ROOT / "specs" / "attention_backward_hd64_causal_gqa.yaml",
                    ROOT / "examples" / "torch" / "specs" / "attention_backward_hd128_causal_gqa.yaml",
                    ROOT / "examples" / "torch" / "specs" / "attention_backward_hd64_causal.yaml"]


def tall_tool_cases():
    """The (variant, spec changes) of every case tools/gpu_attention_bwd.py checks or benches with --impl
    wgmma_m128 (its head-dim-64 variants: tool.runs)."""
    from conftest import load_script
    from tsgen.spec import merge

    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    return {name: merge(tool.VARIANTS[name], tool.impl_changes("wgmma_m128"))
            for name in sorted(set(tool.CHECK_VARIANTS) | set(tool.BENCH_VARIANTS)) if tool.runs(name, "wgmma_m128")}


def test_step_rows_renders_only_where_set_and_is_refused_elsewhere(tmp_path):
    """128 in the shipped head-dim-64 backward specs; unset in the head-dim-128 ones: no STEP_ROWS constant, no
    mma_s_n128 (S^T, dP^T as m64n128) in the Config; 64 explicit renders as unset. 128: STEP_ROWS and mma_s_n128 rendered,
    the shared memory of 128-row Q, dO, dS^T, LSE2 and D tiles; refused by name with mma_sync, head dim 128,
    dq_reduce atomic, deterministic and lookahead."""
    fam = get_family("attention_backward")
    for path in SHIPPED_BACKWARD:  # 128 in the head-dim-64 ones; unset at 128 (no STEP_ROWS, no mma_s_n128)
        loaded = load_spec(path)
        tall = loaded.model.params.head_dim == 64
        assert loaded.model.params.step_rows == (128 if tall else None) and loaded.model.params.tall == tall
        assert ("STEP_ROWS" in fam.constants(loaded.model)) == tall
        text = rendered_source(loaded, tmp_path).read_text()
        assert ("STEP_ROWS" in text) == tall and ("mma_s_n128" in text) == tall, path
    plain = variant("v", params={"head_dim": 64})
    explicit = variant("v", params={"head_dim": 64, "step_rows": 64})
    assert fam.constants(explicit.model) == fam.constants(plain.model)
    (tmp_path / "e").mkdir()

    def code(path):  # the source from its Config on (the header above names the spec and its variant lines)
        text = path.read_text()
        return text[text.index("struct Config {"):]

    assert code(rendered_source(explicit, tmp_path / "e")) == code(rendered_source(plain, tmp_path)), "64: the default"
    on = variant("tall", params={"head_dim": 64, "causal": True, "step_rows": 128})
    assert on.model.params.tall and fam.constants(on.model)["STEP_ROWS"] == 128 and fam.check(on.model) == []
    text = rendered_source(on, tmp_path).read_text()
    assert "static constexpr int STEP_ROWS = tall::STEP_ROWS;" in text
    assert "static __device__ __forceinline__ void mma_s_n128(float (&d)[64], uint64_t desc_a" in text
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in text
    # K, V 128 x 64; 2 stages of Q and dO 128 x 64; two dS^T buffers 128 keys x 128 queries; the fp32 staging
    # (64 x 64 per warpgroup); LSE2 and D of 128 rows per stage; 5 barriers; 1 KiB alignment slack
    assert smem_bytes(on.model) == (2 * (2 * 128 * 64 + 2 * 2 * 128 * 64 + 2 * 128 * 128) + DQ_STAGING
                                    + 2 * 4 * 2 * 128 + 40 + 1024) == 199720 <= 227 * 1024
    assert smem_bytes(on.model) - smem_bytes(plain.model) == 199720 - 133160
    spec = on.model
    for update in ({"impl": "mma_sync"}, {"head_dim": 128}, {"dq_reduce": "atomic"},
                   {"deterministic": True, "head_group": 0}, {"lookahead": True}):
        bad = spec.model_copy(update={"params": spec.params.model_copy(update=update)})
        problems = [w for w, _ in fam.check(bad) if w == ("params", "step_rows")]
        assert problems == [("params", "step_rows")], (update, fam.check(bad))
    for name, changes in tall_tool_cases().items():  # every case of the GPU tool's wgmma_m128 is a valid spec
        loaded = spec_variant(load_spec(SPEC), changes)
        assert loaded.model.params.tall and loaded.model.params.head_dim == 64 and fam.check(loaded.model) == [], name
    assert sorted(tall_tool_cases()) == ["hd64_causal_kv32", "hd64_full_kv32", "hd64_full_kv8"]


TALL_EXTRA = {"f16_bhsd": {"dtype": "float16", "params": {"head_dim": 64, "layout": "bhsd", "step_rows": 128}},
              "causal_gqa_g0": {"params": {"head_dim": 64, "causal": True, "kv_heads": 8, "head_group": 0,
                                           "step_rows": 128}}}


@needs_nvcc
@pytest.mark.parametrize("name", representative(sorted(tall_tool_cases()) + sorted(TALL_EXTRA), ("f16_bhsd",)))
def test_step_rows_128_compiles_without_spills(tmp_path, monkeypatch, name):
    """Each shape tools/gpu_attention_bwd.py runs with --impl wgmma_m128 (hd 64: MHA causal and not, GQA 32:8 not
    causal), and fp16 bhsd, GQA causal without head groups: 168 registers at entry (setmaxnreg 40 / 232: the
    consumers hold S^T 64 + dP^T 64 + dK 32 + dV 32 accumulators at the peak), no spills, no stack, no serialized
    wgmma of any kind (SERIALIZED: C7508 .. C7520), no ignored setmaxnreg."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    changes = tall_tool_cases()[name] if name in tall_tool_cases() else TALL_EXTRA[name]
    loaded = spec_variant(load_spec(SPEC), {**changes, "name": "v", "launch": {"threads": 384},
                                            "params": {"impl": "wgmma", "dk_after_dq": False, **changes["params"]}})
    res = compile_source(rendered_source(loaded, tmp_path))
    entry = res.report["v_w1_main"]
    assert entry["registers"] == 168, entry
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, entry
    assert ptxas_problems(res.output) == [] and serialized(res.output) == [], "no serialized wgmma"
    assert res.serialized == [], res.serialized


@needs_sass
@pytest.mark.parametrize("causal, dk_after_dq", [(True, False), exhaustive(False, False), (True, True),
                                                 exhaustive(False, True)])
def test_sass_of_the_tall_main_kernel(tmp_path, monkeypatch, causal, dk_after_dq):
    """params.step_rows 128: S^T and dP^T as 4 + 4 HGMMA 64x128x16 from shared memory (K-major), dV and dK as 8 + 8
    HGMMA 64x64x16 with A from registers (tnspB), dQ as 8 HGMMA 64x64x16 (tnspA.tnspB: 128 keys), nothing else;
    four warpgroup waits, 128 exp2 (the masked and unmasked paths, 64 each: half before dP^T's wait, half after
    it), 8 dS^T stmatrix and 16 staging stores a step, the writer warp's two bulk reductions (one a consumer
    warpgroup) and nothing else of dQ's, 7 named barriers (ptxas's count), no local memory, no call; and the loop in
    consume()'s order: q_full, S^T / dP^T, wait (S^T), half of the exp2, wait (dP^T), the other half beside dS^T, its
    stores, dV / dK, DS_READY, dQ, wait (dV / dK), q_empty, wait (dQ), DQ_FREE, the staging, DQ_STAGED. With
    params.dk_after_dq, consume()'s DK_AFTER_DQ order over the 128 rows: dV alone, DS_READY, dQ, wait (dV), dK,
    wait (dQ), DQ_FREE, the staging, DQ_STAGED, and only then wait (dK) and q_empty; no spill for dS^T's registers
    kept until dK retires. The writer warp in WRITER_ORDER."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    compiled = compile_source(rendered_source(variant("v", params={"head_dim": 64, "causal": causal, "step_rows": 128,
                                                                   "dk_after_dq": dk_after_dq}), tmp_path))
    assert serialized(compiled.output) == []
    main, ops = main_kernel_ops(compiled.output, "v_w1_main")
    names = [o for _, _, o, _ in ops]
    assert not [n for n in names if n.startswith(("LDL", "STL", "CALL", "ATOM"))], "no local memory, no calls"
    hgmma = [re.sub(r"\s+", "", o + rest) for _, _, o, rest in ops if o.startswith("HGMMA")]
    ss = [h for h in hgmma if "tnsp" not in h]
    rs = [h for h in hgmma if ".tnspB" in h and "tnspA" not in h]
    dq = [h for h in hgmma if ".tnspA.tnspB" in h]
    assert len(ss) == 8 and all(h.startswith("HGMMA.64x128x16.F32.BF16R") for h in ss), ss
    assert len(rs) == 16 and all(re.match(r"HGMMA\.64x64x16\.F32\.BF16R\d+,R\d+,gdesc", h) for h in rs), rs
    assert len(dq) == 8 and all(h.startswith("HGMMA.64x64x16") for h in dq), dq
    assert len(hgmma) == 32
    assert names.count("WARPGROUP.DEPBAR.LE") == (5 if dk_after_dq else 4), "batched wgmma, not serialized"
    assert names.count("MUFU.EX2") == 128 and names.count("STS.64") == 16
    assert names.count("UBLKRED.G.S.ADD.F32.RN") == 2 and "REDG.E.ADD.F32.FTZ.RN.STRONG.GPU" not in names
    bars = sorted(int(m, 16) for m in re.findall(r"BAR\.SYNC\.DEFER_BLOCKING (0x[0-9a-f]+)\b", main))
    assert bars == [0, 1, 2, 3, 5, 6], bars  # DQ_STAGED: the writer warp syncs; DQ_FREE: the warpgroups do
    elf = subprocess.run([str(find_cuobjdump()), "-elf", str(compiled.output)], capture_output=True, text=True,
                         check=True).stdout
    assert [int(v, 16) for v in re.findall(r"EIATTR_NUM_BARRIERS\s+Format:\s+\S+\s+Value:\s+(0x[0-9a-f]+)", elf)] == [7]

    body = loop_body(ops, sts=True)
    got = [e for e, _ in body]
    if dk_after_dq:
        want = ["q_full", "SS", "wait1", "EX2", "wait0", "EX2", "STSM", "RS", "DS_READY", "dQ", "wait1", "RS", "wait1",
                "DQ_FREE", "STS.64", "DQ_STAGED", "wait0", "q_empty"]
    else:
        want = ["q_full", "SS", "wait1", "EX2", "wait0", "EX2", "STSM", "RS", "DS_READY", "dQ", "wait1", "q_empty", "wait0",
                "DQ_FREE", "STS.64", "DQ_STAGED"]
    assert got == want, got
    counts = {}
    for e, n in body:
        counts[e] = counts.get(e, 0) + n
    assert counts["SS"] == 8 and counts["RS"] == 16 and counts["dQ"] == 8 and counts["EX2"] == 128
    assert [n for e, n in body if e == "EX2"] == [64, 64], "half of P's exp2 on each side of dP^T's wait"
    assert counts["STSM"] == 8 and counts["STS.64"] == 16, counts  # dS^T: one stmatrix a k16 step
    assert writer_events(ops) == WRITER_ORDER


def test_gpu_tool_runs_step_rows_128_on_head_dim_64_only(tmp_path, monkeypatch):
    """--impl wgmma_m128,wgmma (the next device command): wgmma_m128 is built, checked and benched for the head-dim-64
    variants only (the spec check refuses it at 128), wgmma for all; the bench has hd 64 MHA causal and not causal
    rows; the report's x is the first listed impl's time over the others' (taken from a row where both ran) and
    the SDPA ratios are against the last listed."""
    import json

    from conftest import load_script

    tool = load_script(ROOT / "tools" / "gpu_attention_bwd.py")
    assert tool.IMPL_PARAMS["wgmma_m128"] == {"impl": "wgmma", "dk_after_dq": False, "step_rows": 128,
                                              "tail_split": False}
    hd64 = sorted(n for n in tool.VARIANTS if tool.VARIANTS[n]["params"]["head_dim"] == 64)
    assert sorted(n for n in tool.VARIANTS if tool.runs(n, "wgmma_m128")) == hd64
    assert sorted(n for n in tool.VARIANTS if tool.runs(n, "wgmma_m128dkq")) == hd64
    assert all(tool.runs(n, i) for n in tool.VARIANTS for i in tool.IMPLS if i not in tool.IMPL_ONLY)
    assert sorted(n for n in tool.VARIANTS if tool.runs(n, "shipped_r80")) == sorted(
        n for n, v in tool.VARIANTS.items() if v["params"]["head_dim"] == 128 and not v["params"]["causal"])
    assert {"hd64_causal_kv32", "hd64_full_kv32"} <= set(tool.BENCH_VARIANTS)
    built, children = [], []
    monkeypatch.setattr(tool, "build", lambda out, name, impl: built.append((name, impl)) or {"n": name, "i": impl})
    monkeypatch.setattr(tool, "build_forward", lambda out, name: {"forward": name})
    monkeypatch.setattr(tool, "device_name", lambda: "test")
    monkeypatch.setattr(tool, "child", lambda args, timeout: children.append(args) or (
        {"pass": True, "cases": []} if args[0] == "check" else {"rows": []}, ""))
    monkeypatch.setattr(tool.sys, "argv", ["gpu_attention_bwd.py", str(tmp_path), "--impl", "wgmma_m128,wgmma"])
    assert tool.main() == 0
    names = set(tool.CHECK_VARIANTS) | set(tool.BENCH_VARIANTS)
    assert sorted(built) == sorted([(n, "wgmma") for n in names] + [(n, "wgmma_m128") for n in names if n in hd64])
    checked = [(json.loads(a[1])["n"], json.loads(a[1])["i"]) for a in children if a[0] == "check"]
    assert sorted(checked) == sorted([(n, "wgmma") for n in tool.CHECK_VARIANTS]
                                     + [(n, "wgmma_m128") for n in tool.CHECK_VARIANTS if n in hd64])
    (bench,) = [json.loads(a[1]) for a in children if a[0] == "bench"]
    assert {n: sorted(b) for n, b in bench.items()} == {
        n: sorted(["wgmma_m128", "wgmma"] if n in hd64 else ["wgmma"]) for n in tool.BENCH_VARIANTS}
    rows = [{"variant": "hd128_full_kv32", "seq": 4096, "batch": 4, "ref": "tsgen_wgmma", "last": "tsgen_wgmma",
             "tsgen_wgmma": {"tflops": 470.0}, "sdpa_cudnn": {"tflops": 540.0, "ratio": 1.15}},
            {"variant": "hd64_causal_kv32", "seq": 4096, "batch": 4, "ref": "tsgen_wgmma_m128", "last": "tsgen_wgmma",
             "tsgen_wgmma_m128": {"tflops": 375.0}, "tsgen_wgmma": {"tflops": 313.0, "ratio_ref": 0.83},
             "sdpa_cudnn": {"tflops": 358.0, "ratio": 1.14}}]
    text = tool.markdown({"device": "d", "date": "t", "command": "c", "checks": {}, "bench": {"rows": rows}})
    assert "ratio = SDPA time / tsgen_wgmma time" in text and "x = tsgen_wgmma_m128's time / theirs" in text
    assert "| variant | S | tsgen_wgmma | x | tsgen_wgmma_m128 | x | SDPA flash |" in text
    assert "| hd128_full_kv32 | 4096 | 470 | ref | - | - | - | - | 540 | 1.15 |" in text
    assert "| hd64_causal_kv32 | 4096 | 313 | 0.83 | 375 | ref | - | - | 358 | 1.14 |" in text


# ---------------------------------------------------------------------------
# params.tail_split: the last wave's items cut into pieces along their walks
# ---------------------------------------------------------------------------


def test_tail_split_is_on_where_it_applies_and_refused_elsewhere(tmp_path):
    """Unset, params.tail_split resolves on for the shipped not-causal spec (impl wgmma, bulk dQ, 64-row steps) and
    off for causal, deterministic, dq_reduce atomic, lookahead, step_rows 128 and mma_sync; set true there, it is
    refused by name with its reason. On: the manifest's TAIL_SPLIT (the workspace's slots), dq_accum grown by them
    (workspace_floats too), the tail kernel rendered and passed to the launch; off: none of them."""
    from tsgen.errors import SpecError
    from tsgen.ops.attention_backward import TAIL_ITEMS, tail_floats, workspace_floats

    fam = get_family("attention_backward")
    shipped = load_spec(SPEC).model
    assert shipped.params.tail_split is None and shipped.params.split_tail
    assert fam.constants(shipped)["TAIL_SPLIT"] == TAIL_ITEMS == 64
    accum = next(b for b in fam.buffers(shipped) if b.name == "dq_accum")
    for q_len in (1, 1000, 4096):
        floats = q_len * 32 * 128
        assert accum.elems(q_len) == floats + tail_floats(TAIL_ITEMS, 128) == floats + 64 * 256 * 128
        assert workspace_floats(1, q_len, 32, 128, False, TAIL_ITEMS)[0] == accum.elems(q_len)
    source = rendered_source(spec_variant(load_spec(SPEC), {"name": "on"}), tmp_path).read_text()
    assert "on_w1_tail(const __grid_constant__" in source and "stream, on_w1_tail);" in source
    assert "static constexpr bool TAIL_SPLIT = on::TAIL_SPLIT != 0;" in source
    off = rendered_source(variant("off"), tmp_path).read_text()
    assert "TAIL_SPLIT" not in off and "_tail" not in off and "Three kernels" in off
    reasons = {"causal": ({"causal": True}, "causal false only"),
               "deterministic": ({"deterministic": True}, "with deterministic is not built"),
               "atomic": ({"dq_reduce": "atomic"}, "dq_reduce bulk only"),
               "lookahead": ({"lookahead": True}, "with lookahead is not built"),
               "tall": ({"head_dim": 64, "step_rows": 128}, "with step_rows 128 is not built")}
    for name, (params, why) in reasons.items():
        unset = variant("v", params={**params, "tail_split": None}).model
        assert not unset.params.split_tail and "TAIL_SPLIT" not in fam.constants(unset), name
        with pytest.raises(SpecError) as e:
            variant("v", params={**params, "tail_split": True})
        assert "params.tail_split: tail_split" in str(e.value) and why in str(e.value), (name, str(e.value))
    mma = {"params": {"impl": "mma_sync", "dk_after_dq": False}, "launch": {"threads": 128}}
    assert not spec_variant(load_spec(SPEC), mma).model.params.split_tail
    with pytest.raises(SpecError, match="tail_split needs params.impl wgmma"):
        spec_variant(load_spec(SPEC), {**mma, "params": {**mma["params"], "tail_split": True}})


TAIL = r"""
#include "SOURCE"
#include <stdio.h>
#include <stdlib.h>
namespace bw = tsgen::attention_bwd::wgmma;
int main(int argc, char** argv) {
  (void)argc;
  tsgen::attention_bwd::Problem p = {};
  p.q_len = atoi(argv[1]), p.kv_len = 1;
  const uint64_t items = strtoull(argv[2], nullptr, 10);
  const uint32_t sms = atoi(argv[3]);
  using W = bw::Walk<MODULE::Config>;
  const bw::TailPlan t = bw::tail_plan(items, sms, W::steps(p));
  p.tail_first = t.first, p.tail_parts = t.parts;
  printf("plan %u %u %u\n", t.first, t.parts, W::steps(p));
  for (uint64_t x = t.first; x < t.first + (items - t.first) * t.parts; ++x) {
    const bw::Part part = bw::tail_part<MODULE::Config>(p, (uint32_t)x);
    printf("%u %u %u", part.slot, part.begin, part.count);
    for (W w(p, 1, 0, part); !w.done(); w.next(p)) printf(" %u.%u", w.hq, w.qb);
    printf("\n");
  }
}
"""


@needs_nvcc
@pytest.mark.parametrize("rows", [64, 80])
def test_tail_pieces_walk_each_split_item_exactly_once(tmp_path, rows):
    """The header's tail_plan (compiled as host code) agrees with tsgen.ops.attention_backward.tail_plan; it splits
    only a last wave of at most TAIL_ITEMS items and at most half the SMs, in more than one wave; the grid then
    has at most one wave of pieces; and per split item, its pieces (tail_part, Walk over the Part, KV head 1 of 2
    over 4 query heads) walk the whole item's steps in order, each step once, each piece at least one step, their
    lengths within one of each other. rows 80 (params.step_rows, head dim 128): the same over steps of 80 rows (the
    expected splits below are 64-row steps'; at 80 the header and tsgen.ops agree on their own)."""
    from tsgen.headers import include_flags
    from tsgen.ops.attention_backward import tail_plan
    from tsgen.toolchain import gencode_flags

    wide = {"step_rows": 80, "head_dim": 128} if rows == 80 else {"head_dim": 64}
    source = rendered_source(variant("tail", params={"heads": 4, "kv_heads": 2, "tail_split": True, **wide}),
                             tmp_path)
    main = tmp_path / "tail_main.cu"
    main.write_text(TAIL.replace("SOURCE", str(source)).replace("MODULE", "tail"))
    exe = tmp_path / "tail_main"
    subprocess.run([str(find_nvcc()), *gencode_flags("sm_90a"), *include_flags(), "-std=c++17", "-w", "-o", str(exe),
                    str(main)], check=True, capture_output=True)
    # (q_len, items, SMs, expected (split items, parts)): H100 / H200 132 SMs, and others
    cases = [(1000, 1120, 132, (64, 2)), (1000, 140, 132, (8, 16)), (2048, 4096, 132, (4, 33)),
             (64, 4096, 132, (4, 2)), (1, 300, 132, (36, 2)), (1000, 1024, 132, (0, 1)), (1000, 100, 132, (0, 1)),
             (1000, 264, 132, (0, 1)), (1000, 200, 114, (0, 1)), (1000, 150, 114, (36, 3)), (130, 133, 132, (1, 6))]
    split_seen = 0
    for q_len, items, sms, (split, parts) in cases:
        out = subprocess.run([str(exe), str(q_len), str(items), str(sms)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
        first, got_parts, steps = map(int, out[0].split()[1:])
        assert (first, got_parts) == tail_plan(items, sms, steps), (q_len, items, sms)
        if rows == 80:
            split, parts = items - first, got_parts
        assert (first, got_parts) == (items - split, parts), (q_len, items, sms)
        split_seen += split
        assert steps == 2 * -(-q_len // rows)
        whole = [f"{hq}.{qb}" for hq in (2, 3) for qb in range(-(-q_len // rows))]
        pieces = [line.split() for line in out[1:]]
        assert len(pieces) == split * parts and (split == 0 or split * parts <= sms), (q_len, items, sms)
        for slot in range(split):
            mine = [p for p in pieces if int(p[0]) == slot]
            assert [int(p[1]) for p in mine] == sorted(int(p[1]) for p in mine)
            counts = [int(p[2]) for p in mine]
            assert [len(p) - 3 for p in mine] == counts and min(counts) >= 1 and max(counts) - min(counts) <= 1
            assert [s for p in mine for s in p[3:]] == whole, (q_len, items, sms, slot)
    assert split_seen, "some case splits its last wave"


@needs_sass
def test_sass_of_the_tail_split_main_kernel(tmp_path, monkeypatch):
    """The shipped head-dim-128 kernel (dk_after_dq, tail_split on): the loop's order as without the split (the range
    is a counter beside the walk), the pieces' 64 vector fp32 reductions (2 rows x 16 column groups x dK, dV) after
    it, no call (the pieces' step arithmetic is 32-bit), no local memory; the tail kernel without spills."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    params = {"dk_after_dq": True}
    compiled = compile_source(rendered_source(variant("v", params={**params, "tail_split": True}), tmp_path))
    assert serialized(compiled.output) == []
    assert compiled.report["v_w1_main"]["registers"] == 168
    for kernel in ("v_w1_main", "v_w1_tail"):
        entry = compiled.report[kernel]
        assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0 and entry["stack_frame"] == 0, (kernel, entry)
    _, ops = main_kernel_ops(compiled.output, "v_w1_main")
    names = [o for _, _, o, _ in ops]
    assert not [n for n in names if n.startswith(("LDL", "STL", "CALL"))], "no local memory, no calls"
    reds = [o + rest for _, _, o, rest in ops if o.startswith("REDG")]
    assert len(reds) == 64 and all(r.startswith("REDG.E.ADD.F32") for r in reds), reds
    base = compile_source(rendered_source(variant("b", params=params), tmp_path))
    whole = [e for e, _ in loop_body(main_kernel_ops(base.output, "b_w1_main")[1], sts=True)]
    assert [e for e, _ in loop_body(ops, sts=True)] == whole
    assert not [n for _, _, n, _ in main_kernel_ops(base.output, "b_w1_main")[1] if n.startswith("REDG")]


# params.step_rows 80 (WIDE: consume() with S^T, dP^T as m64n80 and dQ transposed; docs/design/attention.md
# "Steps of 80 query rows")
def test_step_rows_80_rules_and_sizes():
    """Built for head dim 128, not causal, the bulk dQ path with the writer warp: the other combinations are refused
    on params.step_rows, by name; the constants that select it (TILE_M: the Q and dO maps' 80-row boxes) and the
    shared memory the header's Layout asserts (K, V, two stages of 80-row Q and dO, two dS buffers, two 80 x 64 fp32
    stagings: 231 720 bytes of the 232 448)."""
    fam = get_family("attention_backward")
    wide = variant("v", params={"step_rows": 80, "dk_after_dq": True}).model
    assert fam.check(wide) == [] and wide.params.wide and not wide.params.tall
    assert smem_bytes(wide) == 231720 <= 232448
    consts = fam.constants(wide)
    assert (consts["TILE_M"], consts["STEP_ROWS"]) == (80, 80)
    assert "STEP_ROWS" not in fam.constants(variant("v").model) and fam.constants(variant("v").model)["TILE_M"] == 64
    tailed = variant("v", params={"step_rows": 80, "tail_split": True}).model
    assert fam.check(tailed) == [] and tailed.params.split_tail, "the ranged walk takes steps of any size"
    base = variant("v").model
    for params, why in (({"causal": True}, "causal false only"), ({"head_dim": 64}, "head_dim 128 only"),
                        ({"deterministic": True}, "with deterministic"), ({"lookahead": True}, "with lookahead"),
                        ({"kv_push": True}, "with kv_push"), ({"dq_reduce": "atomic"}, "dq_reduce bulk only"),
                        ({"impl": "mma_sync", "dq_reduce": "atomic"}, "needs params.impl wgmma")):
        bad = base.model_copy(update={"params": base.params.model_copy(update={"step_rows": 80, **params})})
        said = [m for w, m in fam.check(bad) if w == ("params", "step_rows")]
        assert len(said) == 1 and why in said[0], (params, said)  # each rule by its own message


@needs_sass
@pytest.mark.parametrize("params", [exhaustive({"dk_after_dq": True}), exhaustive({"dk_after_dq": False}),
                                    {"dk_after_dq": True, "tail_split": True, "kv_heads": 8}])
def test_step_rows_80_compiles_and_spills_only_in_the_producer(tmp_path, monkeypatch, params):
    """168 registers at entry, setmaxnreg 24 / 240 (FA4's split: the consumers hold S^T 40 + dP^T 40 + dK 64 +
    dV 64 at the peak; at 232 ptxas spilled and serialized), no serialized wgmma of any kind; the only local-memory
    accesses sit in the producer / writer branch, after its setmaxnreg.dec (its walk's division by 80 at 24
    registers), none in the consumers'. The products: S^T, dP^T as 64x80, dQ^T as 64x80 with A transposed and B
    K-major, dV, dK as 64x128 from registers; dS stored by stmatrix .trans."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    res = compile_source(rendered_source(variant("v", params={"step_rows": 80, **params}), tmp_path))
    entry = res.report["v_w1_main"]
    assert entry["registers"] == 168, entry
    assert ptxas_problems(res.output) == [] and serialized(res.output) == [] and res.serialized == []
    main = sass_function(dump_sass(res.output), "v_w1_main")
    names = sass_names(main)
    ops = sass_ops(main)
    regs = [(i, op, args.replace(" ", "").split(",")[-1].rstrip(";")) for i, (op, args) in enumerate(ops)
            if op.startswith("USETMAXREG")]
    assert [(op, imm) for _, op, imm in regs] == [("USETMAXREG.TRY_ALLOC.CTAPOOL", "0xf0"),
                                                  ("USETMAXREG.DEALLOC.CTAPOOL", "0x18")], "setmaxnreg 240 / 24"
    # ptxas lays the consumers' branch out from the inc to the dec, the producer's after the dec (the order is
    # asserted above): no local memory in the first
    alloc, dealloc = regs[0][0], regs[1][0]
    assert not [n for n in names[alloc:dealloc] if n.startswith(("STL", "LDL"))], "the consumers do not spill"
    assert [n for n in names[dealloc:] if n.startswith(("STL", "LDL"))], "the producer's spill this test documents"
    wide = [args for op, args in ops if op.startswith("HGMMA.64x80x16")]
    assert len(wide) == 3 * 8, "S^T, dP^T, dQ^T: 8 k16 steps each"
    assert sum("tnspA" in a for a in wide) == 8 and not any("tnspB" in a for a in wide), "dQ^T: A (K) M-major, B K-major"
    assert sum(op.startswith("HGMMA.64x128x16") for op in names) == 2 * 5, "dV, dK over 80 queries"
    assert names.count("STSM.16.MT88.4") == 5 and "STSM.16.M88.4" not in names, "dS by stmatrix .trans"


DQ_RUN = r"""
#include <cstdio>
#include <cstdlib>
#include "SOURCE"
namespace wg = tsgen::attention_bwd::wgmma;
using C = MODULE::Config;
int main(int argc, char** argv) {
  const uint32_t q_len = atoi(argv[1]), batch = 2;
  if (q_len == 0) {  // ds_wide_offset over a buffer
    for (uint32_t cw = 0; cw < 2; ++cw)
      for (uint32_t q = 0; q < 80; ++q)
        for (uint32_t u = 0; u < 8; ++u) printf("%u %u %u %u\n", cw, q, u, wg::ds_wide_offset(cw, q, u));
    return 0;
  }
  tsgen::attention_bwd::Problem p{};
  p.q_len = q_len, p.batch = batch;
  p.dq_accum = nullptr;
  for (uint32_t b = 0; b < batch; ++b)
    for (uint32_t h = 0; h < (uint32_t)C::HEADS; ++h)
      for (uint32_t r0 = 0; r0 < q_len; r0 += 80) {
        const uint32_t r1 = r0 + 80 < q_len ? r0 + 80 : q_len;
        for (uint32_t cw = 0; cw < 2; ++cw)
          for (uint32_t run = 0; run < 2; ++run) {
            float* dst = nullptr;
            uint32_t from = 0;
            const uint32_t n = wg::dq_run<C>(p, b, h, r0, r1, cw, run, dst, from);
            printf("%u %u %u %u %u %u %lld %u\n", b, h, r0, cw, run, n, (long long)(dst - (float*)nullptr), from);
          }
      }
  return 0;
}
"""


@needs_nvcc
def test_step_rows_80_dq_runs_and_ds_layout(tmp_path, tiled_offsets):
    """Host-compiled from the header. dq_run: for every step of 80 rows (tails included) and warpgroup, its one or two
    runs put each staged row's 64 floats (staging row i: bytes i x 256, chunk u at u ^ (i % 8)) exactly where
    dq_tiled_offset puts that query row's head-dim columns 64 cw .. 64 cw + 63, every row below q_len once and none
    past it. ds_wide_offset: a bijection of (warpgroup, query, 16-byte unit) onto the 20 KB buffer, query row q of box
    cw at 128 q bytes with the 128B swizzle (unit ^ q % 8: K-major, what sw128_descriptor reads), and a stmatrix
    matrix (8 consecutive queries, one unit) on 32 distinct banks."""
    from conftest import host_program

    # the rendered spec's own Config (3 query heads: the reference's below)
    exe = host_program(variant("dqrun", params={"step_rows": 80, "heads": 3, "kv_heads": 3}), DQ_RUN, tmp_path,
                       "dq_run", "dqrun")

    def run(q_len):
        out = subprocess.run([str(exe), str(q_len)], capture_output=True, text=True, check=True).stdout
        return [tuple(int(x) for x in line.split()) for line in out.splitlines()]

    for q_len in (80, 79, 81, 160, 200, 1000, 4097):
        want = tiled_offsets(2, 3, q_len, 128)
        seen = np.zeros(want.shape, dtype=np.int64)
        for b, h, r0, cw, run_, n, dst, start in run(q_len):
            assert start % 256 == 0 and dst % 4 == 0  # dst in floats: 16-byte aligned
            for j in range(n):
                i = start // 256 + j  # the staging row: query r0 + i
                r = r0 + i
                assert r < q_len
                for col in range(64):
                    x = (((col // 8) ^ (i % 8)) * 8) + col % 8  # staged float of row i
                    assert dst + j * 64 + x == want[b, h, r, 64 * cw + col], (q_len, b, h, r0, cw, run_, j, col)
                    seen[b, h, r, 64 * cw + col] += 1
        assert (seen == 1).all(), q_len
    rows = run(0)
    at = {(cw, q, u): off for cw, q, u, off in rows}
    assert sorted(at.values()) == list(range(0, 2 * 80 * 128, 16))
    assert all(off == cw * 80 * 128 + q * 128 + ((u ^ (q % 8)) << 4) for (cw, q, u), off in at.items())
    for cw in range(2):
        for q0 in range(0, 80, 8):
            for u in range(8):
                banks = {(at[cw, q0 + r, u] // 4 + k) % 32 for r in range(8) for k in range(4)}
                assert len(banks) == 32, (cw, q0, u)


# ---------------------------------------------------------------------------
# params.exp2_fma_every: a share of P^T's exp2 on the FMA pipe
# ---------------------------------------------------------------------------

EXP2_FMA = r"""
#include "SOURCE"
#include <math.h>
#include <stdio.h>
int main() {  // x and exp2_fma(x) as hex floats: a fine grid over the kernel's range, then the special values
  for (int i = -131 * 1024; i <= 2 * 1024; ++i) {
    const float x = i / 1024.f;
    printf("%a %a\n", x, tsgen::attention::exp2_fma(x));
  }
  const float special[] = {-INFINITY, NAN, -1000.f, -127.f, -126.75f, -0.5f, 0.5f, 1e-7f, -1e-7f};
  for (float x : special) printf("%a %a\n", x, tsgen::attention::exp2_fma(x));
}
"""


@needs_nvcc
def test_exp2_fma_is_within_its_bound_and_zero_where_mufu_flushes(tmp_path):
    """attention::exp2_fma, host-compiled from the header: relative error at most 1.1e-4 of 2^x over [-125, 2] (its
    comment's 1.02e-4; bf16 rounds P by up to 3.9e-3), exact powers of two at the integers (f = 0), exactly 0 at
    x <= -127 and -inf (where ex2.approx.ftz gives 0), and nothing negative, infinite or NaN anywhere: a NaN gives 0
    (ex2.approx gives NaN), so a NaN score moved to the FMA pipe drops out of P instead of spreading (documented)."""
    from conftest import host_program

    exe = host_program(variant("v"), EXP2_FMA, tmp_path, "exp2_fma")
    rows = [line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                    check=True).stdout.splitlines()]
    x = np.array([float.fromhex(a) if a not in ("-inf", "nan") else float(a) for a, _ in rows])
    y = np.array([float.fromhex(b) for _, b in rows])
    assert np.isfinite(y).all() and (y >= 0).all()
    grid = np.isfinite(x) & (x >= -125) & (x <= 2)
    rel = np.abs(y[grid] - np.exp2(x[grid])) / np.exp2(x[grid])
    assert rel.max() <= 1.1e-4, rel.max()
    whole = grid & (x == np.round(x))
    assert (y[whole] == np.exp2(x[whole])).all(), "2^j exact"
    assert (y[~np.isfinite(x) | (x <= -127)] == 0).all()
    tiny = (x > -127) & (x < -125)
    assert (y[tiny] <= 2.0 ** -125).all()


def test_exp2_fma_every_renders_only_where_set_and_is_refused_elsewhere(tmp_path):
    """Unset in every shipped spec but those that name it; set, its Config constant; refused with mma_sync and out
    of 2..16, by name."""
    from tsgen.spec import SpecError

    fam = get_family("attention_backward")
    assert "EXP2_FMA_EVERY" not in rendered_source(variant("v"), tmp_path).read_text()
    on = variant("e2", params={"exp2_fma_every": 2})
    assert fam.constants(on.model)["EXP2_FMA_EVERY"] == 2 and fam.check(on.model) == []
    assert "static constexpr int EXP2_FMA_EVERY = e2::EXP2_FMA_EVERY;" in rendered_source(on, tmp_path).read_text()
    spec = on.model
    bad = spec.model_copy(update={"params": spec.params.model_copy(update={"impl": "mma_sync", "tail_split": None})})
    assert ("params", "exp2_fma_every") in [w for w, _ in fam.check(bad)]
    for n in (0, 1, 17):
        with pytest.raises(SpecError, match="exp2_fma_every"):
            variant("v", params={"exp2_fma_every": n})
    # past a step's column groups (8 in 64-row steps, 16 in 128-row ones): nothing would move
    with pytest.raises(SpecError, match="8 column groups"):
        variant("v", params={"exp2_fma_every": 9})
    assert fam.check(variant("v", params={"exp2_fma_every": 16, "head_dim": 64, "step_rows": 128}).model) == []


@needs_sass
@pytest.mark.parametrize("head_dim,every", [(64, 2), exhaustive(128, 4)])
def test_exp2_fma_every_moves_that_share_of_the_exponentials_off_mufu(tmp_path, monkeypatch, head_dim, every):
    """params.exp2_fma_every N: the main kernel's MUFU.EX2 are (N - 1) / N of the default's, and it compiles as the
    default does (168 registers at entry, no spills, no serialized wgmma)."""
    monkeypatch.setenv("TSGEN_CACHE_DIR", str(tmp_path / "cache"))
    rows = {"step_rows": 128} if head_dim == 64 else {}
    counts = {}
    for n in (None, every):
        loaded = variant("v", params={"head_dim": head_dim, "exp2_fma_every": n, **rows})
        res = compile_source(rendered_source(loaded, tmp_path))
        entry = res.report["v_w1_main"]
        assert entry["registers"] == 168 and entry["spill_stores"] == entry["spill_loads"] == 0, entry
        assert serialized(res.output) == [] and ptxas_problems(res.output) == []
        counts[n] = sass_names(sass_function(dump_sass(res.output), "v_w1_main")).count("MUFU.EX2")
    assert counts[every] * every == counts[None] * (every - 1), counts
