// tsgen/ptx.cuh -- hand-written PTX helpers: loads, stores, atomics,
// reductions and fences with their memory-model semantics spelled out.
//
// Hand-written; included by every generated source and by the other tsgen headers.
//
// Everything the tsgen headers declare is in namespace tsgen (this file:
// tsgen::ptx, in scope in all of tsgen); a generated op calls these helpers
// as ptx::... (docs/design/device-code.md).
//
// Rules (after DeepEP's and NCCL's utils):
//   * one `asm volatile` per memory helper, with a "memory" clobber, so the
//     compiler neither drops, merges nor moves memory operations across it
//     (register-only helpers -- lane_id, warp_id, warp votes -- need none);
//   * the name spells out the PTX, op first: op, semantics, scope, state
//     space, type:
//       ld.acquire.sys.global.u64      -> ld_acquire_sys_global_u64
//       atom.relaxed.gpu.global.add.u32 -> atom_add_relaxed_gpu_global_u32
//     The scope is always written out: there is no scope-less name for a
//     strong (relaxed / acquire / release / acq_rel / sc) operation.
//   * weak (plain) ld/st carry no scope: `ld.weak.gpu` does not assemble.
//   * types: u32 = uint32_t, u64 = uint64_t, v4 = uint4 (16 bytes, aligned).
//     Loads take `const T* ptr`, stores `(T* ptr, T value)`, atomics return
//     the old value.
//
// The SASS each group becomes on sm_90a (ptxas 13.0) is noted above the
// group; tests/test_ptx_helpers.py compiles one kernel per helper and checks
// those instructions in the cuobjdump output, so the notes are verified.
//
// Forms that do NOT exist and are therefore absent here:
//   * ld.weak/st.weak with a scope (ptxas: "Modifier '.weak' cannot be
//     combined with modifier '.gpu'");
//   * `atom.load` / `atom.store` style atomics (ptxas: "Unknown modifier
//     '.load'"; use ld.acquire / st.release);
//   * cta-scope atomics / reductions are not provided (nothing needs them).
// Every load/store width x semantics combination asked for does assemble on
// sm_90a, including .v4 with .relaxed / .acquire / .release.
//
// Every helper, greppable (the test checks this table against the
// definitions below, and fails on a name missing from either side):
//
// @helpers-begin
// loads weak:        ld_weak_global_u32  ld_weak_global_u64  ld_weak_global_v4
// loads volatile:    ld_volatile_global_u32  ld_volatile_global_u64  ld_volatile_global_v4
// loads relaxed:     ld_relaxed_cta_global_u32  ld_relaxed_cta_global_u64  ld_relaxed_cta_global_v4
//                    ld_relaxed_gpu_global_u32  ld_relaxed_gpu_global_u64  ld_relaxed_gpu_global_v4
//                    ld_relaxed_sys_global_u32  ld_relaxed_sys_global_u64  ld_relaxed_sys_global_v4
// loads acquire:     ld_acquire_cta_global_u32  ld_acquire_cta_global_u64  ld_acquire_cta_global_v4
//                    ld_acquire_gpu_global_u32  ld_acquire_gpu_global_u64  ld_acquire_gpu_global_v4
//                    ld_acquire_sys_global_u32  ld_acquire_sys_global_u64  ld_acquire_sys_global_v4
// loads nc:          ld_nc_global_u32  ld_nc_global_u64  ld_nc_global_v4
// loads no_allocate: ld_nc_na_global_u32  ld_nc_na_global_u64  ld_nc_na_global_v4
//                    ld_weak_na_global_v4
// stores weak:       st_weak_global_u32  st_weak_global_u64  st_weak_global_v4
// stores volatile:   st_volatile_global_u32  st_volatile_global_u64  st_volatile_global_v4
// stores relaxed:    st_relaxed_cta_global_u32  st_relaxed_cta_global_u64  st_relaxed_cta_global_v4
//                    st_relaxed_gpu_global_u32  st_relaxed_gpu_global_u64  st_relaxed_gpu_global_v4
//                    st_relaxed_sys_global_u32  st_relaxed_sys_global_u64  st_relaxed_sys_global_v4
// stores release:    st_release_cta_global_u32  st_release_cta_global_u64  st_release_cta_global_v4
//                    st_release_gpu_global_u32  st_release_gpu_global_u64  st_release_gpu_global_v4
//                    st_release_sys_global_u32  st_release_sys_global_u64  st_release_sys_global_v4
// stores no_allocate: st_na_global_v4
// atom add:          atom_add_relaxed_gpu_global_u32  atom_add_relaxed_gpu_global_u64
//                    atom_add_relaxed_sys_global_u32  atom_add_relaxed_sys_global_u64
//                    atom_add_acquire_gpu_global_u32  atom_add_acquire_gpu_global_u64
//                    atom_add_acquire_sys_global_u32  atom_add_acquire_sys_global_u64
//                    atom_add_release_gpu_global_u32  atom_add_release_gpu_global_u64
//                    atom_add_release_sys_global_u32  atom_add_release_sys_global_u64
//                    atom_add_acq_rel_gpu_global_u32  atom_add_acq_rel_gpu_global_u64
//                    atom_add_acq_rel_sys_global_u32  atom_add_acq_rel_sys_global_u64
// atom exch:         atom_exch_relaxed_gpu_global_u32  atom_exch_relaxed_gpu_global_u64
//                    atom_exch_relaxed_sys_global_u32  atom_exch_relaxed_sys_global_u64
//                    atom_exch_acquire_gpu_global_u32  atom_exch_acquire_gpu_global_u64
//                    atom_exch_acquire_sys_global_u32  atom_exch_acquire_sys_global_u64
//                    atom_exch_release_gpu_global_u32  atom_exch_release_gpu_global_u64
//                    atom_exch_release_sys_global_u32  atom_exch_release_sys_global_u64
//                    atom_exch_acq_rel_gpu_global_u32  atom_exch_acq_rel_gpu_global_u64
//                    atom_exch_acq_rel_sys_global_u32  atom_exch_acq_rel_sys_global_u64
// atom cas:          atom_cas_relaxed_gpu_global_u32  atom_cas_relaxed_gpu_global_u64
//                    atom_cas_relaxed_sys_global_u32  atom_cas_relaxed_sys_global_u64
//                    atom_cas_acquire_gpu_global_u32  atom_cas_acquire_gpu_global_u64
//                    atom_cas_acquire_sys_global_u32  atom_cas_acquire_sys_global_u64
//                    atom_cas_release_gpu_global_u32  atom_cas_release_gpu_global_u64
//                    atom_cas_release_sys_global_u32  atom_cas_release_sys_global_u64
//                    atom_cas_acq_rel_gpu_global_u32  atom_cas_acq_rel_gpu_global_u64
//                    atom_cas_acq_rel_sys_global_u32  atom_cas_acq_rel_sys_global_u64
// red add:           red_add_relaxed_gpu_global_u32  red_add_relaxed_gpu_global_u64
//                    red_add_relaxed_sys_global_u32  red_add_relaxed_sys_global_u64
//                    red_add_release_gpu_global_u32  red_add_release_gpu_global_u64
//                    red_add_release_sys_global_u32  red_add_release_sys_global_u64
// fences:            fence_acq_rel_cta  fence_acq_rel_gpu  fence_acq_rel_sys
//                    fence_sc_cta  fence_sc_gpu  fence_sc_sys
//                    fence_proxy_async_shared_cta
// warp:              warp_any_sync  warp_all_sync  elect_one_sync  lane_id  warp_id  warpgroup_id
// timer:             globaltimer_ns
// multimem ld_reduce: multimem_ld_reduce_add_relaxed_sys_f32
//                    multimem_ld_reduce_add_relaxed_sys_bf16x2
//                    multimem_ld_reduce_add_relaxed_sys_f16x2
//                    multimem_ld_reduce_add_relaxed_sys_acc_f32_bf16x2
//                    multimem_ld_reduce_add_relaxed_sys_acc_f32_f16x2
//                    multimem_ld_reduce_add_relaxed_sys_v4_f32
//                    multimem_ld_reduce_add_relaxed_sys_v4_bf16x2
//                    multimem_ld_reduce_add_relaxed_sys_acc_f32_v4_bf16x2
// multimem st:       multimem_st_relaxed_sys_f32  multimem_st_relaxed_sys_bf16x2
//                    multimem_st_relaxed_sys_v4_f32  multimem_st_relaxed_sys_v4_bf16x2
// multimem red:      multimem_red_add_relaxed_sys_u32  multimem_red_add_release_sys_u32
// @helpers-end
#ifndef TSGEN_PTX_CUH
#define TSGEN_PTX_CUH

#include <cuda_runtime.h>
#include <stdint.h>

namespace tsgen {
namespace ptx {

// ---------------------------------------------------------------------------
// Stamping macros. Each invocation below spells out the full helper name and
// the full PTX opcode, so both can be grepped; the macros are #undef'd at the
// end of the file.
// ---------------------------------------------------------------------------
#define TSGEN_LD_U32(NAME, PTX)                                                   \
  static __device__ __forceinline__ uint32_t NAME(const uint32_t* ptr) {         \
    uint32_t v;                                                                   \
    asm volatile(PTX " %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");               \
    return v;                                                                     \
  }
#define TSGEN_LD_U64(NAME, PTX)                                                   \
  static __device__ __forceinline__ uint64_t NAME(const uint64_t* ptr) {         \
    uint64_t v;                                                                   \
    asm volatile(PTX " %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");               \
    return v;                                                                     \
  }
#define TSGEN_LD_V4(NAME, PTX)                                                    \
  static __device__ __forceinline__ uint4 NAME(const uint4* ptr) {               \
    uint4 v;                                                                      \
    asm volatile(PTX " {%0, %1, %2, %3}, [%4];"                                   \
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                     \
                 : "l"(ptr)                                                       \
                 : "memory");                                                     \
    return v;                                                                     \
  }
#define TSGEN_ST_U32(NAME, PTX)                                                   \
  static __device__ __forceinline__ void NAME(uint32_t* ptr, uint32_t value) {   \
    asm volatile(PTX " [%0], %1;" ::"l"(ptr), "r"(value) : "memory");             \
  }
#define TSGEN_ST_U64(NAME, PTX)                                                   \
  static __device__ __forceinline__ void NAME(uint64_t* ptr, uint64_t value) {   \
    asm volatile(PTX " [%0], %1;" ::"l"(ptr), "l"(value) : "memory");             \
  }
#define TSGEN_ST_V4(NAME, PTX)                                                    \
  static __device__ __forceinline__ void NAME(uint4* ptr, uint4 value) {         \
    asm volatile(PTX " [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(value.x),         \
                 "r"(value.y), "r"(value.z), "r"(value.w)                         \
                 : "memory");                                                     \
  }
// atom add / exch: old = op(*ptr, value)
#define TSGEN_ATOM_U32(NAME, PTX)                                                 \
  static __device__ __forceinline__ uint32_t NAME(uint32_t* ptr, uint32_t value) { \
    uint32_t old;                                                                 \
    asm volatile(PTX " %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory"); \
    return old;                                                                   \
  }
#define TSGEN_ATOM_U64(NAME, PTX)                                                 \
  static __device__ __forceinline__ uint64_t NAME(uint64_t* ptr, uint64_t value) { \
    uint64_t old;                                                                 \
    asm volatile(PTX " %0, [%1], %2;" : "=l"(old) : "l"(ptr), "l"(value) : "memory"); \
    return old;                                                                   \
  }
// atom cas: old = *ptr; if (old == compare) *ptr = value; return old
#define TSGEN_CAS_U32(NAME, PTX)                                                  \
  static __device__ __forceinline__ uint32_t NAME(uint32_t* ptr, uint32_t compare, \
                                                  uint32_t value) {               \
    uint32_t old;                                                                 \
    asm volatile(PTX " %0, [%1], %2, %3;"                                         \
                 : "=r"(old)                                                      \
                 : "l"(ptr), "r"(compare), "r"(value)                             \
                 : "memory");                                                     \
    return old;                                                                   \
  }
#define TSGEN_CAS_U64(NAME, PTX)                                                  \
  static __device__ __forceinline__ uint64_t NAME(uint64_t* ptr, uint64_t compare, \
                                                  uint64_t value) {               \
    uint64_t old;                                                                 \
    asm volatile(PTX " %0, [%1], %2, %3;"                                         \
                 : "=l"(old)                                                      \
                 : "l"(ptr), "l"(compare), "l"(value)                             \
                 : "memory");                                                     \
    return old;                                                                   \
  }
#define TSGEN_FENCE(NAME, PTX)                                                    \
  static __device__ __forceinline__ void NAME() { asm volatile(PTX ";" ::: "memory"); }

// ---------------------------------------------------------------------------
// Loads. SASS (sm_90a):
//   weak      ld.global           -> LDG.E / LDG.E.64 / LDG.E.128
//   volatile  ld.volatile.global  -> LDG.E.STRONG.SYS (same as relaxed.sys)
//   relaxed   ld.relaxed.<s>      -> LDG.E.STRONG.{SM,GPU,SYS}  (cta = .SM)
//   acquire   ld.acquire.<s>      -> cta: LDG.E.STRONG.SM
//                                    gpu: LDG.E.STRONG.GPU + CCTL.IVALL
//                                    sys: LDG.E.STRONG.SYS + CCTL.IVALL
//   (.64 / .128 is inserted after .E for u64 / v4: LDG.E.128.STRONG.GPU)
// ---------------------------------------------------------------------------
TSGEN_LD_U32(ld_weak_global_u32, "ld.global.u32")
TSGEN_LD_U64(ld_weak_global_u64, "ld.global.u64")
TSGEN_LD_V4(ld_weak_global_v4, "ld.global.v4.u32")

TSGEN_LD_U32(ld_volatile_global_u32, "ld.volatile.global.u32")
TSGEN_LD_U64(ld_volatile_global_u64, "ld.volatile.global.u64")
TSGEN_LD_V4(ld_volatile_global_v4, "ld.volatile.global.v4.u32")

TSGEN_LD_U32(ld_relaxed_cta_global_u32, "ld.relaxed.cta.global.u32")
TSGEN_LD_U64(ld_relaxed_cta_global_u64, "ld.relaxed.cta.global.u64")
TSGEN_LD_V4(ld_relaxed_cta_global_v4, "ld.relaxed.cta.global.v4.u32")
TSGEN_LD_U32(ld_relaxed_gpu_global_u32, "ld.relaxed.gpu.global.u32")
TSGEN_LD_U64(ld_relaxed_gpu_global_u64, "ld.relaxed.gpu.global.u64")
TSGEN_LD_V4(ld_relaxed_gpu_global_v4, "ld.relaxed.gpu.global.v4.u32")
TSGEN_LD_U32(ld_relaxed_sys_global_u32, "ld.relaxed.sys.global.u32")
TSGEN_LD_U64(ld_relaxed_sys_global_u64, "ld.relaxed.sys.global.u64")
TSGEN_LD_V4(ld_relaxed_sys_global_v4, "ld.relaxed.sys.global.v4.u32")

TSGEN_LD_U32(ld_acquire_cta_global_u32, "ld.acquire.cta.global.u32")
TSGEN_LD_U64(ld_acquire_cta_global_u64, "ld.acquire.cta.global.u64")
TSGEN_LD_V4(ld_acquire_cta_global_v4, "ld.acquire.cta.global.v4.u32")
TSGEN_LD_U32(ld_acquire_gpu_global_u32, "ld.acquire.gpu.global.u32")
TSGEN_LD_U64(ld_acquire_gpu_global_u64, "ld.acquire.gpu.global.u64")
TSGEN_LD_V4(ld_acquire_gpu_global_v4, "ld.acquire.gpu.global.v4.u32")
TSGEN_LD_U32(ld_acquire_sys_global_u32, "ld.acquire.sys.global.u32")
TSGEN_LD_U64(ld_acquire_sys_global_u64, "ld.acquire.sys.global.u64")
TSGEN_LD_V4(ld_acquire_sys_global_v4, "ld.acquire.sys.global.v4.u32")

// Non-coherent (read-only data path). Only for data that no thread of any
// GPU writes while the kernel runs. SASS (.NA comes before the width):
//   nc              ld.global.nc                  -> LDG.E.CONSTANT / LDG.E.64.CONSTANT
//                                                    / LDG.E.128.CONSTANT
//   nc no_allocate  ld.global.nc.L1::no_allocate  -> LDG.E.NA.CONSTANT / LDG.E.NA.64.CONSTANT
//                                                    / LDG.E.NA.128.CONSTANT
//   weak no_alloc.  ld.global.L1::no_allocate     -> LDG.E.NA.128
TSGEN_LD_U32(ld_nc_global_u32, "ld.global.nc.u32")
TSGEN_LD_U64(ld_nc_global_u64, "ld.global.nc.u64")
TSGEN_LD_V4(ld_nc_global_v4, "ld.global.nc.v4.u32")
TSGEN_LD_U32(ld_nc_na_global_u32, "ld.global.nc.L1::no_allocate.u32")
TSGEN_LD_U64(ld_nc_na_global_u64, "ld.global.nc.L1::no_allocate.u64")
TSGEN_LD_V4(ld_nc_na_global_v4, "ld.global.nc.L1::no_allocate.v4.u32")
TSGEN_LD_V4(ld_weak_na_global_v4, "ld.global.L1::no_allocate.v4.u32")

// ---------------------------------------------------------------------------
// Stores. SASS (sm_90a):
//   weak      st.global           -> STG.E / STG.E.64 / STG.E.128
//   volatile  st.volatile.global  -> STG.E.STRONG.SYS
//   relaxed   st.relaxed.<s>      -> STG.E.STRONG.{SM,GPU,SYS}
//   release   st.release.<s>      -> cta: MEMBAR.ALL.CTA + STG.E.STRONG.SM
//                                    gpu: MEMBAR.ALL.GPU + ERRBAR + CGAERRBAR
//                                         + STG.E.STRONG.GPU
//                                    sys: MEMBAR.ALL.SYS + ERRBAR + CGAERRBAR
//                                         + STG.E.STRONG.SYS
//   (.64 / .128 after .E for u64 / v4, as for loads)
//   no_alloc  st.global.L1::no_allocate -> STG.E.NA.128
// ---------------------------------------------------------------------------
TSGEN_ST_U32(st_weak_global_u32, "st.global.u32")
TSGEN_ST_U64(st_weak_global_u64, "st.global.u64")
TSGEN_ST_V4(st_weak_global_v4, "st.global.v4.u32")

TSGEN_ST_U32(st_volatile_global_u32, "st.volatile.global.u32")
TSGEN_ST_U64(st_volatile_global_u64, "st.volatile.global.u64")
TSGEN_ST_V4(st_volatile_global_v4, "st.volatile.global.v4.u32")

TSGEN_ST_U32(st_relaxed_cta_global_u32, "st.relaxed.cta.global.u32")
TSGEN_ST_U64(st_relaxed_cta_global_u64, "st.relaxed.cta.global.u64")
TSGEN_ST_V4(st_relaxed_cta_global_v4, "st.relaxed.cta.global.v4.u32")
TSGEN_ST_U32(st_relaxed_gpu_global_u32, "st.relaxed.gpu.global.u32")
TSGEN_ST_U64(st_relaxed_gpu_global_u64, "st.relaxed.gpu.global.u64")
TSGEN_ST_V4(st_relaxed_gpu_global_v4, "st.relaxed.gpu.global.v4.u32")
TSGEN_ST_U32(st_relaxed_sys_global_u32, "st.relaxed.sys.global.u32")
TSGEN_ST_U64(st_relaxed_sys_global_u64, "st.relaxed.sys.global.u64")
TSGEN_ST_V4(st_relaxed_sys_global_v4, "st.relaxed.sys.global.v4.u32")

TSGEN_ST_U32(st_release_cta_global_u32, "st.release.cta.global.u32")
TSGEN_ST_U64(st_release_cta_global_u64, "st.release.cta.global.u64")
TSGEN_ST_V4(st_release_cta_global_v4, "st.release.cta.global.v4.u32")
TSGEN_ST_U32(st_release_gpu_global_u32, "st.release.gpu.global.u32")
TSGEN_ST_U64(st_release_gpu_global_u64, "st.release.gpu.global.u64")
TSGEN_ST_V4(st_release_gpu_global_v4, "st.release.gpu.global.v4.u32")
TSGEN_ST_U32(st_release_sys_global_u32, "st.release.sys.global.u32")
TSGEN_ST_U64(st_release_sys_global_u64, "st.release.sys.global.u64")
TSGEN_ST_V4(st_release_sys_global_v4, "st.release.sys.global.v4.u32")

TSGEN_ST_V4(st_na_global_v4, "st.global.L1::no_allocate.v4.u32")

// ---------------------------------------------------------------------------
// Atomics, returning the old value. SASS (sm_90a):
//   relaxed   -> ATOMG.E.<OP>.STRONG.{GPU,SYS}        (u64: ATOMG.E.<OP>.64.STRONG...)
//   acquire   -> ATOMG.E.<OP>.STRONG.{GPU,SYS} + CCTL.IVALL
//   release   -> MEMBAR.ALL.{GPU,SYS} + ERRBAR + CGAERRBAR + ATOMG.E.<OP>.STRONG...
//   acq_rel   -> MEMBAR.ALL.{GPU,SYS} + ERRBAR + CGAERRBAR + ATOMG... + CCTL.IVALL
//   <OP>: ADD, EXCH, CAS. ptxas aggregates an add of a warp-uniform value
//   into one ATOMG per warp (VOTEU.ANY / UPOPC / SHFL around it); the old
//   values each lane gets are still those of a per-lane atomic.
// ---------------------------------------------------------------------------
TSGEN_ATOM_U32(atom_add_relaxed_gpu_global_u32, "atom.relaxed.gpu.global.add.u32")
TSGEN_ATOM_U64(atom_add_relaxed_gpu_global_u64, "atom.relaxed.gpu.global.add.u64")
TSGEN_ATOM_U32(atom_add_relaxed_sys_global_u32, "atom.relaxed.sys.global.add.u32")
TSGEN_ATOM_U64(atom_add_relaxed_sys_global_u64, "atom.relaxed.sys.global.add.u64")
TSGEN_ATOM_U32(atom_add_acquire_gpu_global_u32, "atom.acquire.gpu.global.add.u32")
TSGEN_ATOM_U64(atom_add_acquire_gpu_global_u64, "atom.acquire.gpu.global.add.u64")
TSGEN_ATOM_U32(atom_add_acquire_sys_global_u32, "atom.acquire.sys.global.add.u32")
TSGEN_ATOM_U64(atom_add_acquire_sys_global_u64, "atom.acquire.sys.global.add.u64")
TSGEN_ATOM_U32(atom_add_release_gpu_global_u32, "atom.release.gpu.global.add.u32")
TSGEN_ATOM_U64(atom_add_release_gpu_global_u64, "atom.release.gpu.global.add.u64")
TSGEN_ATOM_U32(atom_add_release_sys_global_u32, "atom.release.sys.global.add.u32")
TSGEN_ATOM_U64(atom_add_release_sys_global_u64, "atom.release.sys.global.add.u64")
TSGEN_ATOM_U32(atom_add_acq_rel_gpu_global_u32, "atom.acq_rel.gpu.global.add.u32")
TSGEN_ATOM_U64(atom_add_acq_rel_gpu_global_u64, "atom.acq_rel.gpu.global.add.u64")
TSGEN_ATOM_U32(atom_add_acq_rel_sys_global_u32, "atom.acq_rel.sys.global.add.u32")
TSGEN_ATOM_U64(atom_add_acq_rel_sys_global_u64, "atom.acq_rel.sys.global.add.u64")

TSGEN_ATOM_U32(atom_exch_relaxed_gpu_global_u32, "atom.relaxed.gpu.global.exch.b32")
TSGEN_ATOM_U64(atom_exch_relaxed_gpu_global_u64, "atom.relaxed.gpu.global.exch.b64")
TSGEN_ATOM_U32(atom_exch_relaxed_sys_global_u32, "atom.relaxed.sys.global.exch.b32")
TSGEN_ATOM_U64(atom_exch_relaxed_sys_global_u64, "atom.relaxed.sys.global.exch.b64")
TSGEN_ATOM_U32(atom_exch_acquire_gpu_global_u32, "atom.acquire.gpu.global.exch.b32")
TSGEN_ATOM_U64(atom_exch_acquire_gpu_global_u64, "atom.acquire.gpu.global.exch.b64")
TSGEN_ATOM_U32(atom_exch_acquire_sys_global_u32, "atom.acquire.sys.global.exch.b32")
TSGEN_ATOM_U64(atom_exch_acquire_sys_global_u64, "atom.acquire.sys.global.exch.b64")
TSGEN_ATOM_U32(atom_exch_release_gpu_global_u32, "atom.release.gpu.global.exch.b32")
TSGEN_ATOM_U64(atom_exch_release_gpu_global_u64, "atom.release.gpu.global.exch.b64")
TSGEN_ATOM_U32(atom_exch_release_sys_global_u32, "atom.release.sys.global.exch.b32")
TSGEN_ATOM_U64(atom_exch_release_sys_global_u64, "atom.release.sys.global.exch.b64")
TSGEN_ATOM_U32(atom_exch_acq_rel_gpu_global_u32, "atom.acq_rel.gpu.global.exch.b32")
TSGEN_ATOM_U64(atom_exch_acq_rel_gpu_global_u64, "atom.acq_rel.gpu.global.exch.b64")
TSGEN_ATOM_U32(atom_exch_acq_rel_sys_global_u32, "atom.acq_rel.sys.global.exch.b32")
TSGEN_ATOM_U64(atom_exch_acq_rel_sys_global_u64, "atom.acq_rel.sys.global.exch.b64")

TSGEN_CAS_U32(atom_cas_relaxed_gpu_global_u32, "atom.relaxed.gpu.global.cas.b32")
TSGEN_CAS_U64(atom_cas_relaxed_gpu_global_u64, "atom.relaxed.gpu.global.cas.b64")
TSGEN_CAS_U32(atom_cas_relaxed_sys_global_u32, "atom.relaxed.sys.global.cas.b32")
TSGEN_CAS_U64(atom_cas_relaxed_sys_global_u64, "atom.relaxed.sys.global.cas.b64")
TSGEN_CAS_U32(atom_cas_acquire_gpu_global_u32, "atom.acquire.gpu.global.cas.b32")
TSGEN_CAS_U64(atom_cas_acquire_gpu_global_u64, "atom.acquire.gpu.global.cas.b64")
TSGEN_CAS_U32(atom_cas_acquire_sys_global_u32, "atom.acquire.sys.global.cas.b32")
TSGEN_CAS_U64(atom_cas_acquire_sys_global_u64, "atom.acquire.sys.global.cas.b64")
TSGEN_CAS_U32(atom_cas_release_gpu_global_u32, "atom.release.gpu.global.cas.b32")
TSGEN_CAS_U64(atom_cas_release_gpu_global_u64, "atom.release.gpu.global.cas.b64")
TSGEN_CAS_U32(atom_cas_release_sys_global_u32, "atom.release.sys.global.cas.b32")
TSGEN_CAS_U64(atom_cas_release_sys_global_u64, "atom.release.sys.global.cas.b64")
TSGEN_CAS_U32(atom_cas_acq_rel_gpu_global_u32, "atom.acq_rel.gpu.global.cas.b32")
TSGEN_CAS_U64(atom_cas_acq_rel_gpu_global_u64, "atom.acq_rel.gpu.global.cas.b64")
TSGEN_CAS_U32(atom_cas_acq_rel_sys_global_u32, "atom.acq_rel.sys.global.cas.b32")
TSGEN_CAS_U64(atom_cas_acq_rel_sys_global_u64, "atom.acq_rel.sys.global.cas.b64")

// ---------------------------------------------------------------------------
// Reductions (no return value). SASS (sm_90a):
//   relaxed -> REDG.E.ADD.STRONG.{GPU,SYS}      (u64: REDG.E.ADD.64.STRONG...)
//   release -> MEMBAR.ALL.{GPU,SYS} + ERRBAR + CGAERRBAR + REDG.E.ADD...
//   (warp-uniform values are aggregated into one REDG per warp, as for atom)
// red has a store's operand shape, `[ptr], value`, so the store stamps serve.
// ---------------------------------------------------------------------------
TSGEN_ST_U32(red_add_relaxed_gpu_global_u32, "red.relaxed.gpu.global.add.u32")
TSGEN_ST_U64(red_add_relaxed_gpu_global_u64, "red.relaxed.gpu.global.add.u64")
TSGEN_ST_U32(red_add_relaxed_sys_global_u32, "red.relaxed.sys.global.add.u32")
TSGEN_ST_U64(red_add_relaxed_sys_global_u64, "red.relaxed.sys.global.add.u64")
TSGEN_ST_U32(red_add_release_gpu_global_u32, "red.release.gpu.global.add.u32")
TSGEN_ST_U64(red_add_release_gpu_global_u64, "red.release.gpu.global.add.u64")
TSGEN_ST_U32(red_add_release_sys_global_u32, "red.release.sys.global.add.u32")
TSGEN_ST_U64(red_add_release_sys_global_u64, "red.release.sys.global.add.u64")

// ---------------------------------------------------------------------------
// Fences. SASS (sm_90a):
//   fence.acq_rel.cta  -> MEMBAR.ALL.CTA
//   fence.acq_rel.gpu  -> MEMBAR.ALL.GPU + ERRBAR + CGAERRBAR + CCTL.IVALL
//   fence.acq_rel.sys  -> MEMBAR.ALL.SYS + ERRBAR + CGAERRBAR + CCTL.IVALL
//   fence.sc.cta       -> MEMBAR.SC.CTA
//   fence.sc.gpu       -> MEMBAR.SC.GPU + ERRBAR + CGAERRBAR + CCTL.IVALL
//   fence.sc.sys       -> MEMBAR.SC.SYS + ERRBAR + CGAERRBAR + CCTL.IVALL
//   fence.proxy.async.shared::cta -> MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S
// ---------------------------------------------------------------------------
TSGEN_FENCE(fence_acq_rel_cta, "fence.acq_rel.cta")
TSGEN_FENCE(fence_acq_rel_gpu, "fence.acq_rel.gpu")
TSGEN_FENCE(fence_acq_rel_sys, "fence.acq_rel.sys")
TSGEN_FENCE(fence_sc_cta, "fence.sc.cta")
TSGEN_FENCE(fence_sc_gpu, "fence.sc.gpu")
TSGEN_FENCE(fence_sc_sys, "fence.sc.sys")
// Orders this thread's generic-proxy shared-memory writes before later
// async-proxy (TMA / wgmma) accesses to them.
TSGEN_FENCE(fence_proxy_async_shared_cta, "fence.proxy.async.shared::cta")

// ---------------------------------------------------------------------------
// Warp helpers. SASS: __any_sync / __all_sync -> VOTE.ANY / VOTE.ALL;
// elect.sync -> ELECT; %laneid -> S2R SR_LANEID; warp_id -> S2R SR_TID.*.
// ---------------------------------------------------------------------------
static __device__ __forceinline__ bool warp_any_sync(unsigned mask, int pred) {
  return __any_sync(mask, pred) != 0;
}

static __device__ __forceinline__ bool warp_all_sync(unsigned mask, int pred) {
  return __all_sync(mask, pred) != 0;
}

// Lane index 0..31. A register read with no memory side effect: plain
// (non-volatile, no clobber) asm, so the compiler may reuse the value.
static __device__ __forceinline__ uint32_t lane_id() {
  uint32_t lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// Warp index within the block (linear thread index / 32). Deliberately not
// %warpid, which is the hardware warp slot and can change during execution.
static __device__ __forceinline__ uint32_t warp_id() {
  return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) >> 5;
}

// Warpgroup index (threadIdx.x / 128, a 1-D block) as a value the compiler knows to be the same in every
// lane of the warp (a shuffle from lane 0): what is computed from it, such as wgmma shared-memory descriptors,
// can then live in uniform registers. From threadIdx.x alone, each descriptor was built in vector registers
// and copied to a uniform one (R2UR) before every wgmma: 52 of the 692 instructions of the hd 128 backward's
// step (docs/design/attention.md, "FA4's sm_90 backward beside tsgen's"). All 32 lanes must call it.
static __device__ __forceinline__ uint32_t warpgroup_id() {
  return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
}

// True in exactly one lane of the full warp; all 32 lanes must call it.
// sm_90+: elect.sync (ELECT); older archs: lane 0.
static __device__ __forceinline__ bool elect_one_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t elected;
  asm volatile(
      "{\n\t"
      ".reg .pred p;\n\t"
      "elect.sync _|p, 0xffffffff;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t"
      "}"
      : "=r"(elected)
      :
      : "memory");
  return elected != 0;
#else
  return lane_id() == 0;
#endif
}

// ---------------------------------------------------------------------------
// Timer: %globaltimer, a 64-bit nanosecond clock (CS2R R, SR_GLOBALTIMERLO).
// Its update granularity depends on the GPU; use it for timeouts and coarse
// timing, not for cycle counts.
// ---------------------------------------------------------------------------
static __device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}

// ===========================================================================
// multimem (NVLink SHARP / multicast objects), sm_90+.
//
//   !!! COMPILED ONLY -- NEVER EXECUTED ON OUR MACHINES !!!
//   Our GPUs have no NVLink multicast (the device hosts say to leave it
//   off). These helpers are checked to assemble and to emit the expected
//   SASS, and nothing more: no test runs them. `mc_ptr` must be an address
//   inside a multicast object (cuMulticastCreate / cuMulticastBindMem);
//   on a normal address they fault or are undefined.
//
// Only defined when compiling for sm_90+ (and in the host pass), so calling
// one from code built for an older arch is a compile error.
//
// SASS (sm_90a):
//   multimem.ld_reduce.relaxed.sys.global.add.f32        -> LDGMC.E.ADD.F32.RN.STRONG.SYS
//   ....add.bf16x2 / .f16x2                              -> LDGMC.E.ADD.BF16x2.RN.STRONG.SYS
//                                                           / LDGMC.E.ADD.F16x2.RN.STRONG.SYS
//   ....add.acc::f32.bf16x2 (accumulate in f32)          -> LDGMC.E.F32ADD.BF16x2.RN.STRONG.SYS
//   ....add.v4.f32 / .v4.bf16x2                          -> LDGMC.E.ADD.F32x4.RN.STRONG.SYS
//                                                           / LDGMC.E.ADD.BF16x8.RN.STRONG.SYS
//   multimem.st.relaxed.sys.global.*                     -> STG.E[.128].STRONG.SYS
//     (the multicast is in the address: the SASS is an ordinary strong store)
//   multimem.red.relaxed.sys.global.add.u32              -> REDG.E.ADD.STRONG.SYS
//   multimem.red.release.sys.global.add.u32              -> MEMBAR.ALL.SYS + ERRBAR + CGAERRBAR
//                                                           + REDG.E.ADD.STRONG.SYS
// Packed bf16x2 / f16x2 values travel as uint32_t (v4: uint4).
// ===========================================================================
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

#define TSGEN_MM_LD_REDUCE_B32(NAME, PTX)                                         \
  static __device__ __forceinline__ uint32_t NAME(const void* mc_ptr) {          \
    uint32_t v;                                                                   \
    asm volatile(PTX " %0, [%1];" : "=r"(v) : "l"(mc_ptr) : "memory");            \
    return v;                                                                     \
  }
#define TSGEN_MM_LD_REDUCE_V4_B32(NAME, PTX)                                      \
  static __device__ __forceinline__ uint4 NAME(const void* mc_ptr) {             \
    uint4 v;                                                                      \
    asm volatile(PTX " {%0, %1, %2, %3}, [%4];"                                   \
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                     \
                 : "l"(mc_ptr)                                                    \
                 : "memory");                                                     \
    return v;                                                                     \
  }
#define TSGEN_MM_ST_B32(NAME, PTX)                                                \
  static __device__ __forceinline__ void NAME(void* mc_ptr, uint32_t value) {    \
    asm volatile(PTX " [%0], %1;" ::"l"(mc_ptr), "r"(value) : "memory");          \
  }

static __device__ __forceinline__ float multimem_ld_reduce_add_relaxed_sys_f32(
    const void* mc_ptr) {
  float v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.f32 %0, [%1];"
               : "=f"(v)
               : "l"(mc_ptr)
               : "memory");
  return v;
}
TSGEN_MM_LD_REDUCE_B32(multimem_ld_reduce_add_relaxed_sys_bf16x2,
                       "multimem.ld_reduce.relaxed.sys.global.add.bf16x2")
TSGEN_MM_LD_REDUCE_B32(multimem_ld_reduce_add_relaxed_sys_f16x2,
                       "multimem.ld_reduce.relaxed.sys.global.add.f16x2")
TSGEN_MM_LD_REDUCE_B32(multimem_ld_reduce_add_relaxed_sys_acc_f32_bf16x2,
                       "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.bf16x2")
TSGEN_MM_LD_REDUCE_B32(multimem_ld_reduce_add_relaxed_sys_acc_f32_f16x2,
                       "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.f16x2")

static __device__ __forceinline__ float4 multimem_ld_reduce_add_relaxed_sys_v4_f32(
    const void* mc_ptr) {
  float4 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(mc_ptr)
               : "memory");
  return v;
}
TSGEN_MM_LD_REDUCE_V4_B32(multimem_ld_reduce_add_relaxed_sys_v4_bf16x2,
                          "multimem.ld_reduce.relaxed.sys.global.add.v4.bf16x2")
TSGEN_MM_LD_REDUCE_V4_B32(multimem_ld_reduce_add_relaxed_sys_acc_f32_v4_bf16x2,
                          "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2")

static __device__ __forceinline__ void multimem_st_relaxed_sys_f32(void* mc_ptr, float value) {
  asm volatile("multimem.st.relaxed.sys.global.f32 [%0], %1;" ::"l"(mc_ptr), "f"(value)
               : "memory");
}
TSGEN_MM_ST_B32(multimem_st_relaxed_sys_bf16x2, "multimem.st.relaxed.sys.global.bf16x2")

static __device__ __forceinline__ void multimem_st_relaxed_sys_v4_f32(void* mc_ptr,
                                                                      float4 value) {
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(mc_ptr),
               "f"(value.x), "f"(value.y), "f"(value.z), "f"(value.w)
               : "memory");
}
static __device__ __forceinline__ void multimem_st_relaxed_sys_v4_bf16x2(void* mc_ptr,
                                                                         uint4 value) {
  asm volatile("multimem.st.relaxed.sys.global.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(
                   mc_ptr),
               "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w)
               : "memory");
}

TSGEN_MM_ST_B32(multimem_red_add_relaxed_sys_u32, "multimem.red.relaxed.sys.global.add.u32")
TSGEN_MM_ST_B32(multimem_red_add_release_sys_u32, "multimem.red.release.sys.global.add.u32")

#undef TSGEN_MM_LD_REDUCE_B32
#undef TSGEN_MM_LD_REDUCE_V4_B32
#undef TSGEN_MM_ST_B32

#endif  // !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

#undef TSGEN_LD_U32
#undef TSGEN_LD_U64
#undef TSGEN_LD_V4
#undef TSGEN_ST_U32
#undef TSGEN_ST_U64
#undef TSGEN_ST_V4
#undef TSGEN_ATOM_U32
#undef TSGEN_ATOM_U64
#undef TSGEN_CAS_U32
#undef TSGEN_CAS_U64
#undef TSGEN_FENCE

}  // namespace ptx
// The other tsgen headers call these by their bare names: each spells out its instruction.
using namespace ptx;
}  // namespace tsgen

#endif  // TSGEN_PTX_CUH
