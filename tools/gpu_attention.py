"""The `attention` op on one GPU: correctness, then tsgen against torch SDPA (flash and cuDNN).

Usage: python tools/gpu_attention.py OUT_DIR [--quick] [--no-bench] [--no-checks] [--variants NAMES|schedule|m192|ilp|rescale]
       (on the lent machines: bash tools/gpu_attention.sh, which sets up the environment)
       python tools/gpu_attention.py OUT_DIR --base-tree .ab/REV7 [--rounds N]: the same-run A/B of a header
       change (the shipped specs built by this checkout and by REV's tsgen and templates, tools/ab_tree.py; every
       correctness check of both, then both timed in interleaved rounds: OUT_DIR/attention_ab.{md,json})

1. Build: every spec variant below is rendered from specs/attention_hd128.yaml and compiled
   (host-launcher shared libraries, in parallel) before anything runs.
2. Correctness, one child process per variant (a trapping kernel ends its CUDA context):
   each case draws fresh random Q, K, V (torch, on the GPU), poisons O and LSE with NaN
   (and a sentinel after their ends) before every call, calls <kernel>_forward on a
   stream of its own, and compares with a float32 torch reference on the upcast inputs
   (TF32 off; the causal mask from the same global positions): ||O - ref|| / ||ref|| <=
   1e-2, |LSE - ref| <= 1e-3 max(1, |ref|) (-inf exactly where a query sees no key), no
   NaN, sentinels intact. Cases: lengths 1, 77, 1000, 4097 (batch 2), Q and KV lengths
   that differ, causal with offsets (bottom-right aligned, shifted, KV starting after
   some queries), zig-zag query layouts, GQA ratios 1, 4, 8, both layouts, fp16, a
   persistent grid, 20 back-to-back calls; the KV-wait variant also runs with K and V
   poisoned until a second stream copies each chunk in (copy engine, after a delay) and
   raises its signal: the kernel must have waited. Also the runtime path (tsgen's harness,
   float64 NumPy reference) and a timeout probe (a signal never raised must trap).
3. Bench, one child: 16K tokens (batch = 16384 / seq), seq 1K .. 32K, 32 query heads over
   32 and 8 KV heads, head dim 64 and 128, causal (half the FLOPs counted) and not:
   tsgen, torch SDPA with the flash backend and with the cuDNN backend, on one stream,
   events recorded on it, median of ITERS calls after warm-up; each tsgen output of the
   timed calls is compared with SDPA's; TFLOP/s above the dense bf16 peak are errors.

Writes OUT_DIR/attention.json and OUT_DIR/attention.md (device, date, command) and prints
the tables last. Exit code 0: every check passed; 1: a check failed or a child crashed.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import ctypes
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # tools/ncu_source.py (also when this file is imported, not run)

from tsgen.env import force_no_multicast  # noqa: E402

force_no_multicast()  # never NVLink multicast, here or in anything this starts

SPEC = ROOT / "specs" / "attention_hd128.yaml"
MAX_REL_ERR = 1e-2
MAX_LSE_ERR = 1e-3
PEAK_TFLOPS = 990.0  # dense bf16 of an H100 / H200 SXM: anything above is a measurement error
ITERS, WARMUP = 10, 3
TOKENS = 16384
SEQS = [1024, 2048, 4096, 8192, 16384, 32768]
CHECK_TIMEOUT_S, BENCH_TIMEOUT_S = 60, 120


def variant(head_dim=128, causal=False, kv_heads=32, **extra) -> dict:
    """Ping-pong on for causal, off otherwise (docs/design/attention.md; results/attention/
    results/attention/2026-11-23-222939d-sdpa-h100.md: off is 4-13% faster non-causal at seq 4K-16K,
    on is 1-26% faster causal at seq <= 4K), params.rescale_at as the shipped specs (4 but at hd 128 causal) and
    params.row_max_chains as they have it (SPEC's 2 not causal, unset causal: until 2026-11-29 the causal variants
    kept SPEC's 2, which no causal spec ships), unless `extra` says otherwise."""
    changes = {"params": {"head_dim": head_dim, "causal": causal, "kv_heads": kv_heads, "pingpong": causal}}
    if causal and head_dim == 128:  # the O rescale's order as the shipped specs: after every exp2 at hd 128 causal
        changes["params"]["rescale_at"] = None  # (SPEC, the hd 128 not-causal spec, ships rescale_at 4 since 2026-11-28)
    if causal:  # the causal specs (specs/attention_hd128_causal_gqa.yaml, attention_hd64_causal.yaml) set no chains
        changes["params"]["row_max_chains"] = None
    for key, value in extra.items():
        if key in ("dtype",):
            changes[key] = value
        elif key == "threads":
            changes["launch"] = {"threads": value}
        else:
            changes["params"][key] = value
    return changes


# name -> changes to specs/attention_hd128.yaml
VARIANTS = {
    f"hd{d}_{'causal' if c else 'full'}_kv{kv}": variant(d, c, kv)
    for d in (64, 128) for c in (False, True) for kv in (32, 8)
}
VARIANTS.update({
    "hd128_causal_kv4_waits": variant(128, True, 4, kv_waits=True),
    "hd128_full_kv4_bhsd": variant(128, False, 4, layout="bhsd"),
    "fp16_hd128_causal_kv32": variant(128, True, 32, dtype="float16"),
    "hd128_full_kv32_pp": variant(128, False, 32, pingpong=True),
    "hd128_full_kv32_n176": variant(128, False, 32, tile={"n": 176}),
    "hd128_full_kv32_n176_pp": variant(128, False, 32, tile={"n": 176}, pingpong=True),
    "hd128_full_kv32_s3": variant(128, False, 32, stages=3),
    "hd128_full_kv32_s3_pp": variant(128, False, 32, stages=3, pingpong=True),
    "hd128_causal_kv32_nopp": variant(128, True, 32, pingpong=False),
    "hd128_causal_kv32_n176": variant(128, True, 32, tile={"n": 176}),
    "hd128_causal_kv32_n176_nopp": variant(128, True, 32, tile={"n": 176}, pingpong=False),
    "hd128_causal_kv32_s3": variant(128, True, 32, stages=3),
    "hd128_causal_kv32_s3_nopp": variant(128, True, 32, stages=3, pingpong=False),
    "hd64_full_kv32_pp": variant(64, False, 32, pingpong=True),
    "hd64_full_kv32_n192s3": variant(64, False, 32, tile={"n": 192}, stages=3),
    "hd64_full_kv32_n192s3_pp": variant(64, False, 32, tile={"n": 192}, stages=3, pingpong=True),
    "hd64_causal_kv32_nopp": variant(64, True, 32, pingpong=False),
    "hd64_causal_kv32_n192s3": variant(64, True, 32, tile={"n": 192}, stages=3),
    "hd64_causal_kv32_n192s3_nopp": variant(64, True, 32, tile={"n": 192}, stages=3, pingpong=False),
    "probe_waits": variant(128, True, 4, kv_waits=True),  # built with a 200 ms timeout
})
# issue 33's schedule variants (docs/design/attention.md, "The persistent schedule"): checked alone by
# `--variants schedule` before suites/attention-variants.yaml times them
VARIANTS.update({
    "hd128_full_kv32_persistent": variant(128, False, 32, schedule="persistent"),
    "hd128_full_kv32_overlap": variant(128, False, 32, schedule="persistent", epilogue_overlap=True),
    "hd128_causal_kv8_persistent": variant(128, True, 8, schedule="persistent"),
    "hd128_causal_kv8_overlap": variant(128, True, 8, schedule="persistent", epilogue_overlap=True,
                                         rescale_skip=True),  # the shipped spec's (since 2026-11-29)
    "hd128_causal_kv4_waits_overlap": variant(128, True, 4, kv_waits=True, schedule="persistent",
                                              epilogue_overlap=True),
    "hd128_full_kv4_bhsd_overlap": variant(128, False, 4, layout="bhsd", schedule="persistent",
                                           epilogue_overlap=True),
    "hd64_causal_kv32_overlap": variant(64, True, 32, schedule="persistent", epilogue_overlap=True),
    "hd64_causal_kv32_overlap_s3": variant(64, True, 32, stages=3, schedule="persistent", epilogue_overlap=True),
    "hd64_causal_kv32_n176s3": variant(64, True, 32, tile={"n": 176}, stages=3),
})
# tile.m 192 at hd 64 (three consumer warpgroups, 512 threads: FlashAttention-3's and -4's hd 64 tile,
# branch i33fwd): checked alone by `--variants m192` before suites/attention-m192.yaml times them
M192 = {"tile": {"m": 192, "n": 128}, "threads": 512}
VARIANTS.update({
    "hd64_full_kv32_m192": variant(64, False, 32, **M192),
    "hd64_full_kv32_pp_m192": variant(64, False, 32, pingpong=True, **M192),
    "hd64_causal_kv8_m192": variant(64, True, 8, **M192),
    "hd64_causal_kv32_overlap_s3_m192": variant(64, True, 32, stages=3, schedule="persistent", epilogue_overlap=True,
                                                **M192),
    "hd64_full_kv4_bhsd_overlap_m192": variant(64, False, 4, layout="bhsd", schedule="persistent",
                                               epilogue_overlap=True, **M192),
})
M192_VARIANTS = [n for n in VARIANTS if n.endswith("_m192")]
# the row max in independent chains then a tree (params.row_max_chains, branch i33ilp): checked alone by
# `--variants ilp` before suites/attention-ilp.yaml times them (tails, masks, bhsd, KV waits: every step kind)
VARIANTS.update({
    "hd128_full_kv32_ilp2": variant(128, False, 32, row_max_chains=2),
    "hd128_full_kv32_ilp8": variant(128, False, 32, row_max_chains=8),
    "hd128_causal_kv8_overlap_ilp2": variant(128, True, 8, schedule="persistent", epilogue_overlap=True,
                                             row_max_chains=2),
    "hd128_causal_kv4_waits_ilp8": variant(128, True, 4, kv_waits=True, row_max_chains=8),
    "hd64_causal_kv32_overlap_s3_ilp4": variant(64, True, 32, stages=3, schedule="persistent", epilogue_overlap=True,
                                                row_max_chains=4),
    "hd128_full_kv4_bhsd_ilp4": variant(128, False, 4, layout="bhsd", row_max_chains=4),
})
ILP_VARIANTS = [n for n in VARIANTS if "_ilp" in n]
# the O rescale inside the exp2 stream (params.rescale_at): checked alone by `--variants rescale` before
# suites/attention-rescale.yaml times them (not causal with and without ping-pong, the shipped causal and hd 64
# schedules, masked steps with KV waits, bhsd GQA)
VARIANTS.update({
    "hd128_full_kv32_rs4": variant(128, False, 32, row_max_chains=2, rescale_at=4),
    "hd128_full_kv32_pp_rs4": variant(128, False, 32, row_max_chains=2, pingpong=True, rescale_at=4),
    "hd128_causal_kv8_overlap_rs4": variant(128, True, 8, schedule="persistent", epilogue_overlap=True, rescale_at=4),
    "hd128_causal_kv4_waits_rs0": variant(128, True, 4, kv_waits=True, rescale_at=0),
    "hd64_causal_kv32_m192_rs4": variant(64, True, 32, tile={"m": 192, "n": 128}, threads=512, schedule="persistent",
                                         epilogue_overlap=True, rescale_at=4),
    "hd128_full_kv4_bhsd_rs8": variant(128, False, 4, layout="bhsd", rescale_at=8),
    "hd128_full_kv32_rs_after": variant(128, False, 32, rescale_at=None),  # the order before, not causal
})
# the shipped causal GQA kernel before params.rescale_skip (6478b2f): O rescaled after every block, to A/B the skip
VARIANTS["hd128_causal_kv8_overlap_noskip"] = variant(128, True, 8, schedule="persistent", epilogue_overlap=True)
RESCALE_VARIANTS = [n for n in VARIANTS if "_rs" in n]
# The two-stream check's negative control: the same module built with every stream on tile counter
# slot 0 (-DTSGEN_ATTENTION_ONE_WORK_SLOT): calls on two streams then share one counter, and the
# check must fail (run_streams_case)
ONE_SLOT = {"hd128_causal_kv8_overlap_one_slot": "hd128_causal_kv8_overlap"}
VARIANTS.update({name: VARIANTS[base] for name, base in ONE_SLOT.items()})
SCHEDULE_VARIANTS = [n for n in VARIANTS if n.endswith(("_persistent", "_overlap", "_overlap_s3"))] + [
    "hd64_causal_kv32_n176s3", *ONE_SLOT]
CHECK_VARIANTS = ["hd128_full_kv32", "hd128_causal_kv8", "hd128_causal_kv4_waits", "hd64_full_kv32",
                  "hd64_causal_kv8", "fp16_hd128_causal_kv32", "hd128_full_kv4_bhsd", "hd128_causal_kv32_nopp",
                  "hd128_full_kv32_n176"]
BENCH_VARIANTS = [f"hd{d}_{c}_kv{kv}" for d in (128, 64) for c in ("full", "causal") for kv in (32, 8)]
TUNE_VARIANTS = [n for n in VARIANTS if n.startswith(("hd128_full_kv32_", "hd128_causal_kv32_", "hd64_full_kv32_",
                                                       "hd64_causal_kv32_"))
                 and n not in SCHEDULE_VARIANTS and n not in M192_VARIANTS and n not in ILP_VARIANTS
                 and n not in RESCALE_VARIANTS]  # benched at TUNE_SEQS (the schedule's: the suite's)
TUNE_SEQS = {128: SEQS, 64: [8192, 16384]}  # by head dim


# ---------------------------------------------------------------------------
# Specs and modules
# ---------------------------------------------------------------------------


def variant_spec(name: str, timeout_ms: int | None = 3000):
    """specs/attention_hd128.yaml with VARIANTS[name] (and the timeout) applied, named att_NAME
    (tsgen.spec.spec_variant: validated as a spec file is)."""
    from tsgen.spec import load_spec, merge, spec_variant

    updates = merge(VARIANTS[name], {"name": f"att_{name}"})
    if timeout_ms is not None:
        updates = merge(updates, {"sync": {"timeout_ms": timeout_ms}})
    return spec_variant(load_spec(SPEC), updates)


def build_loaded(out: Path, loaded, extra: list[str] | None = None) -> dict:
    """Render a loaded spec into OUT/build/generated and compile its host-launcher library (with nvcc
    flags `extra`): {"manifest", "library", "softmax_scale"} (also tools/gpu_attention_bwd.py's)."""
    from tsgen.render import render, write_if_different
    from tsgen.toolchain import compile_source

    rendered = render(loaded, base=ROOT)
    gen = out / "build" / "generated"
    for file, text in rendered.files().items():
        write_if_different(gen / file, text)
    lib = compile_source(gen / f"{rendered.name}.cu", mode="shared", extra=extra).output
    return {"manifest": str(gen / f"{rendered.name}.json"), "library": str(lib),
            "softmax_scale": loaded.model.params.softmax_scale}


def pack_build(out: Path) -> None:
    """At a tool's exit (registered by its main, never a child's): OUT/build (the rendered sources and
    manifests, one file each, dozens) packed into OUT/build_sources.tgz and removed, so that a device
    call's $OUT brings back the reports and their JSON (a call returns a bounded number of files; the
    libraries live in the compile cache, not under OUT)."""
    import shutil
    import tarfile

    if not (out / "build").is_dir():
        return
    with tarfile.open(out / "build_sources.tgz", "w:gz") as tar:
        tar.add(out / "build", arcname="build")
    shutil.rmtree(out / "build")


def build_all(jobs: dict, workers: int = 16) -> tuple[dict[str, dict], dict[str, str]]:
    """Every job (name -> a call returning its build dict) on a pool of threads (nvcc runs in child processes):
    ({name: build}, {name: the end of its error})."""
    builds, errors = {}, {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, os.cpu_count() or 4)) as pool:
        futures = {pool.submit(job): name for name, job in jobs.items()}
        for fut in concurrent.futures.as_completed(futures):
            try:
                builds[futures[fut]] = fut.result()
            except Exception as e:  # noqa: BLE001 -- reported, and the run fails
                errors[futures[fut]] = str(e)[-2000:]
    return builds, errors


def build(out: Path, name: str, timeout_ms: int | None = 3000) -> dict:
    """Render and compile variant `name`: {"manifest", "library", "spec", "softmax_scale"} (ONE_SLOT's
    with every stream on one tile counter, and "one_slot": true)."""
    if name in ONE_SLOT:
        return {**build_loaded(out, variant_spec(name, timeout_ms), ["-DTSGEN_ATTENTION_ONE_WORK_SLOT"]),
                "spec": str(SPEC), "one_slot": True}
    return {**build_loaded(out, variant_spec(name, timeout_ms)), "spec": str(SPEC)}


class Entry:
    """A compiled attention module's run-time entry `<kernel>_<ENTRY>` (ctypes, `ARGTYPES`) and the
    shape its manifest's constants fix; the forward's Op below and tools/gpu_attention_bwd.py's."""

    ENTRY = ""
    ARGTYPES: list = []

    def __init__(self, built: dict):
        self.manifest = json.loads(Path(built["manifest"]).read_text())
        c = self.manifest["constants"]
        self.head_dim, self.heads, self.kv_heads = c["HEAD_DIM"], c["HEADS"], c["KV_HEADS"]
        self.causal, self.bhsd = bool(c["CAUSAL"]), bool(c["BHSD"])
        self.dtype = self.manifest["buffers"][1]["dtype"]
        scale = built["softmax_scale"]
        self.scale = scale if scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.fn = getattr(ctypes.CDLL(built["library"]), f"{self.manifest['kernels'][0]['name']}_{self.ENTRY}")
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = self.ARGTYPES

    def check(self, err: int) -> None:
        if err != 0:
            raise RuntimeError(f"{self.manifest['name']}_{self.ENTRY} returned cudaError {err}")


_U64, _I64, _VP = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p


class Op(Entry):
    """One compiled variant, called through <kernel>_forward with torch tensors."""

    ENTRY = "forward"
    ARGTYPES = [_VP] * 5 + [_U64] * 3 + [_I64] * 4 + [_VP, _U64, _U64, ctypes.c_int, _VP]

    def __init__(self, built: dict):
        super().__init__(built)
        c = self.manifest["constants"]
        self.waits = bool(c["KV_WAITS"])
        self.persistent = bool(c.get("PERSISTENT", 0))  # params.schedule: persistent (the tile counter)

    def __call__(self, q, k, v, o, lse, batch, q_len, kv_len, stream, q_offset=0, q_split=None, q_offset2=0,
                 kv_offset=0, signal=None, kv_chunk=0, expected=0, blocks=0):
        err = self.fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), batch, q_len, kv_len,
                      q_offset, q_len if q_split is None else q_split, q_offset2, kv_offset,
                      None if signal is None else signal.data_ptr(), kv_chunk, expected, blocks, stream.cuda_stream)
        self.check(err)


def torch_dtype(torch, name: str):
    return torch.bfloat16 if name == "bfloat16" else torch.float16


def rel_err(torch, out, ref) -> float:
    """||out - ref|| / ||ref|| of a timed output against SDPA's (float32 [B, S, H, D]); an unwritten (NaN-poisoned)
    element counts as 1e4, so a kernel that skipped work fails MAX_REL_ERR."""
    return float(torch.linalg.vector_norm(torch.nan_to_num(out.float(), nan=1e4) - ref) / torch.linalg.vector_norm(ref))


def bench_tensors(torch, op, seq: int):
    """Random Q, K, V and empty O, LSE for `op` at sequence length `seq` over TOKENS tokens
    ([batch, seq, heads, head_dim]; LSE [batch, heads, seq] fp32): (batch, q, k, v, o, lse)."""
    dt = torch_dtype(torch, op.dtype)
    batch = max(1, TOKENS // seq)
    q = torch.randn(batch, seq, op.heads, op.head_dim, device="cuda", dtype=dt)
    k = torch.randn(batch, seq, op.kv_heads, op.head_dim, device="cuda", dtype=dt)
    v = torch.randn(batch, seq, op.kv_heads, op.head_dim, device="cuda", dtype=dt)
    return batch, q, k, v, torch.empty_like(q), torch.empty(batch, op.heads, seq, device="cuda", dtype=torch.float32)


# ---------------------------------------------------------------------------
# Child: correctness of one variant
# ---------------------------------------------------------------------------


def positions(torch, n: int, offset: int = 0, split: int | None = None, offset2: int = 0):
    r = torch.arange(n, device="cuda", dtype=torch.int64)
    s = n if split is None else min(max(split, 0), n)
    return torch.where(r < s, offset + r, offset2 + (r - s))


def reference(torch, q, k, v, scale, causal, qpos, kpos):
    """q [B, Sq, H, D], k, v [B, Skv, Hkv, D] -> O [B, Sq, H, D] and LSE [B, H, Sq], float32."""
    B, Sq, H, D = q.shape
    g = H // k.shape[2]
    o = torch.empty(B, Sq, H, D, device="cuda", dtype=torch.float32)
    lse = torch.empty(B, H, Sq, device="cuda", dtype=torch.float32)
    visible = (kpos[None, :] <= qpos[:, None]) if causal else None
    for b in range(B):
        for h0 in range(0, H, 8):  # 8 heads at a time: S of 8 x 4097^2 floats
            hs = slice(h0, min(h0 + 8, H))
            qb = q[b, :, hs].float().transpose(0, 1)  # [h, Sq, D]
            kb = k[b].float().repeat_interleave(g, dim=1)[:, hs].transpose(0, 1)
            vb = v[b].float().repeat_interleave(g, dim=1)[:, hs].transpose(0, 1)
            s = torch.matmul(qb, kb.transpose(1, 2)) * scale
            if visible is not None:
                s = s.masked_fill(~visible[None], float("-inf"))
            l = torch.logsumexp(s, dim=2)  # -inf where no key is visible
            p = torch.exp(s - torch.where(torch.isinf(l), torch.zeros_like(l), l)[..., None])
            o[b, :, hs] = torch.matmul(p, vb).transpose(0, 1)
            lse[b, hs] = l
    return o, lse


def compare(torch, o, lse, ro, rlse, o_guard, lse_guard) -> dict:
    of = o.float()
    nan = int(torch.isnan(of).sum()) + int(torch.isnan(lse).sum())
    denom = float(torch.linalg.vector_norm(ro))
    err = float(torch.linalg.vector_norm(torch.nan_to_num(of, nan=0.0) - ro)) / max(denom, 1e-30)
    ninf_ref, ninf_got = torch.isneginf(rlse), torch.isneginf(lse)
    inf_mismatch = int((ninf_ref != ninf_got).sum())
    fin = ~ninf_ref & ~ninf_got & ~torch.isnan(lse)
    lse_err = float(((lse - rlse).abs() / rlse.abs().clamp(min=1.0))[fin].max()) if bool(fin.any()) else 0.0
    return {"rel_err": err, "lse_err": lse_err, "nan": nan, "lse_inf_mismatch": inf_mismatch,
            "guard_written": int(o_guard) + int(lse_guard)}


def run_case(torch, op: Op, case: dict, gen) -> dict:
    """One case, `calls` back-to-back calls (fresh inputs, poisoned outputs each time)."""
    B, sq, skv = case["batch"], case["q_len"], case["kv_len"]
    H, Hkv, D = op.heads, op.kv_heads, op.head_dim
    dt = torch_dtype(torch, op.dtype)
    stream = torch.cuda.Stream()
    GUARD = 4096
    worst = {"rel_err": 0.0, "lse_err": 0.0, "nan": 0, "lse_inf_mismatch": 0, "guard_written": 0}
    qpos = positions(torch, sq, case.get("q_offset", 0), case.get("q_split"), case.get("q_offset2", 0))
    kpos = positions(torch, skv, case.get("kv_offset", 0))
    for call in range(case.get("calls", 1)):
        q = torch.randn(B, sq, H, D, device="cuda", generator=gen).to(dt)
        k = torch.randn(B, skv, Hkv, D, device="cuda", generator=gen).to(dt)
        v = torch.randn(B, skv, Hkv, D, device="cuda", generator=gen).to(dt)
        o_buf = torch.full((B * sq * H * D + GUARD,), 1024.0, device="cuda", dtype=dt)
        l_buf = torch.full((B * H * sq + GUARD,), 1024.0, device="cuda", dtype=torch.float32)
        o_buf[: B * sq * H * D] = float("nan")
        l_buf[: B * H * sq] = float("nan")
        # the kernel's layout: bshd as allocated; bhsd: the same values transposed in memory
        qk = [x if not op.bhsd else x.transpose(1, 2).contiguous() for x in (q, k, v)]
        o_view = o_buf[: B * sq * H * D]
        signal = None
        if op.waits and case.get("signals"):
            chunk = case["kv_chunk"]
            signal = torch.full(((skv + chunk - 1) // chunk,), case["expected"] + case.get("extra", 0),
                                device="cuda", dtype=torch.int64)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            op(qk[0], qk[1], qk[2], o_view, l_buf, B, sq, skv, stream, case.get("q_offset", 0), case.get("q_split"),
               case.get("q_offset2", 0), case.get("kv_offset", 0), signal, case.get("kv_chunk", 0),
               case.get("expected", 0), case.get("blocks", 0))
        stream.synchronize()
        o = o_view.view(B, H, sq, D).transpose(1, 2) if op.bhsd else o_view.view(B, sq, H, D)
        lse = l_buf[: B * H * sq].view(B, H, sq)
        ro, rlse = reference(torch, q, k, v, op.scale, op.causal, qpos, kpos)
        r = compare(torch, o, lse, ro, rlse, (o_buf[-GUARD:] != 1024.0).sum(), (l_buf[-GUARD:] != 1024.0).sum())
        for key in worst:
            worst[key] = max(worst[key], r[key])
    worst["pass"] = (worst["rel_err"] <= MAX_REL_ERR and worst["lse_err"] <= MAX_LSE_ERR and worst["nan"] == 0
                     and worst["lse_inf_mismatch"] == 0 and worst["guard_written"] == 0)
    return worst


def run_wait_case(torch, op: Op, gen, calls: int = 2) -> dict:
    """K and V start poisoned; a second stream copies each KV chunk in (copy engine, after a
    ~2 ms dummy copy) and then raises its signal. A kernel that did not wait reads NaN."""
    B, sq, skv, chunk, expected = 1, 1000, 4096, 512, 7
    H, Hkv, D = op.heads, op.kv_heads, op.head_dim
    dt = torch_dtype(torch, op.dtype)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    worst = {"rel_err": 0.0, "lse_err": 0.0, "nan": 0, "lse_inf_mismatch": 0, "guard_written": 0}
    big_src = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
    big_dst = torch.empty_like(big_src)
    raised = torch.full((skv // chunk,), expected, device="cuda", dtype=torch.int64)
    qpos = positions(torch, sq, skv - sq)  # bottom-right: the last 1000 positions
    kpos = positions(torch, skv)
    for call in range(calls):
        q = torch.randn(B, sq, H, D, device="cuda", generator=gen).to(dt)
        k_src = torch.randn(B, skv, Hkv, D, device="cuda", generator=gen).to(dt)
        v_src = torch.randn(B, skv, Hkv, D, device="cuda", generator=gen).to(dt)
        k = torch.full_like(k_src, float("nan"))
        v = torch.full_like(v_src, float("nan"))
        o = torch.full((B, sq, H, D), float("nan"), device="cuda", dtype=dt)
        lse = torch.full((B, H, sq), float("nan"), device="cuda", dtype=torch.float32)
        signal = torch.zeros(skv // chunk, device="cuda", dtype=torch.int64)
        torch.cuda.synchronize()
        with torch.cuda.stream(a):
            # 64 persistent CTAs: SMs stay free, should a copy below need one
            op(q, k, v, o, lse, B, sq, skv, a, skv - sq, None, 0, 0, signal, chunk, expected, blocks=64)
        with torch.cuda.stream(b):
            big_dst.copy_(big_src)  # ~1 ms of copy engine before the first chunk lands
            for c in reversed(range(skv // chunk)):
                k[0, c * chunk:(c + 1) * chunk].copy_(k_src[0, c * chunk:(c + 1) * chunk])
                v[0, c * chunk:(c + 1) * chunk].copy_(v_src[0, c * chunk:(c + 1) * chunk])
                signal[c:c + 1].copy_(raised[c:c + 1])
        torch.cuda.synchronize()
        ro, rlse = reference(torch, q, k_src, v_src, op.scale, op.causal, qpos, kpos)
        r = compare(torch, o, lse, ro, rlse, 0, 0)
        for key in worst:
            worst[key] = max(worst[key], r[key])
    worst["pass"] = (worst["rel_err"] <= MAX_REL_ERR and worst["lse_err"] <= MAX_LSE_ERR and worst["nan"] == 0
                     and worst["lse_inf_mismatch"] == 0)
    return worst


def run_graph_case(torch, op: Op, gen, replays: int = 3, B: int = 2, n: int = 4097) -> dict:
    """One call captured in a CUDA graph (after a plain warm-up call), replayed `replays` times,
    each with fresh inputs copied into the captured buffers and poisoned outputs: a kernel whose
    state (the persistent schedule's tile counter) is not back at its start after a call fails."""
    H, Hkv, D = op.heads, op.kv_heads, op.head_dim
    dt = torch_dtype(torch, op.dtype)
    stream = torch.cuda.Stream()
    q = torch.empty(B, n, H, D, device="cuda", dtype=dt)
    k = torch.empty(B, n, Hkv, D, device="cuda", dtype=dt)
    v = torch.empty_like(k)
    o = torch.empty(B, n, H, D, device="cuda", dtype=dt)
    lse = torch.empty(B, H, n, device="cuda", dtype=torch.float32)
    bufs = [x if not op.bhsd else torch.empty_like(x.transpose(1, 2).contiguous()) for x in (q, k, v, o)]

    def call():
        op(bufs[0], bufs[1], bufs[2], bufs[3], lse, B, n, n, stream)

    with torch.cuda.stream(stream):
        call()  # the launcher's one-time set-up (shared-memory opt-in, counter address) outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    worst = {"rel_err": 0.0, "lse_err": 0.0, "nan": 0, "lse_inf_mismatch": 0, "guard_written": 0}
    pos = positions(torch, n)
    for _ in range(replays):
        fresh = [torch.randn(x.shape, device="cuda", generator=gen).to(dt) for x in (q, k, v)]
        for dst, src in zip(bufs[:3], fresh):
            dst.copy_(src if not op.bhsd else src.transpose(1, 2).contiguous())
        bufs[3].fill_(float("nan"))
        lse.fill_(float("nan"))
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        got = bufs[3].transpose(1, 2) if op.bhsd else bufs[3]
        ro, rlse = reference(torch, fresh[0], fresh[1], fresh[2], op.scale, op.causal, pos, pos)
        r = compare(torch, got, lse, ro, rlse, 0, 0)
        for key in worst:
            worst[key] = max(worst[key], r[key])
    worst["pass"] = (worst["rel_err"] <= MAX_REL_ERR and worst["lse_err"] <= MAX_LSE_ERR and worst["nan"] == 0
                     and worst["lse_inf_mismatch"] == 0)
    return worst


def run_streams_case(torch, op: Op, gen, rounds: int = 8, B: int = 2, n: int = 4097, blocks: int = 66) -> dict:
    """Two streams, each with its own inputs and outputs, calling the module `rounds` times each with
    no host sync between them, `blocks` CTAs a call (half the SMs: both calls resident at once, so
    they overlap): each stream's calls take tiles from their own counter (tsgen::attention::work_slot).
    Every stream's last output checked; with one shared counter a call's tiles go to the other's."""
    H, Hkv, D = op.heads, op.kv_heads, op.head_dim
    dt = torch_dtype(torch, op.dtype)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    sets = []
    for _ in streams:
        q, k, v = (torch.randn(B, n, h, D, device="cuda", generator=gen).to(dt) for h in (H, Hkv, Hkv))
        qk = [x if not op.bhsd else x.transpose(1, 2).contiguous() for x in (q, k, v)]
        o = torch.full((B * n * H * D,), float("nan"), device="cuda", dtype=dt)
        lse = torch.full((B * H * n,), float("nan"), device="cuda", dtype=torch.float32)
        sets.append((q, k, v, qk, o, lse))
    for s, (_, _, _, qk, o, lse) in zip(streams, sets):  # the launchers' one-time set-up, apart
        with torch.cuda.stream(s):
            op(qk[0], qk[1], qk[2], o, lse, B, n, n, s, blocks=blocks)
    torch.cuda.synchronize()
    for _ in range(rounds):
        torch.cuda.synchronize()  # the last round's calls done before their outputs are poisoned again
        for _, _, _, _, o, lse in sets:
            o.fill_(float("nan"))
            lse.fill_(float("nan"))
        torch.cuda.synchronize()
        for s, (_, _, _, qk, o, lse) in zip(streams, sets):
            with torch.cuda.stream(s):
                op(qk[0], qk[1], qk[2], o, lse, B, n, n, s, blocks=blocks)
    torch.cuda.synchronize()
    worst = {"rel_err": 0.0, "lse_err": 0.0, "nan": 0, "lse_inf_mismatch": 0, "guard_written": 0}
    pos = positions(torch, n)
    for q, k, v, _, o, lse in sets:
        got = o.view(B, H, n, D).transpose(1, 2) if op.bhsd else o.view(B, n, H, D)
        ro, rlse = reference(torch, q, k, v, op.scale, op.causal, pos, pos)
        r = compare(torch, got, lse.view(B, H, n), ro, rlse, 0, 0)
        for key in worst:
            worst[key] = max(worst[key], r[key])
    worst["pass"] = (worst["rel_err"] <= MAX_REL_ERR and worst["lse_err"] <= MAX_LSE_ERR and worst["nan"] == 0
                     and worst["lse_inf_mismatch"] == 0)
    return worst


def cases_for(op: Op, quick: bool) -> list[dict]:
    cases = []
    lengths = [1, 77, 1000, 4097] if not quick else [77, 4097]
    for n in lengths:
        cases.append({"name": f"seq {n}", "batch": 2, "q_len": n, "kv_len": n})
    cases.append({"name": "q 77 / kv 1000", "batch": 2, "q_len": 77, "kv_len": 1000})
    cases.append({"name": "q 1000 / kv 77", "batch": 2, "q_len": 1000, "kv_len": 77})
    cases.append({"name": "seq 1000 x 20 calls", "batch": 1, "q_len": 1000, "kv_len": 1000, "calls": 20})
    cases.append({"name": "seq 4097 persistent 132", "batch": 2, "q_len": 4097, "kv_len": 4097, "blocks": 132})
    if op.causal:
        cases += [
            {"name": "q 300 at 3797 / kv 4097 (bottom-right)", "batch": 1, "q_len": 300, "kv_len": 4097,
             "q_offset": 3797},
            {"name": "q 1000 at 500 / kv 1000 at 700 (rows see no key)", "batch": 2, "q_len": 1000,
             "kv_len": 1000, "q_offset": 500, "kv_offset": 700},
            {"name": "q 640 at 1280 / kv 2048 at 0", "batch": 1, "q_len": 640, "kv_len": 2048, "q_offset": 1280},
            {"name": "zig-zag P=4 rank 1, chunk 300", "batch": 2, "q_len": 600, "kv_len": 2400,
             "q_offset": 300, "q_split": 300, "q_offset2": 1800},
            {"name": "zig-zag P=2 rank 0, chunk 512", "batch": 1, "q_len": 1024, "kv_len": 2048,
             "q_offset": 0, "q_split": 512, "q_offset2": 1536},
            {"name": "zig-zag P=8 rank 3, chunk 256, persistent 100", "batch": 1, "q_len": 512, "kv_len": 4096,
             "q_offset": 768, "q_split": 256, "q_offset2": 3072, "blocks": 100},
        ]
    if op.waits:
        cases += [
            {"name": "signals raised (== expected), chunk 512", "batch": 1, "q_len": 1000, "kv_len": 4096,
             "q_offset": 3096, "signals": True, "kv_chunk": 512, "expected": 5},
            {"name": "signals raised (> expected), chunk 300", "batch": 2, "q_len": 600, "kv_len": 2400,
             "q_offset": 300, "q_split": 300, "q_offset2": 1800, "signals": True, "kv_chunk": 300, "expected": 5,
             "extra": 3},
        ]
    return cases


def failed_row(e: Exception) -> dict:
    """The row of a case that raised (a launch error; a trap ends the child instead)."""
    return {"rel_err": float("nan"), "lse_err": float("nan"), "nan": -1, "lse_inf_mismatch": -1, "guard_written": -1,
            "pass": False, "error": f"{type(e).__name__}: {e}"[:300]}


def check_variant(built: dict, quick: bool, echo=print) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    op = Op(built)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    rows, ok = [], True
    for case in cases_for(op, quick):
        t0 = time.perf_counter()
        try:
            r = run_case(torch, op, case, gen)
        except Exception as e:  # noqa: BLE001 -- a launch error (a trap ends the child instead)
            r = failed_row(e)
        r.update(case=case["name"], calls=case.get("calls", 1), seconds=round(time.perf_counter() - t0, 2))
        rows.append(r)
        ok &= r["pass"]
        echo(f"  {case['name']}: {'PASS' if r['pass'] else 'FAIL'} rel err {r['rel_err']:.2e}, lse err "
             f"{r['lse_err']:.1e}, nan {r['nan']}, -inf mismatch {r['lse_inf_mismatch']}, guard {r['guard_written']}"
             + (f" {r['error']}" if "error" in r else ""), flush=True)

    def extra(label: str, run, case: str, calls: int, control: bool = False) -> None:
        """One case beyond cases_for's: its row (an exception is its failure), its echo line. `control`:
        a negative control, passing where the case fails by wrong or unwritten output (not an error)."""
        nonlocal ok
        t0 = time.perf_counter()
        try:
            r = run(torch, op, gen)
        except Exception as e:  # noqa: BLE001
            r = failed_row(e)
        if control:
            caught = "error" not in r and not r["pass"]
            r["pass"], r["caught"] = caught, caught
        r.update(case=case, calls=calls, seconds=round(time.perf_counter() - t0, 2))
        rows.append(r)
        ok &= r["pass"]
        echo(f"  {label}: {'PASS' if r['pass'] else 'FAIL'} rel err {r['rel_err']:.2e}, nan {r['nan']}"
             + (f" {r['error']}" if "error" in r else ""), flush=True)

    if op.persistent:  # the tile counter across CUDA graph replays
        extra("graph replays", run_graph_case, "seq 4097 batch 2, one call in a CUDA graph replayed 3 times", 3)
        control = bool(built.get("one_slot"))  # one counter for both streams: the check must fail
        extra("two streams" + (" (control: one counter)" if control else ""), run_streams_case,
              "seq 4097 batch 2, 8 rounds on two streams at once, 66 CTAs a call"
              + (" (negative control: one tile counter for both, must fail)" if control else ""), 16, control)
    if op.waits:
        extra("waits", run_wait_case, "K, V poisoned until a second stream copies each chunk and raises its signal", 2)
    return {"pass": ok, "rows": rows}


def timeout_probe(built: dict) -> dict:
    """A signal that is never raised: the kernel must trap after its 200 ms timeout."""
    import torch

    op = Op(built)
    dt = torch_dtype(torch, op.dtype)
    q = torch.randn(1, 256, op.heads, op.head_dim, device="cuda").to(dt)
    k = torch.randn(1, 1024, op.kv_heads, op.head_dim, device="cuda").to(dt)
    o = torch.empty_like(q)
    lse = torch.empty(1, op.heads, 256, device="cuda")
    signal = torch.zeros(2, device="cuda", dtype=torch.int64)
    s = torch.cuda.Stream()
    t0 = time.perf_counter()
    with torch.cuda.stream(s):
        op(q, k, k, o, lse, 1, 256, 1024, s, 768, None, 0, 0, signal, 512, 1)
    try:
        s.synchronize()
        return {"pass": False, "error": "returned without an error", "seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 -- the trap surfaces as a CUDA error
        return {"pass": True, "error": str(e).splitlines()[0][:200], "seconds": round(time.perf_counter() - t0, 2)}


def one_shape(built: dict, seq: int = 8192, calls: int = 3, baseline: str | None = None) -> dict:
    """`calls` calls at seq 8K, batch 2 (for ncu: --launch-skip 1 --launch-count 1), tsgen's, or with baseline
    "fa4" FlashAttention-4's forward (flash_attn.cute.flash_attn_func) on the same tensors ([batch, seq, heads,
    head_dim]: its own layout), the same causal flag and scale."""
    import torch

    op = Op(built)
    batch, q, k, v, o, lse = bench_tensors(torch, op, seq)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    if baseline == "fa4":
        from tsgen.bench.attention_baselines import fa4_stream, import_fa4

        fa4, why = import_fa4()
        if fa4 is None:
            return {"pass": False, "why": why}
        with fa4_stream(torch, s):
            for _ in range(calls):
                fa4.flash_attn_func(q, k, v, softmax_scale=op.scale, causal=op.causal)
    else:
        for _ in range(calls):
            op(q, k, v, o, lse, batch, seq, seq, s)
    s.synchronize()
    return {"pass": True, "seq": seq, "batch": batch}


# --ncu-source: the forward kernel of each implementation, by a regex over its name (one launch after a warm call)
SOURCE_KERNELS = {"tsgen": r"^att_", "fa4": r"FlashAttentionForward"}


def profile_source(out: Path, name: str, baseline: str | None = None) -> int:
    """ncu's warp-stall sampling per SASS instruction of one launch of variant `name`'s forward kernel (or, with
    baseline fa4, FlashAttention-4's forward on the same tensors) at S 8K after a warm call: OUT/src_<who>_<variant>
    .{ncu-rep,csv,txt} (tools/ncu_source.py: by reason, the hottest instructions, the stretches between waits), the
    way tools/gpu_attention_bwd.py --ncu-source compares the backward's step with FA4's. ncu on PATH; the clocks as
    they are (--clock-control none: the lent machines' clocks are never changed)."""
    from ncu_source import page_summary, source_args

    who = baseline or "tsgen"
    built = build(out, name)
    (out / "build" / "builds.json").write_text(json.dumps({name: built}, indent=1))
    stem = out / f"src_{who}_{name}"
    cmd = ["ncu", "--clock-control", "none", "--launch-skip", "1", *source_args(SOURCE_KERNELS[who], stem),
           sys.executable, __file__, str(out), "--child", "one_fa4" if baseline else "one", name]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"ncu: {e}", file=sys.stderr)
        return 1
    result = next((line for line in p.stdout.splitlines() if line.startswith(f"RESULT {name} ")), None)
    if p.returncode != 0 or result is None or not json.loads(result.split(" ", 2)[2]).get("pass"):
        print((p.stdout + p.stderr)[-4000:], file=sys.stderr)
        return p.returncode or 1
    return page_summary(stem, f"{who} {name} S 8192 (forward)")


def runtime_check(spec: str) -> dict:
    """The runtime path: tsgen's harness (World, module.alloc / launch, NumPy float64 reference)."""
    from tsgen.harness import run_test

    lines = []
    ok = run_test(spec, gpus=1, count=1000, iters=3, echo=lines.append)
    return {"pass": bool(ok), "log": lines}


# ---------------------------------------------------------------------------
# Child: timing
# ---------------------------------------------------------------------------


def median_ms(torch, stream, fn, iters: int = ITERS, warmup: int = WARMUP) -> float:
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:  # recorded on `stream`, the one every timed call runs on
            start.record(stream)
            fn()
            end.record(stream)
    events[-1][1].synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def sdpa_call(torch, q, k, v, causal: bool, backend, expand: bool = False):
    """torch SDPA on [B, H, S, D] views of the [B, S, H, D] tensors (equal work); grouped-query
    through enable_gqa, or (expand) K and V repeated to every query head."""
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    g = q.shape[2] // k.shape[2]
    if expand and g > 1:
        k, v = (x.repeat_interleave(g, dim=2) for x in (k, v))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

    return call


def bench(built: dict[str, dict], tune: dict[str, dict], quick: bool, echo=print) -> dict:
    import torch
    from torch.nn.attention import SDPBackend

    from tsgen.ops.attention import flops

    rows = []
    stream = torch.cuda.Stream()
    seqs = [8192, 16384] if quick else SEQS
    for name, b in built.items():
        op = Op(b)
        for seq in seqs:
            try:
                batch, q, k, v, o, lse = bench_tensors(torch, op, seq)
                f = flops(batch, seq, seq, op.heads, op.head_dim, op.causal)
                base = {"variant": name, "head_dim": op.head_dim, "kv_heads": op.kv_heads, "causal": op.causal,
                        "seq": seq, "batch": batch}
                torch.cuda.synchronize()
                impls = [("tsgen", lambda: op(q, k, v, o, lse, batch, seq, seq, stream))]
                if op.head_dim == 128 and seq in (8192, 16384):
                    impls.append(("tsgen persistent 132",
                                  lambda: op(q, k, v, o, lse, batch, seq, seq, stream, blocks=132)))
                ref = None
                for label, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION)):
                    error = None
                    for expand in (False, True):  # enable_gqa first; K, V repeated if the backend refuses
                        if expand and op.heads == op.kv_heads:
                            break
                        try:
                            call = sdpa_call(torch, q, k, v, op.causal, backend, expand)
                            with torch.cuda.stream(stream):
                                out = call()
                            t = median_ms(torch, stream, call)
                            if ref is None:
                                ref = out.transpose(1, 2).float()
                            rows.append({**base, "impl": label, "ms": t, "tflops": f / t / 1e9,
                                         **({"note": "K, V repeated per query head"} if expand else {})})
                            error = None
                            break
                        except Exception as e:  # noqa: BLE001 -- a backend that refuses the shape
                            error = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
                    if error is not None:
                        rows.append({**base, "impl": label, "ms": None, "tflops": None, "error": error})
                for label, fn in impls:
                    with torch.cuda.stream(stream):
                        o.fill_(float("nan"))
                    t = median_ms(torch, stream, fn)
                    stream.synchronize()
                    row = {**base, "impl": label, "ms": t, "tflops": f / t / 1e9}
                    if ref is not None:  # the timed output, against SDPA's
                        row["rel_err_vs_sdpa"] = rel_err(torch, o, ref)
                    row["suspect"] = row["tflops"] > PEAK_TFLOPS or row.get("rel_err_vs_sdpa", 0) > MAX_REL_ERR
                    rows.append(row)
                show = [r for r in rows if r["variant"] == name and r["seq"] == seq]
                print("BENCHROWS " + json.dumps(show), flush=True)  # kept by the parent should a later shape crash
                echo(f"  {name} seq {seq}: " + ", ".join(
                    f"{r['impl']} {r['tflops']:.0f}" if r.get("tflops") else f"{r['impl']} n/a" for r in show))
            except Exception as e:  # noqa: BLE001 -- a launch error; the next shape still runs
                print(f"  {name} seq {seq}: {type(e).__name__}: {e}"[:300], flush=True)
                rows.append({"variant": name, "head_dim": op.head_dim, "kv_heads": op.kv_heads,
                             "causal": op.causal, "seq": seq, "impl": "tsgen", "ms": None,
                             "tflops": None, "error": f"{type(e).__name__}: {e}"[:200]})
            q = k = v = o = lse = ref = None
    for name, b, seq in [(n, b, seq) for n, b in tune.items()
                         for seq in TUNE_SEQS[json.loads(Path(b["manifest"]).read_text())["constants"]["HEAD_DIM"]]]:
        try:
            op = Op(b)
            batch, q, k, v, o, lse = bench_tensors(torch, op, seq)
            torch.cuda.synchronize()  # the inputs, made on the default stream, before `stream` reads them
            with torch.cuda.stream(stream):
                ref = sdpa_call(torch, q, k, v, op.causal, SDPBackend.FLASH_ATTENTION)().transpose(1, 2).float()
                o.fill_(float("nan"))
            t = median_ms(torch, stream, lambda: op(q, k, v, o, lse, batch, seq, seq, stream))
            stream.synchronize()
            err = rel_err(torch, o, ref)
            f = flops(batch, seq, seq, op.heads, op.head_dim, op.causal)
            rows.append({"variant": name, "head_dim": op.head_dim, "kv_heads": op.kv_heads, "causal": op.causal,
                         "seq": seq, "batch": batch, "impl": "tsgen", "ms": t, "tflops": f / t / 1e9, "tune": True,
                         "rel_err_vs_sdpa": err, "suspect": f / t / 1e9 > PEAK_TFLOPS or err > MAX_REL_ERR})
            echo(f"  {name} seq {seq}: {f / t / 1e9:.0f} (rel err vs SDPA {err:.1e})")
        except Exception as e:  # noqa: BLE001
            rows.append({"variant": name, "seq": seq, "impl": "tsgen", "tune": True, "ms": None, "tflops": None,
                         "error": f"{type(e).__name__}: {e}"[:200]})
            echo(f"  {name} seq {seq}: {type(e).__name__}: {e}"[:300])
        print("BENCHROWS " + json.dumps(rows[-1:]), flush=True)
        q = k = v = o = lse = ref = None
    props = torch.cuda.get_device_properties(0)
    return {"rows": rows, "device": props.name, "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version()}


# ---------------------------------------------------------------------------
# --base-tree: the same-run A/B of a header change
# ---------------------------------------------------------------------------

AB_SPECS = ["attention_hd128", "attention_hd128_causal_gqa", "attention_hd64_causal"]  # the shipped forward specs
AB_SEQS = [8192, 16384]
AB_SETTLE = 1  # untimed calls before each sample (tsgen.bench.timing.Sampler settle)


def build_ab(out: Path, spec: str, tree: Path | None = None) -> dict:
    """specs/SPEC.yaml (with the checks' 3 s timeout) rendered and compiled by this checkout, or with `tree` by that
    tree's tsgen and templates (tools/ab_tree.py; its own specs/SPEC.yaml): the build dict of `build`."""
    from tsgen.spec import load_spec, spec_variant

    changes = {"name": f"att_{spec}" + ("_base" if tree else ""), "sync": {"timeout_ms": 3000}}
    if tree is not None:
        import ab_tree

        return {**ab_tree.build(tree, f"specs/{spec}.yaml", changes, out / "build" / "base"), "spec": spec}
    return {**build_loaded(out, spec_variant(load_spec(ROOT / "specs" / f"{spec}.yaml"), changes)), "spec": spec}


def bench_ab(built: dict[str, dict], rounds: int, echo=print) -> dict:
    """Each spec's two builds (NAME: this checkout's, NAME_base: the tree's) at AB_SEQS (ab_shape); a shape that
    raises is a row with its error, and the next one still runs."""
    import torch

    from tsgen.bench.timing import TorchClock

    clock, stream, rows = TorchClock(torch), torch.cuda.Stream(), []
    for spec in (s for s in AB_SPECS if s in built and f"{s}_base" in built):
        ops = {"tsgen": Op(built[spec]), "base": Op(built[f"{spec}_base"])}
        for seq in AB_SEQS:
            try:
                rows.append({"spec": spec, **ab_shape(torch, ops, seq, rounds, stream, clock)})
            except Exception as e:  # noqa: BLE001 -- a launch error or an SDPA refusal
                rows.append({"spec": spec, "seq": seq, "error": f"{type(e).__name__}: {e}"[:300]})
            print("BENCHROWS " + json.dumps(rows[-1:]), flush=True)  # kept by the parent should a later shape crash
            r = rows[-1]
            echo(f"  {spec} seq {seq}: " + (r["error"] if "error" in r else
                 f"tsgen {r['tsgen']['tflops']:.0f} base {r['base']['tflops']:.0f} "
                 f"x {r['x']['ratio']:.3f} ({r['x']['min']:.3f} - {r['x']['max']:.3f})"), flush=True)
            torch.cuda.empty_cache()
    return {"rows": rows, "device": torch.cuda.get_device_properties(0).name, "torch": torch.__version__}


def ab_shape(torch, ops: dict, seq: int, rounds: int, stream, clock) -> dict:
    """Both builds (ops: "tsgen", "base") on the same tensors and stream at `seq`, timed in `rounds` interleaved
    rounds in the balanced order (tsgen.bench.timing); x = base's time over this checkout's, the median of the
    rounds' paired ratios; each build's timed output (poisoned before) against SDPA flash's."""
    from torch.nn.attention import SDPBackend

    from tsgen.bench.timing import Sampler, paired_ratio, time_interleaved
    from tsgen.ops.attention import flops

    op = ops["tsgen"]
    batch, q, k, v, o, lse = bench_tensors(torch, op, seq)
    outs = {impl: (torch.empty_like(o), torch.empty_like(lse)) for impl in ops}
    torch.cuda.synchronize()  # the inputs, made on the default stream, before `stream` reads them
    with torch.cuda.stream(stream):
        ref = sdpa_call(torch, q, k, v, op.causal, SDPBackend.FLASH_ATTENTION)().transpose(1, 2).float()
        for out, _ in outs.values():
            out.fill_(float("nan"))

    def call(impl):
        def enqueue(i, rs):
            ops[impl](q, k, v, outs[impl][0], outs[impl][1], batch, seq, seq, stream)
        return enqueue

    samplers = {impl: Sampler(clock, [0], {0: stream}, call(impl), calls=3, warmup=2, graphs=False, label=impl,
                              settle=AB_SETTLE) for impl in ops}
    timings = time_interleaved(samplers, rounds=rounds)
    stream.synchronize()
    f = flops(batch, seq, seq, op.heads, op.head_dim, op.causal)
    row = {"seq": seq, "batch": batch, "x": paired_ratio(timings["base"].samples_us, timings["tsgen"].samples_us)}
    for impl, tm in timings.items():
        err, tflops = rel_err(torch, outs[impl][0], ref), f / tm.median_us / 1e6
        row[impl] = {"us": tm.median_us, "tflops": tflops, "samples_us": tm.samples_us, "problems": tm.problems,
                     "rel_err_vs_sdpa": err,
                     "suspect": tflops > PEAK_TFLOPS or err > MAX_REL_ERR or bool(tm.problems)}
    return row


def same_shape(here: dict, base: dict) -> str | None:
    """Why two builds of one spec cannot be timed on the same tensors (the constants that fix the tensors' shapes
    and layout, the dtype, the entry's argument list differ between the commits' specs), or None."""
    a, b = (json.loads(Path(x["manifest"]).read_text()) for x in (here, base))
    keys = ("HEAD_DIM", "HEADS", "KV_HEADS", "CAUSAL", "BHSD")
    diff = [f"{k} {b['constants'].get(k)} -> {a['constants'].get(k)}" for k in keys
            if a["constants"].get(k) != b["constants"].get(k)]
    if a["buffers"][1]["dtype"] != b["buffers"][1]["dtype"]:
        diff.append(f"dtype {b['buffers'][1]['dtype']} -> {a['buffers'][1]['dtype']}")
    if [x.get("ctype") for x in a["kernels"][0].get("launcher_args", [])] != \
            [x.get("ctype") for x in b["kernels"][0].get("launcher_args", [])]:
        diff.append("the launcher's arguments")
    return ", ".join(diff) or None


def run_ab(out: Path, tree: Path, rounds: int, deadline: float, command: str) -> int:
    """The --base-tree run: build both sides of every AB_SPECS spec, check each (check_variant, one child per
    build), time them (bench_ab, one child), write OUT/attention_ab.{json,md}. 0: every check passed and every
    timed output matched SDPA's."""
    started = time.perf_counter()
    builds, errors = build_all({**{spec: (lambda s=spec: build_ab(out, s)) for spec in AB_SPECS},
                                **{f"{spec}_base": (lambda s=spec: build_ab(out, s, tree)) for spec in AB_SPECS}})
    for spec in AB_SPECS:  # the two commits' specs must give the same tensors
        if spec in builds and f"{spec}_base" in builds and (why := same_shape(builds[spec], builds[f"{spec}_base"])):
            errors[f"{spec}_base"] = f"not comparable with this checkout's build: {why}"
            del builds[f"{spec}_base"]
    (out / "build" / "builds.json").write_text(json.dumps(builds, indent=1))
    print(f"built {len(builds)} in {time.perf_counter() - started:.0f} s; errors: {errors}", flush=True)
    bench_reserve = 30 + 3 * rounds  # measured 2026-11-28: 10-24 rounds of 6 shapes took under 15 s
    checks = run_children(out, "check", sorted(builds), deadline - bench_reserve, [])
    got, text = child([str(out), "--rounds", str(rounds), "--child", "ab", ",".join(sorted(builds))],
                      deadline - time.perf_counter())
    print("\n".join("  " + l for l in text.strip().splitlines()[-40:] if not l.startswith(("RESULT ", "BENCHROWS "))))
    timing = got.get("ab") or {"rows": [r for l in text.splitlines() if l.startswith("BENCHROWS ")
                                        for r in json.loads(l[len("BENCHROWS "):])],
                               "crashed": text.strip().splitlines()[-20:]}
    ok = (not errors and all(c.get("pass") for c in checks.values()) and "crashed" not in timing
          and all("error" not in r and not r[i]["suspect"] for r in timing["rows"] for i in ("tsgen", "base")))
    from tsgen.bench.results import commit as checkout_commit

    commit = (tree / "COMMIT").read_text().strip() if (tree / "COMMIT").is_file() else "?"
    summary = {"device": timing.get("device", "?"), "torch": timing.get("torch"), "command": command,
               "commit": checkout_commit(),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "base": commit, "rounds": rounds, "settle": AB_SETTLE, "checks": checks, "bench": timing["rows"],
               "bench_crashed": timing.get("crashed"), "build_errors": errors, "all_checks_pass": ok,
               "seconds": round(time.perf_counter() - started, 1)}
    (out / "attention_ab.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown_ab(summary)
    (out / "attention_ab.md").write_text(text)
    print(text)
    return 0 if ok else 1


def markdown_ab(s: dict) -> str:
    lines = [f"# attention forward A/B on one GPU ({s['device']}, {s['date']})", "",
             f"Command: `{s['command']}`", "",
             f"base: the shipped specs rendered and compiled by commit {s['base']}'s tsgen and templates "
             f"(tools/ab_tree.py); tsgen: this checkout's ({s.get('commit', '?')}). "
             "Both on the same tensors and stream, "
             f"{s['rounds']} interleaved rounds in the balanced order, {s['settle']} untimed call(s) before each "
             "sample of 3 calls; x = base's time / tsgen's, the median of the rounds' paired ratios (range).", "",
             "## Correctness", "", "| build | cases | failed | pass |", "|---|---|---|---|"]
    for name, c in sorted(s["checks"].items()):
        rows = c.get("rows", [])
        failed = [r["case"] for r in rows if not r.get("pass")]
        lines.append(f"| {name} | {len(rows)} | {', '.join(failed) or (c.get('crashed') and 'crashed') or '-'} | "
                     f"{'yes' if c.get('pass') else 'NO'} |")
    for name, e in s["build_errors"].items():
        lines.append(f"| {name} | build failed: {e.splitlines()[-1][:200] if e else ''} | | NO |")
    lines += ["", "## Speed (TFLOP/s: 4 b h s^2 d, halved causal)", "",
              "| spec | S | tsgen | base | x (range) | rel err vs SDPA tsgen / base |", "|---|---|---|---|---|---|"]
    for r in s["bench"]:
        if "error" in r:
            lines.append(f"| {r['spec']} | {r['seq']} | | | failed: {r['error']} | |")
            continue
        problems = "; ".join(f"{i}: {p}" for i in ("tsgen", "base") for p in r[i]["problems"])
        lines.append(f"| {r['spec']} | {r['seq']} | {r['tsgen']['tflops']:.0f} | {r['base']['tflops']:.0f} | "
                     f"{r['x']['ratio']:.3f} ({r['x']['min']:.3f} - {r['x']['max']:.3f}) | "
                     f"{r['tsgen']['rel_err_vs_sdpa']:.1e} / {r['base']['rel_err_vs_sdpa']:.1e}"
                     + (f" (problems: {problems})" if problems else "") + " |")
    if s["bench_crashed"]:
        lines += ["", "The bench crashed:", "", "```", *s["bench_crashed"], "```"]
    lines += ["", f"All checks pass: {'yes' if s['all_checks_pass'] else 'NO'} ({s['seconds']} s)", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------


def child(args: list[str], timeout: float) -> tuple[dict[str, dict], str]:
    """Run this script as a child; ({name: result} of the RESULT lines it printed, its output)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5, timeout))
        stdout, text = proc.stdout, proc.stdout + proc.stderr + f"\n(exit code {proc.returncode})"
    except subprocess.TimeoutExpired as e:  # its output comes as bytes, whatever text= says
        parts = [x if isinstance(x, bytes) else x.encode() for x in (e.stdout or b"", e.stderr or b"")]
        stdout = parts[0].decode(errors="replace")
        text = b"".join(parts).decode(errors="replace") + f"\ntimed out after {timeout:.0f} s"
    results = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            name, _, body = line[len("RESULT "):].partition(" ")
            results[name] = json.loads(body)
    return results, text


def run_children(out: Path, kind: str, names: list[str], deadline: float, extra: list[str]) -> dict[str, dict]:
    """Every name in one child, in order; a child that dies (a trapping kernel ends its CUDA
    context) marks the name it was on as crashed and a new child takes the rest."""
    results, left = {}, list(names)
    while left:
        budget = deadline - time.perf_counter()
        if budget < 10:
            for n in left:
                results[n] = {"pass": False, "crashed": ["skipped: out of time"]}
            break
        t0 = time.perf_counter()
        got, text = child([str(out), *extra, "--child", kind, ",".join(left)], budget)
        print(f"{kind} {','.join(left)} ({time.perf_counter() - t0:.0f} s):")
        print("\n".join("  " + l for l in text.strip().splitlines()[-60:] if not l.startswith("RESULT ")))
        results.update(got)
        rest = [n for n in left if n not in got]
        if rest:
            results[rest[0]] = {"pass": False, "crashed": text.strip().splitlines()[-20:]}
            rest = rest[1:]
        left = rest
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--deadline", type=float, default=220, help="seconds for the whole run")
    ap.add_argument("--bench-seconds", type=float, default=90, help="seconds kept for the bench")
    ap.add_argument("--variants", default=None,
                    help="check only these variants (comma-separated names, or `schedule`: SCHEDULE_VARIANTS, `m192`: "
                         "M192_VARIANTS, `ilp`: ILP_VARIANTS, `rescale`: RESCALE_VARIANTS); "
                    "no bench, no runtime check, no timeout probe")
    ap.add_argument("--ncu-source", metavar="VARIANT",
                    help="instead of the run: ncu's warp-stall samples per SASS instruction of one forward launch of "
                    "VARIANT at S 8K (tools/ncu_source.py), OUT/src_<who>_<variant>.{ncu-rep,csv,txt}")
    ap.add_argument("--ncu-baseline", choices=sorted(k for k in SOURCE_KERNELS if k != "tsgen"),
                    help="with --ncu-source: FlashAttention-4's forward kernel on the same tensors instead of tsgen's")
    ap.add_argument("--base-tree", metavar="DIR", type=Path,
                    help="the same-run A/B: AB_SPECS built by this checkout and by DIR's tsgen and templates (python "
                    "tools/ab_tree.py make REV: .ab/REV7), every check of both, then interleaved rounds "
                    "(OUT/attention_ab.{md,json})")
    ap.add_argument("--rounds", type=int, default=10, help="with --base-tree: interleaved rounds")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "ARG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        kind, arg = args.child
        builds = json.loads((out / "build" / "builds.json").read_text())
        for name in arg.split(","):
            if kind == "check":
                print(f"== {name}", flush=True)
                result = check_variant(builds[name], args.quick)
            elif kind == "probe":
                result = timeout_probe(builds[name])
            elif kind in ("one", "one_fa4"):  # a few calls of one shape (under ncu), tsgen's or FA4's
                result = one_shape(builds[name], baseline="fa4" if kind == "one_fa4" else None)
            elif kind == "runtime":
                result = runtime_check(str(ROOT / "specs" / f"{name}.yaml"))
            else:
                continue
            print(f"RESULT {name} " + json.dumps(result), flush=True)
        if kind == "ab":
            print("RESULT ab " + json.dumps(bench_ab(builds, args.rounds)), flush=True)
        if kind == "bench":
            names = arg.split(",")
            result = bench({n: builds[n] for n in names if n in BENCH_VARIANTS},
                           {n: builds[n] for n in names if n in TUNE_VARIANTS}, args.quick)
            print("RESULT bench " + json.dumps(result), flush=True)
        return 0
    atexit.register(pack_build, out)  # the children read OUT/build while the run lasts
    if args.ncu_baseline and not args.ncu_source:
        ap.error("--ncu-baseline: with --ncu-source VARIANT")
    if args.ncu_source and args.base_tree:
        ap.error("--ncu-source and --base-tree: one at a time")
    if args.ncu_source:
        if args.ncu_source not in VARIANTS:
            ap.error(f"--ncu-source: unknown variant {args.ncu_source!r} (known: {', '.join(VARIANTS)})")
        (out / "build").mkdir(parents=True, exist_ok=True)
        return profile_source(out, args.ncu_source, args.ncu_baseline)

    started = time.perf_counter()
    deadline = started + args.deadline
    command = " ".join(["python", "tools/gpu_attention.py", *sys.argv[1:]])
    if args.base_tree:
        if args.rounds < 1:
            ap.error(f"--rounds: at least 1, not {args.rounds}")
        ignored = [flag for flag, on in (("--quick", args.quick), ("--no-bench", args.no_bench),
                                         ("--no-checks", args.no_checks), ("--variants", args.variants)) if on]
        if ignored:
            ap.error(f"--base-tree runs every check of AB_SPECS and the bench: not with {', '.join(ignored)}")
        import ab_tree

        if problem := ab_tree.tree_problem(args.base_tree):
            ap.error(f"--base-tree: {problem}")
        (out / "build").mkdir(parents=True, exist_ok=True)
        return run_ab(out, args.base_tree.resolve(), args.rounds, deadline, command)
    names = sorted(set(CHECK_VARIANTS + BENCH_VARIANTS + TUNE_VARIANTS + ["probe_waits"]))
    only = None
    if args.variants:
        only = {"schedule": SCHEDULE_VARIANTS, "m192": M192_VARIANTS, "ilp": ILP_VARIANTS,
                "rescale": RESCALE_VARIANTS}.get(args.variants) or args.variants.split(",")
        unknown = [n for n in only if n not in VARIANTS]
        if unknown:
            ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
        names, args.no_bench = list(only), True
    builds, build_errors = build_all({n: (lambda n=n: build(out, n, 200 if n == "probe_waits" else 3000))
                                      for n in names})
    (out / "build" / "builds.json").write_text(json.dumps(builds, indent=1))
    print(f"built {len(builds)} variants in {time.perf_counter() - started:.0f} s; errors: {list(build_errors)}")
    for n, e in build_errors.items():
        print(f"  {n}: {e[-600:]}")
    all_ok = not build_errors
    quick = ["--quick"] if args.quick else []
    checks = {}
    if not args.no_checks:
        check_deadline = deadline - (0 if args.no_bench else args.bench_seconds)
        names = [n for n in (only or CHECK_VARIANTS) if n in builds]
        checks.update(run_children(out, "check", names, check_deadline - (0 if only else 25), quick))
        if only is None:
            checks.update(run_children(out, "runtime", ["attention_hd128_causal_gqa"], check_deadline - 12, []))
        if "probe_waits" in builds and only is None:
            probe = run_children(out, "probe", ["probe_waits"], check_deadline, [])
            checks["timeout_probe"] = probe["probe_waits"]
        for n in only or CHECK_VARIANTS:
            checks.setdefault(n, {"pass": False, "crashed": ["not built"]})
        all_ok &= all(c.get("pass") for c in checks.values())
    timing = {"rows": [], "device": "?"}
    if not args.no_bench:
        names = [n for n in BENCH_VARIANTS + TUNE_VARIANTS if n in builds]
        t0 = time.perf_counter()
        got, text = child([str(out), *quick, "--child", "bench", ",".join(names)], deadline - time.perf_counter())
        print(f"bench ({time.perf_counter() - t0:.0f} s):")
        print("\n".join("  " + l for l in text.strip().splitlines()[-60:]
                        if not l.startswith(("RESULT ", "BENCHROWS "))))
        if "bench" in got:
            timing = got["bench"]
        else:  # the rows timed before it crashed or ran out of time
            all_ok = False
            timing["crashed"] = text.strip().splitlines()[-20:]
            timing["rows"] = [r for l in text.splitlines() if l.startswith("BENCHROWS ")
                              for r in json.loads(l[len("BENCHROWS "):])]
    summary = {
        "device": timing.get("device", "?"),
        "torch": timing.get("torch"),
        "cudnn": timing.get("cudnn"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "checks": checks,
        "bench": timing.get("rows", []),
        "bench_crashed": timing.get("crashed"),
        "build_errors": build_errors,
        "all_checks_pass": all_ok,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "attention.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (out / "attention.md").write_text(text)
    print()
    print(text)
    return 0 if all_ok else 1


def markdown(s: dict) -> str:
    lines = [
        "# attention: tsgen vs torch SDPA (flash, cuDNN), forward",
        "",
        f"Device: {s['device']}; torch {s.get('torch')}, cuDNN {s.get('cudnn')}; {s['date']}; `{s['command']}`.",
        f"TFLOP/s = 4 b h s^2 d / t (causal: half); {TOKENS} tokens (batch = {TOKENS} / seq, at least 1), "
        f"32 query heads; median of {ITERS} calls after {WARMUP} warm-up, CUDA events on the kernels' stream.",
        "",
        "| d | kv heads | causal | seq | tsgen | SDPA flash | SDPA cuDNN | tsgen / best | rel err vs SDPA |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [r for r in s["bench"] if not r.get("tune")]
    keys = []
    for r in rows:
        key = (r["head_dim"], r["kv_heads"], r["causal"], r["seq"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        got = {r["impl"]: r for r in rows if (r["head_dim"], r["kv_heads"], r["causal"], r["seq"]) == key}

        def tf(name):
            r = got.get(name)
            return f"{r['tflops']:.0f}" if r and r.get("tflops") else "n/a"

        t = got.get("tsgen")
        best = max([got[n]["tflops"] for n in ("SDPA flash", "SDPA cuDNN") if got.get(n, {}).get("tflops")] or [0])
        ratio = f"{t['tflops'] / best:.2f}" if t and t.get("tflops") and best else ""
        err = f"{t['rel_err_vs_sdpa']:.1e}" if t and "rel_err_vs_sdpa" in t else ""
        flag = " (!)" if t and t.get("suspect") else ""
        lines.append(f"| {key[0]} | {key[1]} | {'yes' if key[2] else 'no'} | {key[3]} | {tf('tsgen')}{flag} | "
                     f"{tf('SDPA flash')} | {tf('SDPA cuDNN')} | {ratio} | {err} |")
    tune = [r for r in s["bench"] if r.get("tune")]
    if tune:
        seqs = sorted({r["seq"] for r in tune})
        lines += ["", "Variants (TFLOP/s of tsgen; (!) above the peak or wrong against SDPA):", "",
                  "| variant | " + " | ".join(str(q) for q in seqs) + " |", "|---" * (len(seqs) + 1) + "|"]
        for name in dict.fromkeys(r["variant"] for r in tune):
            got = {r["seq"]: r for r in tune if r["variant"] == name}
            cells = [("n/a" if got[q].get("tflops") is None else f"{got[q]['tflops']:.0f}"
                      + (" (!)" if got[q].get("suspect") else "")) if q in got else "" for q in seqs]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    extra = [r for r in s["bench"] if not r.get("tune") and r["impl"] not in ("tsgen", "SDPA flash", "SDPA cuDNN")]
    if extra:
        lines += ["", "| variant | impl | seq | TFLOP/s |", "|---|---|---|---|"]
        for r in extra:
            lines.append(f"| {r['variant']} | {r['impl']} | {r['seq']} | "
                         f"{'n/a' if r.get('tflops') is None else format(r['tflops'], '.0f')}"
                         f"{' (!)' if r.get('suspect') else ''} |")
    errors = [r for r in s["bench"] if r.get("error")]
    if errors:
        lines += ["", "Errors (a baseline that refused a shape, or a failed launch): " + "; ".join(
            f"{r['impl']} {r['variant']} s{r['seq']}: {r['error']}" for r in errors[:6])]
    lines += ["", "| correctness | case | calls | rel err | LSE err | NaN | -inf mismatch | guard | result |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, c in s["checks"].items():
        if "crashed" in c:
            why = next((x for x in reversed(c["crashed"]) if "rror" in x or "timed out" in x),
                       c["crashed"][-1] if c["crashed"] else "")
            lines.append(f"| {name} | | | | | | | | CRASHED: {why.strip()[:120]} |")
        elif "rows" in c:
            for r in c["rows"]:
                lines.append(f"| {name} | {r['case']} | {r['calls']} | {r['rel_err']:.1e} | {r['lse_err']:.1e} | "
                             f"{r['nan']} | {r['lse_inf_mismatch']} | {r['guard_written']} | "
                             f"{'PASS' if r['pass'] else 'FAIL'} |")
        else:
            detail = c.get("error") or "; ".join(c.get("log", [])[-2:])
            lines.append(f"| {name} | {detail[:140]} | | | | | | | {'PASS' if c['pass'] else 'FAIL'} |")
    lines += ["", f"All checks: {'PASS' if s['all_checks_pass'] else 'FAIL'} ({s['seconds']} s)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
