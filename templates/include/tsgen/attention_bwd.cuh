// tsgen/attention_bwd.cuh -- the flash-attention backward (dQ, dK, dV) on one GPU, first version:
// warp-level mma.sync (m16n8k16, fp32 accumulation) with ldmatrix, plain loads into padded shared
// memory, no TMA, no wgmma, no pipelining. Correctness first (issue 35); the FA3-style Hopper
// kernel of docs/design/attention.md ("Backward") replaces the main kernel later, keeping the
// preprocess, the convert pass, the workspace and the calling convention.
//
// Hand-written; included by generated attention_backward sources. The op's template supplies a
// `Config` struct: Element (__nv_bfloat16 or __half), BF16, HEAD_DIM, HEADS, KV_HEADS, CAUSAL,
// BHSD, SCALE (the softmax scale) and SCALE_LOG2 (scale * log2 e), as constexpr members.
//
// Tensors (the forward's, tsgen/attention.cuh; row = one position of one sequence):
//   Q, O, dO, dQ  [batch, q_len, HEADS, HEAD_DIM]     (BHSD: [batch, HEADS, q_len, HEAD_DIM])
//   K, V, dK, dV  [batch, kv_len, KV_HEADS, HEAD_DIM] (BHSD: [batch, KV_HEADS, kv_len, HEAD_DIM])
//   LSE           [batch, HEADS, q_len] fp32, natural log, -inf where a query saw no key
// Workspace (fp32, the caller's): dq_accum as dQ's shape and layout (Config::DQ_TILED, the wgmma kernel's
// bulk reductions: the same size, tiled as dq_tiled_offset says; Config::DETERMINISTIC: then the dQ
// semaphores, dq_semaphores), dsum and lse2 as LSE's.
// Positions and the causal mask: as the forward's (query row r at q_offset + r before q_split,
// q_offset2 + r - q_split after; key j at kv_offset + j; a query sees keys at positions <= its own).
//
// Three kernels, in stream order:
//   1. preprocess: D = rowsum(dO * O) (fp32) into dsum; LSE2 = LSE * log2(e) into lse2, +inf where
//      LSE is -inf (so that exp2(s - LSE2) = 0: an empty row gives P = 0, not exp2(s + inf) = inf);
//      and it zeroes dq_accum (a second call would otherwise add onto the first), and with
//      Config::DETERMINISTIC the dQ semaphores after it (dq_semaphores).
//   2. main: one CTA (4 warps) per (KV block of 64 keys, KV head, sequence), numbered KV block
//      major (block 0 of every head first: with CAUSAL it sees the most queries, longest first).
//      K_j and V_j stay in shared memory; the CTA walks (query head of the GQA group, query block
//      of 64 rows), skipping blocks that see none of its keys (CAUSAL). Warp w owns keys
//      16w .. 16w + 15 of the block and computes, in the transposed form (keys as the M of the MMA):
//        S^T = K_j Q_i^T, dP^T = V_j dO_i^T (fp32 fragments, 16 keys x 64 queries)
//        P^T = exp2(SCALE_LOG2 S^T - LSE2) (0 where masked: key >= kv_len, or CAUSAL and key after
//              query), dS^T = P^T * (dP^T - D)
//        dV_j += P^T dO_i, dK_j += dS^T Q_i (P^T, dS^T rounded to 16 bits as the A operand from
//              registers; dK, dV accumulate in fp32 registers over the whole walk: GQA sums the
//              group's query heads there, deterministic, no workspace)
//      then dS^T (16-bit) goes to shared memory, and after a CTA barrier warp w computes
//        dQ_i[16w .. 16w + 15] = dS K_j (fp32, 64 columns at a time)
//      and adds it into dq_accum with fp32 atomics (red.global.add): every KV block adds into every
//      query block it sees, so the adds race by design and land in no fixed order (run-to-run
//      differences of fp32 rounding). dK (times SCALE) and dV leave from registers at the end.
//   3. convert: dQ = 16-bit(SCALE * dq_accum) (DQ_TILED: one CTA per tiled 64-row block, ConvertTiled).
//
// Hazards: the CTA barrier before each query block's loads (the last block's products still read
// Q, dO and dS in shared memory), the barrier between writing dS and reading it for dQ, LSE2 = +inf
// on padding rows (rows past q_len are zero-filled and must give P = 0), the key tail masked
// explicitly (zero-filled keys give S = 0 and P = exp2(-LSE2), not 0).
#ifndef TSGEN_ATTENTION_BWD_CUH
#define TSGEN_ATTENTION_BWD_CUH

#include <math.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

namespace tsgen {
namespace attention_bwd {

constexpr int BLOCK_M = 64;  // query rows per step of the walk
constexpr int BLOCK_N = 64;  // keys per CTA
constexpr int WARPS = 4;     // each owns 16 keys (S^T, dK, dV) and 16 query rows (dQ)
constexpr int THREADS = 32 * WARPS;
constexpr int PRE_THREADS = 256, CONVERT_THREADS = 256;
constexpr uint64_t MAX_LEN = 1u << 30;

// Shared memory of the main kernel, in 16-bit elements: rows padded by 8 elements (16 bytes), so
// that the 8 row addresses of one ldmatrix fall into different banks.
template <class C>
struct Layout {
  static constexpr int PITCH = C::HEAD_DIM + 8;  // K, V, Q, dO rows
  static constexpr int DS_PITCH = BLOCK_M + 8;   // dS^T rows (one per key)
  static constexpr int K = 0, V = K + BLOCK_N * PITCH, Q = V + BLOCK_N * PITCH, DO = Q + BLOCK_M * PITCH;
  static constexpr int DS = DO + BLOCK_M * PITCH, END = DS + BLOCK_N * DS_PITCH;
  static constexpr int LSE2_BYTES = 2 * END, DSUM_BYTES = LSE2_BYTES + 4 * BLOCK_M;  // fp32 after them
  static constexpr int SMEM_BYTES = DSUM_BYTES + 4 * BLOCK_M;
  static_assert(C::HEAD_DIM % 64 == 0, "head dim: a multiple of 64 (the dQ product's column chunks)");
  static_assert(C::SMEM_BYTES == SMEM_BYTES, "the spec's smem_bytes disagrees with this header's layout");
};

// params.kv_push (the backward of context-parallel attention, issue 35): where a rank's dK, dV partial sums go.
// The main kernel runs over the keys gathered from every rank (kv_len = world x rows, in position order); the
// partial sums of the keys that rank o holds are o's to add up. With kv_push each consumer warpgroup stores its
// 64 keys' partials (dK times the scale, dV, rounded to the element type) where their owner reads them: its own
// keys into dk, dv (this rank's rows, [batch, rows, KV heads, head dim] in the spec's layout), another rank's into
// that rank's receive area, and goes on (no fence, no wait for the stores to land). After the main kernel, in
// stream order, push_signal raises every other rank's `arrived` counter for this rank once (a system-scope fence,
// then a release add: the main kernel's stores are visible to it at the kernel boundary, and the release is
// cumulative over them). The owner's push_wait kernel waits for every sender's count and push_reduce adds their
// partials to its own (in fp32,
// rounded once; each partial was rounded to the element type, as the composed path's reduce-scatter sums them).
// Device memory, filled by the caller (tsgen/torch/cp_attention_op.py push_table_bytes, _push_heap):
//   - each rank's symmetric heap: calls[2] (tsgen::call_begin / call_end: push_reduce's calls), arrived[MAX_WORLD]
//     (sender s's signals, one a call, cumulative: epoch e's count is e), then at PUSH_AREA the receive area:
//     [2 epoch parities][world - 1 senders (push_sender: the others in rank order)][dK, dV][batch x rows x KV
//     heads x head dim elements];
//   - `area[o]`, `arrived_at[o]`: rank o's receive area and its arrived[this rank], as this rank addresses them.
// Epoch e = calls[0] + 1 (the main kernel reads it after the previous push_reduce, which advanced it, and before
// this call's). Slots by e's parity: a sender's call e + 1 writes while the owner may still read e's, and it cannot
// reach e + 2 before the owner's push_reduce of e is done (its push_wait of e + 1 waits for the owner's push_signal
// of e + 1, which the owner's stream runs after its main kernel of e + 1, after that push_reduce).
constexpr uint32_t PUSH_MAX_WORLD = 8;
constexpr uint32_t PUSH_KEYS = 64;     // keys of one owner a consumer warpgroup stores: its half of a 128-key block
constexpr uint64_t PUSH_AREA = 256;    // bytes of the heap before the receive area
struct KvPush {
  uint32_t world, rank, rows, zigzag;  // rows: each rank's; zigzag: 2 world chunks (rank r: r, 2 world - 1 - r)
  uint64_t* calls;                     // this rank's calls[2]
  const uint64_t* arrived;             // this rank's arrived[PUSH_MAX_WORLD]
  void* area[PUSH_MAX_WORLD];
  uint64_t* arrived_at[PUSH_MAX_WORLD];
};

// The owner of gathered key `key` and its row among the owner's rows (zig-zag: chunks of rows / 2, chunk c held
// by rank c < world ? c : 2 world - 1 - c, as its first or second half). Host-compiled by the tests.
__host__ __device__ __forceinline__ uint32_t push_owner(const KvPush& t, uint32_t key, uint32_t& row) {
  if (!t.zigzag) {
    row = key % t.rows;
    return key / t.rows;
  }
  const uint32_t half = t.rows / 2, c = key / half;
  row = (c < t.world ? 0 : half) + key % half;
  return c < t.world ? c : 2 * t.world - 1 - c;
}

// Rank `sender`'s slot at rank `owner` (sender != owner): the other ranks in rank order.
__host__ __device__ __forceinline__ uint32_t push_sender(uint32_t sender, uint32_t owner) {
  return sender < owner ? sender : sender - 1;
}

// Element offset of (parity, slot, dK or dV) in a receive area of `elems` elements a tensor.
__host__ __device__ __forceinline__ size_t push_slot(uint32_t world, uint64_t epoch, uint32_t slot, uint32_t which,
                                                     size_t elems) {
  return (((size_t)(epoch & 1) * (world - 1) + slot) * 2 + which) * elems;
}

struct Problem {
  const void *q, *k, *v, *o, *dout;
  const float* lse;
  void *dq, *dk, *dv;
  float *dq_accum, *dsum, *lse2;
  uint32_t batch, q_len, kv_len, kv_blocks;
  int32_t q_offset, q_split, q_offset2, kv_offset;
  // the wgmma main kernel's tail split (Config::TAIL_SPLIT, tsgen/attention_bwd_wgmma.cuh): CTAs from tail_first
  // on are tail_parts pieces of each of the grid's last items; tail_first = the main kernel's items where none is
  // split (every other kernel ignores both)
  uint32_t tail_first, tail_parts;
  // Config::KV_PUSH: the table (device memory); every other kernel ignores it
  const KvPush* push;
};

// Offset (elements) of row `s` of head `h` of sequence `b` in a tensor of `heads` heads, `len` rows.
template <class C>
__device__ __forceinline__ size_t row_offset(uint32_t b, uint32_t s, uint32_t h, uint32_t heads, uint32_t len) {
  return C::BHSD ? (((size_t)b * heads + h) * len + s) * C::HEAD_DIM
                 : (((size_t)b * len + s) * heads + h) * C::HEAD_DIM;
}

__host__ __device__ __forceinline__ int32_t query_position(const Problem& p, int32_t r) {
  return r < p.q_split ? p.q_offset + r : p.q_offset2 + (r - p.q_split);
}

// CAUSAL: whether query rows [r0, r1) see any key at or after position first_key, i.e. whether
// their latest position (the maximum over both zig-zag segments) is not before it. A query block
// that does not is skipped by the KV block starting at first_key. Host-compiled by the tests.
__host__ __device__ __forceinline__ bool rows_see_keys(const Problem& p, int32_t r0, int32_t r1, int32_t first_key) {
  int32_t last = query_position(p, r1 - 1);
  if (r0 < p.q_split && p.q_split < r1) {
    const int32_t first_segment = query_position(p, p.q_split - 1);
    last = first_segment > last ? first_segment : last;
  }
  return last >= first_key;
}

// The tiled dq_accum of the wgmma kernel's bulk reductions (Config::DQ_TILED; the mma.sync kernel's
// and dq_reduce atomic's is dQ's own layout): per (sequence, head) the q_len x head_dim floats of the
// bhsd order, but each block of 64 rows r0 .. r0 + n - 1 (n = min(64, q_len - r0): the last block may be
// short) stored as head_dim / 64 column panels of n x 64 floats, panel x at x n 64 floats from the
// block's start, row i of a panel 256 bytes, its 32-byte chunk u (columns 8u .. 8u + 7) at chunk
// u ^ (i % 8). One consumer warpgroup's step partial (64 rows x 64 columns, its shared-memory staging
// in the same order) is then n x 256 contiguous bytes: one bulk reduction (its first n rows), and the
// staging stores of a warp (8 rows x 4 float pairs of one chunk) hit every bank twice, no more. Same
// number of floats as dQ: the workspace's size does not change. Host-compiled by the tests, and so is
// dq_tiled_panel: the first float of panel `panel` of the block of n rows at row r0 (a multiple of 64; n = min(64,
// q_len - r0)), the panel's n x 64 floats contiguous from there (what a bulk reduction adds into).
__host__ __device__ __forceinline__ uint64_t dq_tiled_panel(uint32_t b, uint32_t h, uint32_t r0, uint32_t n,
                                                            uint32_t panel, uint32_t heads, uint32_t q_len,
                                                            uint32_t head_dim) {
  return (((uint64_t)b * heads + h) * q_len + r0) * head_dim + (uint64_t)panel * n * 64;
}
__host__ __device__ __forceinline__ uint64_t dq_tiled_offset(uint32_t b, uint32_t h, uint32_t r, uint32_t col,
                                                             uint32_t heads, uint32_t q_len, uint32_t head_dim) {
  const uint32_t r0 = r / 64 * 64, i = r - r0, n = q_len - r0 < 64 ? q_len - r0 : 64;
  return dq_tiled_panel(b, h, r0, n, col / 64, heads, q_len, head_dim) + i * 64 + ((((col % 64) / 8) ^ (i % 8)) * 8) +
         col % 8;
}

// Config::DETERMINISTIC where the Config has it (only specs with params.deterministic emit it: the
// wgmma kernel with dq_reduce bulk), else false.
template <class C, class = void>
struct deterministic_of : std::false_type {};
template <class C>
struct deterministic_of<C, std::void_t<decltype(C::DETERMINISTIC)>> : std::integral_constant<bool, C::DETERMINISTIC> {};

// Config::HEAD_GROUP where the Config has it (only specs with params.head_group emit it: the wgmma
// kernel), else 0: the main kernel's CTAs in KV-block-major order over every (sequence, KV head).
template <class C, class = void>
struct head_group_of : std::integral_constant<uint32_t, 0> {};
template <class C>
struct head_group_of<C, std::void_t<decltype(C::HEAD_GROUP)>> : std::integral_constant<uint32_t, C::HEAD_GROUP> {};

// The main kernel's CTA `cta` of a grid of `pairs` (sequence, KV head) pairs x `kv_blocks` blocks: its
// KV block and pair (sequence x KV_HEADS + KV head). `group` (params.head_group) cuts the pairs into
// groups of that many (the last may be smaller), one group after the other; inside a group, KV block
// j of every pair before block j + 1, as the whole grid is without groups (group 0 or >= pairs: the
// shipped order, block 0 of every pair first). Fewer pairs live at once share more of their Q, dO
// and dQ accumulator through L2 (each pair's KV blocks stream the same query blocks); inside a group
// the longest causal blocks still start first. Either way a pair's block j has a lower index than its
// block j + 1 (the deterministic mode's turns rely on it). Host-compiled by the tests.
struct KvCta {
  uint32_t block, pair;
};
__host__ __device__ __forceinline__ KvCta kv_cta(uint32_t cta, uint32_t pairs, uint32_t kv_blocks, uint32_t group) {
  if (group == 0 || group >= pairs) return KvCta{cta / pairs, cta % pairs};
  const uint32_t per_group = group * kv_blocks, g = cta / per_group, in = cta % per_group;
  const uint32_t size = pairs - g * group < group ? pairs - g * group : group;
  return KvCta{in / size, g * group + in % size};
}

// DETERMINISTIC: the dQ semaphores, one uint32 per (sequence, head, block of BLOCK_M query rows), index
// (b HEADS + h) ceil(q_len / BLOCK_M) + r / BLOCK_M, in dq_accum's workspace after its batch q_len
// HEADS HEAD_DIM floats (the caller's workspace grows by them: no fourth workspace pointer, the launchers'
// signatures stay as they are). The preprocess zeroes them with dq_accum; the wgmma kernel orders the
// bulk reductions into a query block's dQ by them (tsgen/attention_bwd_wgmma.cuh).
template <class C>
__host__ __device__ __forceinline__ uint32_t* dq_semaphores(const Problem& p) {
  return reinterpret_cast<uint32_t*>(p.dq_accum + (size_t)p.batch * p.q_len * C::HEADS * C::HEAD_DIM);
}

template <class C>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t out;
  if constexpr (C::BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&out, &v, 4);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&out, &v, 4);
  }
  return out;
}

// Two 16-bit elements of `pair` (pack2's order) as floats.
template <class C>
__device__ __forceinline__ float2 unpack2(uint32_t pair) {
  if constexpr (C::BF16) {
    __nv_bfloat162 v;
    memcpy(&v, &pair, 4);
    return __bfloat1622float2(v);
  } else {
    __half2 v;
    memcpy(&v, &pair, 4);
    return __half22float2(v);
  }
}

// Eight 16-bit elements (16 bytes) to floats and back (push_reduce's sums).
template <class C>
__device__ __forceinline__ void unpack8(uint4 x, float (&f)[8]) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = unpack2<C>(w[i]);
    f[2 * i] = v.x, f[2 * i + 1] = v.y;
  }
}

template <class C>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack2<C>(f[0], f[1]), pack2<C>(f[2], f[3]), pack2<C>(f[4], f[5]), pack2<C>(f[6], f[7]));
}

template <class C>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (C::BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8x8 16-bit matrices; lanes 8i .. 8i + 7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Fragment addressing of m16n8k16 (lane = 4 g + t): A rows g, g + 8 x columns 2t, 2t + 1 (+ 8);
// B columns (n) g x rows (k) 2t, 2t + 1 (+ 8); C rows g, g + 8 x columns 2t, 2t + 1.
//
// A (16 x 16) from row-major [m][k] at (m0, k0): matrices (m0, k0), (m0 + 8, k0), (m0, k0 + 8), (m0 + 8, k0 + 8).
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const uint16_t* s, int pitch, int m0, int k0, int lane) {
  ldmatrix_x4(a, s + (m0 + (lane & 15)) * pitch + k0 + (lane >> 4) * 8);
}

// A (16 x 16) of X = Y^T from Y stored row-major [k][m], at (m0, k0): the transposing load.
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const uint16_t* s, int pitch, int m0, int k0, int lane) {
  const int i = lane >> 3;
  ldmatrix_x4_trans(a, s + (k0 + (lane & 7) + (i >> 1) * 8) * pitch + m0 + (i & 1) * 8);
}

// B of two n-tiles (n0, n0 + 8) x k0 .. k0 + 15 from storage [n][k] (each n row contiguous in k):
// b[0], b[1] of n-tile n0, b[2], b[3] of n-tile n0 + 8.
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const uint16_t* s, int pitch, int n0, int k0, int lane) {
  ldmatrix_x4(b, s + (n0 + (lane & 7) + (lane >> 4) * 8) * pitch + k0 + ((lane >> 3) & 1) * 8);
}

// The same from storage [k][n] (each k row contiguous in n): the transposing load.
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const uint16_t* s, int pitch, int n0, int k0, int lane) {
  ldmatrix_x4_trans(b, s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * pitch + n0 + (lane >> 4) * 8);
}

// Rows r0 .. r0 + 63 of head h (of `heads`, `len` rows) into shared memory [64][PITCH]; rows past
// `len` are zero-filled. 16-byte loads, the CTA's threads over rows x chunks.
template <class C>
__device__ __forceinline__ void load_rows(uint16_t* s, const void* base, uint32_t b, uint32_t r0, uint32_t h,
                                          uint32_t heads, uint32_t len) {
  constexpr int CHUNKS = C::HEAD_DIM / 8;
  const uint16_t* g = static_cast<const uint16_t*>(base);
  for (int i = threadIdx.x; i < 64 * CHUNKS; i += THREADS) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < len) v = *reinterpret_cast<const uint4*>(g + row_offset<C>(b, r0 + r, h, heads, len) + c * 8);
    *reinterpret_cast<uint4*>(s + r * Layout<C>::PITCH + c * 8) = v;
  }
}

// 1. D = rowsum(dO * O), LSE2, dq_accum = 0. HEAD_DIM / 8 threads per (sequence, head, row), rows in
//    LSE's order; each thread reads 8 elements of O and of dO and zeroes 8 floats of dq_accum.
template <class C>
__device__ void preprocess(const Problem& p) {
  constexpr int TPR = C::HEAD_DIM / 8;
  const uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t row = idx / TPR, rows = (uint64_t)p.batch * C::HEADS * p.q_len;
  const int c = (int)(idx % TPR);
  float dot = 0.f;
  if (row < rows) {
    const uint32_t s = (uint32_t)(row % p.q_len), h = (uint32_t)(row / p.q_len % C::HEADS);
    const uint32_t b = (uint32_t)(row / p.q_len / C::HEADS);
    const size_t at = row_offset<C>(b, s, h, C::HEADS, p.q_len) + c * 8;
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.o) + at);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.dout) + at);
    const typename C::Element* oe = reinterpret_cast<const typename C::Element*>(&o);
    const typename C::Element* de = reinterpret_cast<const typename C::Element*>(&d);
#pragma unroll
    for (int e = 0; e < 8; ++e) dot += (float)oe[e] * (float)de[e];
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + at);
    acc[0] = make_float4(0.f, 0.f, 0.f, 0.f);
    acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    // DETERMINISTIC: the query block's semaphore, by the first thread of its first row (in stream order before
    // the main kernel, as dq_accum's zeros: a call's turns start at 0 whatever the last call left)
    if constexpr (deterministic_of<C>::value)
      if (c == 0 && s % BLOCK_M == 0)
        dq_semaphores<C>(p)[row / p.q_len * ((p.q_len + BLOCK_M - 1) / BLOCK_M) + s / BLOCK_M] = 0;
  }
  // TPR (8 or 16) consecutive lanes hold one row: a butterfly within the group
#pragma unroll
  for (int m = TPR / 2; m > 0; m >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, m);
  if (row < rows && c == 0) {
    const float lse = p.lse[row];
    p.dsum[row] = dot;
    p.lse2[row] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
  }
}

// 2. The main kernel (see the top of this file).
template <class C>
__device__ void main_kernel(const Problem& p) {
  using L = Layout<C>;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint16_t* smem = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t *ks = smem + L::K, *vs = smem + L::V, *qs = smem + L::Q, *dos = smem + L::DO, *dss = smem + L::DS;
  float* lse2s = reinterpret_cast<float*>(smem_raw + L::LSE2_BYTES);
  float* dsums = reinterpret_cast<float*>(smem_raw + L::DSUM_BYTES);
  constexpr int GROUP = C::HEADS / C::KV_HEADS, NT = C::HEAD_DIM / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;

  const uint32_t heads_x_batch = p.batch * C::KV_HEADS;
  const uint32_t j = blockIdx.x / heads_x_batch;  // the KV block: block 0 of every head first
  const uint32_t hk = blockIdx.x % heads_x_batch % C::KV_HEADS, b = blockIdx.x % heads_x_batch / C::KV_HEADS;
  const uint32_t k0 = j * BLOCK_N;
  const int32_t first_key = p.kv_offset + (int32_t)k0;

  load_rows<C>(ks, p.k, b, k0, hk, C::KV_HEADS, p.kv_len);
  load_rows<C>(vs, p.v, b, k0, hk, C::KV_HEADS, p.kv_len);

  float dk[NT][4], dv[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = 0.f, dv[n][e] = 0.f;

  const uint32_t q_blocks = (p.q_len + BLOCK_M - 1) / BLOCK_M;
  const int key_lo = warp * 16 + g;  // this thread's keys in the block: key_lo and key_lo + 8
  for (uint32_t hq = hk * GROUP; hq < (hk + 1) * GROUP; ++hq) {
    for (uint32_t qb = 0; qb < q_blocks; ++qb) {
      const uint32_t r0 = qb * BLOCK_M, r1 = min(r0 + BLOCK_M, p.q_len);
      if (C::CAUSAL && !rows_see_keys(p, (int32_t)r0, (int32_t)r1, first_key)) continue;  // uniform over the CTA
      __syncthreads();  // the previous block's products are done with Q, dO, dS, LSE2, D
      load_rows<C>(qs, p.q, b, r0, hq, C::HEADS, p.q_len);
      load_rows<C>(dos, p.dout, b, r0, hq, C::HEADS, p.q_len);
      for (int i = threadIdx.x; i < BLOCK_M; i += THREADS) {
        const size_t at = ((size_t)b * C::HEADS + hq) * p.q_len + r0 + i;
        const bool in = r0 + i < p.q_len;
        lse2s[i] = in ? p.lse2[at] : INFINITY;  // padding rows: P = 0
        dsums[i] = in ? p.dsum[at] : 0.f;
      }
      __syncthreads();

      // S^T = K_j Q_i^T and dP^T = V_j dO_i^T: 16 keys x 64 queries per warp
      float s[8][4], dp[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = 0.f, dp[n][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < C::HEAD_DIM; kk += 16) {
        uint32_t ak[4], av[4];
        load_a(ak, ks, L::PITCH, warp * 16, kk, lane);
        load_a(av, vs, L::PITCH, warp * 16, kk, lane);
#pragma unroll
        for (int n = 0; n < 8; n += 2) {
          uint32_t bq[4], bd[4];
          load_b_nk(bq, qs, L::PITCH, n * 8, kk, lane);
          load_b_nk(bd, dos, L::PITCH, n * 8, kk, lane);
          mma16816<C>(s[n], ak, bq[0], bq[1]);
          mma16816<C>(s[n + 1], ak, bq[2], bq[3]);
          mma16816<C>(dp[n], av, bd[0], bd[1]);
          mma16816<C>(dp[n + 1], av, bd[2], bd[3]);
        }
      }

      // P^T and dS^T, element-wise (in place of S^T and dP^T)
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key_lo + (e >> 1) * 8, row = n * 8 + 2 * t + (e & 1);
          bool seen = k0 + key < p.kv_len;
          if (C::CAUSAL) seen = seen && first_key + key <= query_position(p, (int32_t)(r0 + row));
          const float pr = seen ? exp2f(s[n][e] * C::SCALE_LOG2 - lse2s[row]) : 0.f;
          s[n][e] = pr;
          dp[n][e] = pr * (dp[n][e] - dsums[row]);
        }
      }

      // dV_j += P^T dO_i, dK_j += dS^T Q_i (k = the 64 queries, 16 at a time)
#pragma unroll
      for (int kq = 0; kq < 4; ++kq) {
        const uint32_t ap[4] = {pack2<C>(s[2 * kq][0], s[2 * kq][1]), pack2<C>(s[2 * kq][2], s[2 * kq][3]),
                                pack2<C>(s[2 * kq + 1][0], s[2 * kq + 1][1]),
                                pack2<C>(s[2 * kq + 1][2], s[2 * kq + 1][3])};
        const uint32_t ad[4] = {pack2<C>(dp[2 * kq][0], dp[2 * kq][1]), pack2<C>(dp[2 * kq][2], dp[2 * kq][3]),
                                pack2<C>(dp[2 * kq + 1][0], dp[2 * kq + 1][1]),
                                pack2<C>(dp[2 * kq + 1][2], dp[2 * kq + 1][3])};
        // dS^T (16-bit) to shared memory for the dQ product: [key][query]
        uint32_t* row_lo = reinterpret_cast<uint32_t*>(dss + key_lo * L::DS_PITCH + kq * 16 + 2 * t);
        uint32_t* row_hi = reinterpret_cast<uint32_t*>(dss + (key_lo + 8) * L::DS_PITCH + kq * 16 + 2 * t);
        row_lo[0] = ad[0], row_hi[0] = ad[1], row_lo[4] = ad[2], row_hi[4] = ad[3];  // +4 words: columns + 8
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
          uint32_t bd[4], bq[4];
          load_b_kn(bd, dos, L::PITCH, n * 8, kq * 16, lane);
          load_b_kn(bq, qs, L::PITCH, n * 8, kq * 16, lane);
          mma16816<C>(dv[n], ap, bd[0], bd[1]);
          mma16816<C>(dv[n + 1], ap, bd[2], bd[3]);
          mma16816<C>(dk[n], ad, bq[0], bq[1]);
          mma16816<C>(dk[n + 1], ad, bq[2], bq[3]);
        }
      }
      __syncthreads();  // dS^T of all four warps in shared memory

      // dQ_i rows 16 warp .. + 15 = dS K_j (k = the 64 keys), 64 columns at a time, added into dq_accum
      const uint32_t q_row = r0 + warp * 16 + g;
      float* dq_lo = p.dq_accum + row_offset<C>(b, q_row, hq, C::HEADS, p.q_len);
      float* dq_hi = p.dq_accum + row_offset<C>(b, q_row + 8, hq, C::HEADS, p.q_len);
#pragma unroll
      for (int c0 = 0; c0 < C::HEAD_DIM; c0 += 64) {
        float acc[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < BLOCK_N; kk += 16) {
          uint32_t a[4];
          load_a_trans(a, dss, L::DS_PITCH, warp * 16, kk, lane);
#pragma unroll
          for (int n = 0; n < 8; n += 2) {
            uint32_t bk[4];
            load_b_kn(bk, ks, L::PITCH, c0 + n * 8, kk, lane);
            mma16816<C>(acc[n], a, bk[0], bk[1]);
            mma16816<C>(acc[n + 1], a, bk[2], bk[3]);
          }
        }
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const int col = c0 + n * 8 + 2 * t;
          // scalar reductions: sm_90's float2 atomicAdd (one per pair) made the fp16 causal hd 128
          // variant spill 32 bytes (its register pairs)
          if (q_row < p.q_len) atomicAdd(dq_lo + col, acc[n][0]), atomicAdd(dq_lo + col + 1, acc[n][1]);
          if (q_row + 8 < p.q_len) atomicAdd(dq_hi + col, acc[n][2]), atomicAdd(dq_hi + col + 1, acc[n][3]);
        }
      }
    }
  }

  // dK (times the scale) and dV, rows past kv_len clipped
  const uint32_t key = k0 + key_lo;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (key + half * 8 >= p.kv_len) continue;
    const size_t at = row_offset<C>(b, key + half * 8, hk, C::KV_HEADS, p.kv_len);
    uint32_t* dkg = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.dk) + at);
    uint32_t* dvg = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.dv) + at);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      dkg[n * 4 + t] = pack2<C>(dk[n][2 * half] * C::SCALE, dk[n][2 * half + 1] * C::SCALE);
      dvg[n * 4 + t] = pack2<C>(dv[n][2 * half], dv[n][2 * half + 1]);
    }
  }
}

// 3. dQ = 16-bit(SCALE * dq_accum).
//    Not DQ_TILED (dq_accum in dQ's layout): 4 elements per thread per step, a grid-stride loop.
//    DQ_TILED: one CTA per (64-row block, head, sequence) tile (grid: launch_convert): the tile's
//    n x HEAD_DIM floats are one contiguous run of dq_accum (dq_tiled_offset; n = the block's rows),
//    read as 32-byte chunks in order (a warp: 1 KiB contiguous), each chunk 8 columns of one dQ row,
//    written as one 16-byte store (a row's 64-column panel: 8 threads, 128 contiguous bytes). Every
//    index is a shift, mask, add or a multiply by a constant; the tile comes from blockIdx (no
//    division); ConvertTiled says which chunk goes where.
constexpr int CONVERT_CHUNKS = BLOCK_M * 8 / CONVERT_THREADS;  // 32-byte chunks per thread per 64-column panel

// DQ_TILED's map (host-compiled by the tests): tile (b, h, r0) of n = rows(r0, q_len) rows starts
// at float src_tile(..) of dq_accum and element dst_tile(..) of dQ; chunk k (0 .. CONVERT_CHUNKS - 1)
// of panel x (0 .. HEAD_DIM / 64 - 1) of thread tid is the tile's 8 floats from `from` (32-byte
// slot s = tid % 8 of the panel's row i: floats x n 64 + 64 i + 8 s), dQ's elements from `to`: row
// i, columns 64 x + 8 (s ^ (i % 8)) .. + 7 (dq_tiled_offset's chunk swizzle); it exists when i < n.
template <uint32_t HEADS, uint32_t HEAD_DIM, bool BHSD>
struct ConvertTiled {
  static constexpr uint32_t ROW_STRIDE = BHSD ? HEAD_DIM : HEADS * HEAD_DIM;  // dQ's, in elements
  static __host__ __device__ __forceinline__ uint32_t rows(uint32_t r0, uint32_t q_len) {
    return q_len - r0 < BLOCK_M ? q_len - r0 : BLOCK_M;
  }
  static __host__ __device__ __forceinline__ uint64_t src_tile(uint32_t b, uint32_t h, uint32_t r0, uint32_t q_len) {
    return (((uint64_t)b * HEADS + h) * q_len + r0) * HEAD_DIM;
  }
  static __host__ __device__ __forceinline__ uint64_t dst_tile(uint32_t b, uint32_t h, uint32_t r0, uint32_t q_len) {
    return BHSD ? src_tile(b, h, r0, q_len) : (((uint64_t)b * q_len + r0) * HEADS + h) * HEAD_DIM;
  }
  static __host__ __device__ __forceinline__ void chunk(uint32_t tid, uint32_t x, uint32_t k, uint32_t n,
                                                        uint32_t& row, uint32_t& from, uint32_t& to) {
    const uint32_t slot = tid % 8, i = tid / 8 + k * (CONVERT_THREADS / 8);
    row = i;
    from = x * n * 64 + 64 * i + 8 * slot;
    to = i * ROW_STRIDE + 64 * x + 8 * (slot ^ (i % 8));
  }
};

template <class C>
__device__ void convert(const Problem& p) {
  if constexpr (C::DQ_TILED) {
    static_assert(BLOCK_M * 8 % CONVERT_THREADS == 0, "whole passes of a panel's 64 x 8 chunks");
    using T = ConvertTiled<C::HEADS, C::HEAD_DIM, C::BHSD>;
    constexpr int PANELS = C::HEAD_DIM / 64;
    const uint32_t h = blockIdx.y, r0 = blockIdx.x * BLOCK_M, n = T::rows(r0, p.q_len);
    for (uint32_t b = blockIdx.z; b < p.batch; b += gridDim.z) {
      const float4* src = reinterpret_cast<const float4*>(p.dq_accum + T::src_tile(b, h, r0, p.q_len));
      uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.dq) + T::dst_tile(b, h, r0, p.q_len));
      float4 v[PANELS][CONVERT_CHUNKS][2];  // every load of the tile issued before the first store
#pragma unroll
      for (int x = 0; x < PANELS; ++x)
#pragma unroll
        for (int k = 0; k < CONVERT_CHUNKS; ++k) {
          uint32_t row, from, to;
          T::chunk(threadIdx.x, x, k, n, row, from, to);
          if (row < n) v[x][k][0] = src[from / 4], v[x][k][1] = src[from / 4 + 1];
        }
#pragma unroll
      for (int x = 0; x < PANELS; ++x)
#pragma unroll
        for (int k = 0; k < CONVERT_CHUNKS; ++k) {
          uint32_t row, from, to;
          T::chunk(threadIdx.x, x, k, n, row, from, to);
          if (row < n) {
            const float4 a = v[x][k][0], c = v[x][k][1];
            dst[to / 8] =
                make_uint4(pack2<C>(a.x * C::SCALE, a.y * C::SCALE), pack2<C>(a.z * C::SCALE, a.w * C::SCALE),
                           pack2<C>(c.x * C::SCALE, c.y * C::SCALE), pack2<C>(c.z * C::SCALE, c.w * C::SCALE));
          }
        }
    }
  } else {
    const uint64_t n4 = (uint64_t)p.batch * p.q_len * C::HEADS * C::HEAD_DIM / 4;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum);
    uint2* dst = reinterpret_cast<uint2*>(p.dq);
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (uint64_t)gridDim.x * blockDim.x) {
      const float4 a = src[i];
      dst[i] = make_uint2(pack2<C>(a.x * C::SCALE, a.y * C::SCALE), pack2<C>(a.z * C::SCALE, a.w * C::SCALE));
    }
  }
}

// The checked sizes of one call (prepare_call): the launches' grids.
struct Sizes {
  bool empty;            // batch 0: nothing to do
  uint64_t rows;         // batch * HEADS * q_len (the preprocess's rows, LSE's elements)
  uint64_t pre_blocks;   // of the preprocess
  uint64_t ctas;         // the main kernel's items: KV blocks x KV heads x batch
  uint64_t grid;         // its CTAs: ctas, or with a tail split (wgmma TAIL_SPLIT) more
};

// Checks a call's arguments and fills the Problem (positions as the forward's; q_split >= q_len:
// one query segment) and the grids; `block_n`: the main kernel's keys per CTA. Shared by both
// main kernels (mma.sync here, wgmma in tsgen/attention_bwd_wgmma.cuh).
template <class C>
static cudaError_t prepare_call(const Problem& given, uint64_t batch, uint64_t q_len, uint64_t kv_len,
                                int64_t q_offset, int64_t q_split, int64_t q_offset2, int64_t kv_offset,
                                uint32_t block_n, Problem& p, Sizes& z) {
  p = given;
  z = Sizes{batch == 0, 0, 0, 0, 0};
  if (batch == 0) return cudaSuccess;
  if (q_len > MAX_LEN || kv_len > MAX_LEN || batch > MAX_LEN || p.q == nullptr || p.k == nullptr ||
      p.v == nullptr || p.o == nullptr || p.dout == nullptr || p.lse == nullptr || p.dq == nullptr ||
      p.dk == nullptr || p.dv == nullptr || p.dq_accum == nullptr || p.dsum == nullptr || p.lse2 == nullptr)
    return cudaErrorInvalidValue;
  const int64_t limit = (int64_t)1 << 30;
  if (q_offset < -limit || q_offset > limit || q_offset2 < -limit || q_offset2 > limit || kv_offset < -limit ||
      kv_offset > limit)
    return cudaErrorInvalidValue;
  p.batch = (uint32_t)batch, p.q_len = (uint32_t)q_len, p.kv_len = (uint32_t)kv_len;
  p.q_offset = (int32_t)q_offset, p.q_offset2 = (int32_t)q_offset2, p.kv_offset = (int32_t)kv_offset;
  p.q_split = (int32_t)(q_split < 0 ? 0 : q_split > (int64_t)q_len ? (int64_t)q_len : q_split);
  p.kv_blocks = (uint32_t)((kv_len + block_n - 1) / block_n);
  z.rows = batch * C::HEADS * q_len;
  z.pre_blocks = (z.rows * (C::HEAD_DIM / 8) + PRE_THREADS - 1) / PRE_THREADS;
  z.ctas = z.grid = (uint64_t)p.kv_blocks * C::KV_HEADS * batch;
  if (z.pre_blocks > 0x7FFFFFFFull || z.ctas > 0x7FFFFFFFull) return cudaErrorInvalidValue;
  p.tail_first = (uint32_t)z.ctas, p.tail_parts = 1;  // no item split (the wgmma main kernel's prepare may split)
  return cudaSuccess;
}

template <class C, class Pre>
static void launch_preprocess(Pre pre, const Problem& p, const Sizes& z, cudaStream_t stream) {
  if (z.rows > 0) pre<<<(unsigned)z.pre_blocks, PRE_THREADS, 0, stream>>>(p);
}

template <class C, class Convert>
static void launch_convert(Convert conv, const Problem& p, const Sizes& z, cudaStream_t stream) {
  if (z.rows == 0) return;
  if constexpr (C::DQ_TILED) {  // one CTA per (64-row block, head, sequence); sequences past 65535 by a loop
    const dim3 grid((p.q_len + BLOCK_M - 1) / BLOCK_M, C::HEADS, p.batch < 65535 ? p.batch : 65535);
    conv<<<grid, CONVERT_THREADS, 0, stream>>>(p);
    return;
  }
  const uint64_t n4 = z.rows * C::HEAD_DIM / 4;
  const uint64_t blocks = (n4 + CONVERT_THREADS - 1) / CONVERT_THREADS;
  conv<<<(unsigned)(blocks < 4096 ? blocks : 4096), CONVERT_THREADS, 0, stream>>>(p);
}

// One backward call: the preprocess, the main kernel and the convert pass on `stream`, shared by
// both main kernels. `main` is the main kernel's launch: main.prepare(p, z) (host set-up, before
// anything is launched: the shared-memory opt-in, descriptors) and main.launch(p, z, stream).
// Workspace: dq_accum (batch * q_len * HEADS * HEAD_DIM floats; Config::DETERMINISTIC: and batch *
// HEADS * ceil(q_len / BLOCK_M) uint32 after them, dq_semaphores; Config::TAIL_SPLIT: and the wgmma kernel's
// TAIL_ITEMS tail slots after them, tail_accum), dsum and lse2 (batch * HEADS * q_len floats each). Positions as the forward's (q_split >= q_len: one query segment).
template <class C, class Pre, class Convert, class Main>
static cudaError_t call(Pre pre, Convert conv, Main& main, uint32_t block_n, const Problem& given, uint64_t batch,
                        uint64_t q_len, uint64_t kv_len, int64_t q_offset, int64_t q_split, int64_t q_offset2,
                        int64_t kv_offset, cudaStream_t stream) {
  Problem p;
  Sizes z;
  cudaError_t err =
      prepare_call<C>(given, batch, q_len, kv_len, q_offset, q_split, q_offset2, kv_offset, block_n, p, z);
  if (err != cudaSuccess || z.empty) return err;
  err = main.prepare(p, z);  // may split the grid's last items (p.tail_first, p.tail_parts, z.grid)
  if (err != cudaSuccess) return err;
  launch_preprocess<C>(pre, p, z, stream);
  if (z.ctas > 0 && (err = main.launch(p, z, stream)) != cudaSuccess) return err;
  launch_convert<C>(conv, p, z, stream);
  return cudaGetLastError();
}

// The mma.sync main kernel's launch (for `call`).
template <class C, class Kernel>
struct MmaSyncMain {
  Kernel kernel;
  // the shared-memory opt-in: per call (a host call of microseconds, against milliseconds of work)
  cudaError_t prepare(Problem&, Sizes&) {
    return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                Layout<C>::SMEM_BYTES);
  }
  cudaError_t launch(const Problem& p, const Sizes& z, cudaStream_t stream) {
    kernel<<<(unsigned)z.grid, THREADS, Layout<C>::SMEM_BYTES, stream>>>(p);
    return cudaGetLastError();
  }
};

// One backward call with the mma.sync main kernel.
template <class C, class Pre, class Main, class Convert>
static cudaError_t launch(Pre pre, Main main, Convert conv, const Problem& given, uint64_t batch, uint64_t q_len,
                          uint64_t kv_len, int64_t q_offset, int64_t q_split, int64_t q_offset2, int64_t kv_offset,
                          cudaStream_t stream) {
  MmaSyncMain<C, Main> m{main};
  return call<C>(pre, conv, m, BLOCK_N, given, batch, q_len, kv_len, q_offset, q_split, q_offset2, kv_offset, stream);
}

}  // namespace attention_bwd
}  // namespace tsgen

#endif  // TSGEN_ATTENTION_BWD_CUH
