// tsgen/moe.cuh -- MoE expert-parallel dispatch and combine: normal mode (bf16 or fp8 rows) and low-latency mode.
//
// Hand-written; included by generated MoE sources.
//
// Experts are placed in contiguous runs: rank d holds experts [d * L, (d + 1) * L), L = E / W.
// A token goes to rank d once when any of its top-k experts lives there ("its destination
// ranks"; expert ids outside [0, E), e.g. -1, count as none).
//
// dispatch (one kernel, every block of every rank resident at once):
//   1. layout: every block scans topk_idx of all tokens: tokens per destination rank (in all and
//      before its own contiguous chunk of tokens); block 0 also counts (token, expert) pairs per
//      expert and writes this rank's row of the counts matrix (tokens to each rank) and the
//      per-expert counts of each destination's experts into that destination's `cnt`, then
//      raises sig[COUNTS + rank] there to the epoch.
//   2. every block waits for all ranks' rows: rank s's rows for rank d start at
//      base(s, d) = sum_{j < s} counts[j][d], so d receives its rows grouped by source rank, and
//      inside one source in source token order (position = tokens before it that go to d); block 0
//      also copies what recv_counts will report (rows from each source, pairs per local expert)
//      out of `cnt` into shared memory here, before its arrivals (see "Back-to-back calls").
//   3. every block pushes its tokens: one warp per token, each 16-byte vector of the row loaded
//      once and stored to every destination rank; lanes write the metadata: per top-k slot the
//      local expert id (-1 when that expert is not on the destination) and its weight (0 there),
//      and the handle (source rank, source token). A row past the destination's receive
//      capacity is not written: the overflow is reported (recv_counts[1], a printf), never silent.
//   4. every block raises sig[DATA + rank] on every destination by one (release); block 0 waits
//      for gridDim.x arrivals from every source and writes recv_counts (from shared memory, not
//      `cnt`), and this call's token count into sig[TOKENS] (combine checks its count against it).
// combine (one kernel, on its own grid: params.combine_blocks, default dispatch's; every block of
// every rank resident at once, like dispatch's):
//   1. rows home (the first half of each block's warps, the senders): this rank's receive buffer
//      is cut into chunks of CHUNK rows, dealt round robin over the grid's sender warps; a warp
//      pushes each row r of its chunk from another rank s back to s, into s's comb[token][this
//      rank], then raises chunk_sig[rank][chunk] to the epoch on every rank that had rows in it
//      (release, sys scope, after __syncwarp: the lanes' row stores are ordered before it). A
//      rank's rows of its own tokens stay in y: dispatch wrote where (sent_row[token][rank]).
//      The order (params.combine_order): "rows", the chunks in row order, so all of a rank's
//      senders push to one peer at a time (the rows are grouped by source), the same peer on every
//      rank (W > 2: every rank's first rows are rank 0's); "peers", the peers' chunks interleaved,
//      every sender round pushing to every peer at once, each peer's rows at one pace.
//      How many (params.combine_senders, default half the block's warps) and the vectors each lane
//      loads before it stores (params.combine_send_unroll, default UNROLL): the link is shared by
//      the sender warps, so one round (a chunk a warp) lands about at once, G x CHUNK rows at a time
//      (docs/design/moe.md, "World 2: combine's waves"); fewer senders make the waves smaller.
//   2. sums (the other warps from the start, the senders once their chunks are out): block b sums
//      tokens b, b + gridDim.x, ... in that order, taken from a block-local counter; a token
//      waits only for the chunks holding its rows on other ranks (sent_row[token][d] / CHUNK,
//      acquire, sys scope), then sums its rows over its destination ranks in fp32, in rank order
//      (each scaled by the sum of the token's top-k weights of experts on that rank when
//      WEIGHTED), rounded once to bf16, original order. Rank d pushes its chunks in row order and
//      a source's rows on d are in its token order, so tokens are summed about as their rows
//      arrive: the sums run under the transfer instead of after a barrier across the ranks.
//      Reading y anywhere in combine is safe: a peer writes rows of the next call into this rank's
//      receive buffer (which y may be) only once every rank's next counts row arrived, and this
//      rank writes its own after this combine.
//
// Back-to-back calls: signals count up with the call number (dispatch and combine each have
// their own call counter); nothing is reset. Call order per rank: dispatch, (experts), combine,
// dispatch, ...: a rank writes its next counts only after its combine ended, i.e. after it read
// every row of its tokens (its inbox: waited for chunk by chunk; its own rows in y) and pushed
// every row of its receive buffer bound for other ranks; a peer writes its next rows (into this
// rank's receive buffer) and its next combine's rows (into this rank's inbox) only after every
// rank's next counts row arrived (a peer's next combine follows its next dispatch), so after this
// rank's combine ended. `cnt` is the exception: a peer s with no rows on this rank d never waits
// for d in combine, so s may start its next dispatch, and write its next counts into d's `cnt`,
// while d is still in this dispatch. What bounds it: s's dispatch ends only after its block 0 saw
// every block's data arrival of d (step 4), and d reads `cnt` only before its arrivals: every
// block in step 2, where block 0 also copies what recv_counts reports into shared memory (step 4's
// leading __syncthreads orders those reads before the arrival's release). So every read of `cnt`
// of call n comes before any write of call n + 1 (also for fp8, which shares this dispatch). A
// chunk signal of call n + 1 (value n + 1) satisfies a wait of call n only where the rows it
// announces are already the next call's, which the argument above rules out.
#ifndef TSGEN_MOE_CUH
#define TSGEN_MOE_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "tsgen/ptx.cuh"
#include "tsgen/sync.cuh"
#include "tsgen/copy.cuh"

namespace tsgen {
namespace moe {

// sig layout (uint64): [SIG_COUNTS][WMAX] counts rows arrived, [SIG_DATA][WMAX] data arrivals, then
// one word, sig[SIG_TOKENS * WMAX]: this rank's token count at its last dispatch (local; a combine
// with more tokens stops with both counts named). (Combine's signals are per chunk: chunk_sig.)
enum { SIG_COUNTS = 0, SIG_DATA = 1, SIG_TOKENS = 2 };

// recv_counts layout (int32): [0] rows received (may exceed the receive capacity), [1] flags,
// [2, 2 + WMAX) rows from each source rank, [2 + WMAX, 2 + WMAX + E) (token, expert) pairs per
// local expert (entries past the world's L experts are 0).
enum { FLAG_RECV_OVERFLOW = 1, FLAG_SENT_DROPPED = 2 };

struct Buffers {
  const __nv_bfloat16* x;  // [tokens][HIDDEN]
  const int32_t* topk_idx;  // [tokens][TOPK], -1 = none
  const float* topk_weights;  // [tokens][TOPK]
  __nv_bfloat16* out;       // [tokens][HIDDEN] combine's output
  int32_t* recv_counts;     // see above
  __nv_bfloat16* recv_x;    // [RECV][HIDDEN] (payload bf16)
  uint8_t* recv_q;          // [RECV][HIDDEN] e4m3 (payload fp8)
  float* recv_scale;        // [RECV][HIDDEN / 128] (payload fp8): channel c of row r is recv_q * recv_scale[r][c / 128]
  int32_t* recv_idx;        // [RECV][TOPK] local expert id or -1
  float* recv_w;            // [RECV][TOPK]
  int32_t* handle;          // [RECV][2] (source rank, source token)
  int32_t* sent_row;        // [CAP][WMAX] token t's row on rank d (on this rank: in combine's y), -1: none
  __nv_bfloat16* comb;      // [CAP][WMAX][HIDDEN] combine's inbox, slot = sending rank
  __nv_bfloat16* recv_bf16;  // [RECV][HIDDEN] (payload fp8) dequantize's output
  int32_t* cnt;             // [WMAX][WMAX] counts matrix, then [WMAX][EXPERTS] per-expert counts
  uint64_t* sig;            // [2][WMAX], then the last dispatch's token count (SIG_TOKENS)
  uint64_t* chunk_sig;      // [WMAX][ceil(RECV / CHUNK)]: [d][c] = the last combine call whose chunk c of
                            // rank d's receive buffer was pushed here (combine's epoch)
};

// The destination-rank mask of token t (bit d: some top-k expert lives on rank d).
template <class C>
static __device__ __forceinline__ uint32_t route_mask(const int32_t* topk_idx, int t) {
  constexpr int L = C::EXPERTS / C::WORLD;
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < C::TOPK; ++k) {
    const int e = __ldg(topk_idx + (size_t)t * C::TOPK + k);
    if (e >= 0 && e < C::EXPERTS) m |= 1u << (e / L);
  }
  return m;
}

static __device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Contiguous token chunk of block b: [lo, hi).
static __device__ __forceinline__ void token_chunk(int tokens, int b, int blocks, int* lo, int* hi) {
  const int per = (tokens + blocks - 1) / blocks;
  *lo = min(tokens, b * per);
  *hi = min(tokens, *lo + per);
}

// The sums' work split: `parts` warps a token where the warps outnumber the tokens (decode sizes: 128
// tokens on 512 warps), each part taking every parts-th slice of 32 lanes' vectors of the row.
static __device__ __forceinline__ int sum_parts(int tokens, int nwarps) {
  return tokens > 0 ? max(1, nwarps / tokens) : 1;
}

// One warp copies a row of HIDDEN bf16 from src to dst (16-byte vectors, U in flight per lane).
template <class C, int U = C::UNROLL>
static __device__ __forceinline__ void copy_row(__nv_bfloat16* dst_, const __nv_bfloat16* src_, int lane) {
  constexpr int VECS = C::HIDDEN / 8;
  const uint4* src = reinterpret_cast<const uint4*>(src_);
  uint4* dst = reinterpret_cast<uint4*>(dst_);
  for (int v0 = lane; v0 < VECS; v0 += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v0 + u * 32 < VECS) v[u] = ld_nc_na_global_v4(src + v0 + u * 32);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v0 + u * 32 < VECS) st_na_global_v4(dst + v0 + u * 32, v[u]);
  }
}

// Normal combine's sender warps per block and their copy's unroll: the Config's SENDERS and
// SEND_UNROLL where the module has them (params.combine_senders / combine_send_unroll), else half the
// block's warps and UNROLL (the sources rendered without those params keep this default).
template <class C, class = void>
struct CombineSenders {
  static constexpr int warps = C::THREADS / 32 > 1 ? C::THREADS / 64 : 1, unroll = C::UNROLL;
};
template <class C>
struct CombineSenders<C, decltype((void)C::SENDERS)> {
  static constexpr int warps = C::SENDERS, unroll = C::SEND_UNROLL;
  static_assert(warps >= 1 && warps <= C::THREADS / 32 && unroll >= 1, "combine's sender warps: 1 .. the block's warps");
};

// FP8 (e4m3) payload: one fp32 scale per token per 128 channels, scale = max(amax, 1e-4) / 448
// (448: e4m3's largest finite value), q = round-to-nearest-even, saturating, of x * (448 / amax).
static __device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

static __device__ __forceinline__ float2 e4m3x2_to_float2(uint16_t v) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// One lane's chunk of 16 channels (two 16-byte vectors of bf16), both quantization steps:
// chunk_floats, its channels as fp32 and their largest |x| (from 0, in channel order: a group's amax is
// the max of its 8 lanes'), and chunk_e4m3, the 16 e4m3 codes of f * inv packed into 16 bytes.
static __device__ __forceinline__ float chunk_floats(const uint4 (&v)[2], float (&f)[16]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(v);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
    amax = fmaxf(amax, fmaxf(fabsf(p.x), fabsf(p.y)));
  }
  return amax;
}

// The same amax as chunk_floats's, in bf16 pairs (max is exact and bf16 -> fp32 keeps the order;
// __hmax2 skips a NaN as fmaxf does; where bf16 arithmetic flushes subnormals, a group of only
// subnormals and zeros is under the 1e-4 floor either way), for a send that quantizes its chunks after
// every amax is known: its fp32 channels are computed once, where they are multiplied, not kept alive
// in between.
static __device__ __forceinline__ float chunk_amax(const uint4 (&v)[2]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(v);
  __nv_bfloat162 m = __habs2(h[0]);
#pragma unroll
  for (int i = 1; i < 8; ++i) m = __hmax2(m, __habs2(h[i]));
  const float2 p = __bfloat1622float2(m);
  return fmaxf(0.f, fmaxf(p.x, p.y));
}

static __device__ __forceinline__ uint4 chunk_e4m3(const float (&f)[16], float inv) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = (uint32_t)e4m3x2(f[4 * i] * inv, f[4 * i + 1] * inv) |
           (uint32_t)e4m3x2(f[4 * i + 2] * inv, f[4 * i + 3] * inv) << 16;
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// A group's scale and the factor its channels are multiplied by, from its amax (the max over its lanes).
static __device__ __forceinline__ void group_scale(float amax, float* scale, float* inv) {
  amax = fmaxf(amax, 1e-4f);
  *scale = amax / 448.f;
  *inv = 448.f / amax;
}

// A pass's 16-channel chunks of one lane: U of them, chunk base + 32 u + lane, each as two 16-byte loads
// (zeros past the row's CHUNKS), all issued before any is used.
template <int U, int CHUNKS>
static __device__ __forceinline__ void load_chunks(uint4 (&v)[U][2], const uint4* src, int base, int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = base + u * 32 + lane;
    if (c < CHUNKS) {
      v[u][0] = ld_nc_na_global_v4(src + 2 * c);
      v[u][1] = ld_nc_na_global_v4(src + 2 * c + 1);
    } else {
      v[u][0] = v[u][1] = make_uint4(0, 0, 0, 0);
    }
  }
}

// One warp quantizes the row at src (HIDDEN bf16, HIDDEN % 128 == 0) and stores the e4m3 bytes and
// scales to every destination rank in mask `mm`, at row `pos[d]` of that rank's recv_q / recv_scale.
// The quantization is fused into the send, shaped like the bf16 copy: a lane's chunk is 16 channels
// (two 16-byte loads in, one 16-byte store of e4m3 out), 8 lanes make a 128-channel group (amax over
// 3 shuffles), and UNROLL chunks per lane are loaded before any is converted (2 x UNROLL 16-byte loads
// in flight per lane; issue 34: one 16-byte load per lane at a time, 8-byte stores, left the fp8
// dispatch latency-bound and slower than the bf16 one).
template <class C>
static __device__ __forceinline__ void push_row_fp8(const __nv_bfloat16* src_, uint32_t mm, const int* pos,
                                                    uint8_t* recv_q, float* recv_scale, char* const* peers,
                                                    int rank, int lane) {
  constexpr int CHUNKS = C::HIDDEN / 16, GROUPS = C::HIDDEN / 128, PASS = 32 * C::UNROLL;
  const uint4* src = reinterpret_cast<const uint4*>(src_);
  for (int base = 0; base < CHUNKS; base += PASS) {  // warp-uniform: every lane takes part in the shuffles
    uint4 v[C::UNROLL][2];
    load_chunks<C::UNROLL, CHUNKS>(v, src, base, lane);
#pragma unroll
    for (int u = 0; u < C::UNROLL; ++u) {
      if (base + u * 32 >= CHUNKS) break;  // warp-uniform; CHUNKS % 8 == 0: a group is all in or all out
      const int c = base + u * 32 + lane;
      float f[16], amax = chunk_floats(v[u], f), scale, inv;
#pragma unroll
      for (int off = 4; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      group_scale(amax, &scale, &inv);
      const uint4 q = chunk_e4m3(f, inv);
      if (c >= CHUNKS) continue;
#pragma unroll
      for (int d = 0; d < C::WORLD; ++d) {
        if (!((mm >> d) & 1u)) continue;
        st_na_global_v4(reinterpret_cast<uint4*>(peer_ptr(recv_q, peers, rank, d) + (size_t)pos[d] * C::HIDDEN) + c, q);
        if ((lane & 7) == 0) peer_ptr(recv_scale, peers, rank, d)[(size_t)pos[d] * GROUPS + c / 8] = scale;
      }
    }
  }
}

// params.fp8_send_unroll = U (the Config's FP8_UNROLL): the send that dispatch uses instead of
// push_row_fp8, with the same arithmetic (so the same bytes and scales), shaped for fewer instructions
// and small stores per row (docs/design/moe.md, "FP8 dispatch per byte"). In push_row_fp8 each of a
// lane's chunks divides twice (IEEE division: a branch to a slow path that no instruction is scheduled
// across, so a pass's U groups run one after another), stores its group's scale from one lane in 8
// (a 16-byte store per group and destination: 14 a row at hidden 7168), and reloads the destination's
// base from the peer table before every store (the stores' memory clobber). Here a pass's U x 32
// chunks make 4 U whole groups; after the U amax reductions (interleaved) lane j < 4 U takes group j's
// amax, divides once for the pass and stores its scale, so the pass's scales go to a destination as one
// contiguous store of 16 U bytes; every lane takes its group's factor back by a shuffle. The
// destinations' row addresses are computed once per row. U <= 8: a lane per group of a pass.
template <class C, class = void>
struct Fp8Send {
  static constexpr int unroll = 0;  // not set: push_row_fp8
};
template <class C>
struct Fp8Send<C, decltype((void)C::FP8_UNROLL)> {
  static constexpr int unroll = C::FP8_UNROLL;
  static_assert(unroll >= 1 && unroll <= 8, "params.fp8_send_unroll: 1 .. 8 (a lane per 128-channel group of a pass)");
};

template <class C>
static __device__ __forceinline__ void push_row_fp8_gathered(const __nv_bfloat16* src_, uint32_t mm, const int* pos,
                                                             uint8_t* recv_q, float* recv_scale, char* const* peers,
                                                             int rank, int lane) {
  constexpr int W = C::WORLD, U = Fp8Send<C>::unroll, CHUNKS = C::HIDDEN / 16, GROUPS = C::HIDDEN / 128;
  constexpr int PASS = 32 * U;
  uint4* qrow[W];  // the row's e4m3 bytes on each destination (its scales: once a pass, addressed there)
#pragma unroll
  for (int d = 0; d < W; ++d)
    qrow[d] = reinterpret_cast<uint4*>(peer_ptr(recv_q, peers, rank, d) + (size_t)pos[d] * C::HIDDEN);
  const uint4* src = reinterpret_cast<const uint4*>(src_);
#pragma unroll 1
  for (int base = 0; base < CHUNKS; base += PASS) {  // slot u of a pass is chunk base + 32 u + lane
    uint4 v[U][2];
    load_chunks<U, CHUNKS>(v, src, base, lane);
    float amax[U];
#pragma unroll
    for (int u = 0; u < U; ++u) amax[u] = chunk_amax(v[u]);
#pragma unroll
    for (int off = 4; off > 0; off >>= 1)
#pragma unroll
      for (int u = 0; u < U; ++u) amax[u] = fmaxf(amax[u], __shfl_xor_sync(0xffffffffu, amax[u], off));
    // lane j < 4 U: group base / 8 + j of the row, slot j / 4, whose lanes 8 (j % 4) .. 8 (j % 4) + 7 hold its amax
    float mine = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float a = __shfl_sync(0xffffffffu, amax[u], (lane & 3) * 8);
      if (lane >> 2 == u) mine = a;
    }
    float scale, inv;
    group_scale(mine, &scale, &inv);
    const int g = base / 8 + lane;
    if (lane < 4 * U && g < GROUPS)
#pragma unroll
      for (int d = 0; d < W; ++d)
        if ((mm >> d) & 1u) peer_ptr(recv_scale, peers, rank, d)[(size_t)pos[d] * GROUPS + g] = scale;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * 32 >= CHUNKS) break;  // warp-uniform; CHUNKS % 8 == 0: a group is all in or all out
      const float gi = __shfl_sync(0xffffffffu, inv, 4 * u + (lane >> 3));  // its group's factor, from lane 4 u + lane / 8
      const int c = base + u * 32 + lane;
      float f[16];
      chunk_floats(v[u], f);
      const uint4 q = chunk_e4m3(f, gi);
      if (c >= CHUNKS) continue;
#pragma unroll
      for (int d = 0; d < W; ++d)
        if ((mm >> d) & 1u) st_na_global_v4(qrow[d] + c, q);
    }
  }
}

// recv_bf16[r] = recv_q[r] * recv_scale[r] (bf16) for the rows the last dispatch delivered: the fp8 rows
// as bf16 (`tsgen test`'s identity expert). A thread converts 16 channels (one 16-byte load, two
// 16-byte stores; 16 divides 128, so they share one scale); launched with many more blocks than the
// dispatch grid (DEQUANT_BLOCKS): a memory-bound pass over every received row.
// dequantize's grid: a memory-bound pass needs every SM, several blocks each (no peer waits: any
// number of blocks is safe, also where ranks share a GPU).
constexpr int DEQUANT_BLOCKS = 1024;

template <class C>
static __device__ __forceinline__ void dequantize(const Buffers& b) {
  constexpr int GROUPS = C::HIDDEN / 128, V16 = C::HIDDEN / 16;
  const size_t n = (size_t)min(b.recv_counts[0], C::RECV) * V16;
  const uint4* q = reinterpret_cast<const uint4*>(b.recv_q);
  uint4* y = reinterpret_cast<uint4*>(b.recv_bf16);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / V16;
    const int c16 = (int)(i % V16);
    const float s = b.recv_scale[r * GROUPS + c16 / 8];
    const uint4 v = q[i];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t o[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float2 f = e4m3x2_to_float2((uint16_t)(w[j] >> (16 * h)));
        const __nv_bfloat162 bf = __floats2bfloat162_rn(f.x * s, f.y * s);
        o[2 * j + h] = *reinterpret_cast<const uint32_t*>(&bf);
      }
    }
    y[2 * i] = make_uint4(o[0], o[1], o[2], o[3]);
    y[2 * i + 1] = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

template <class C>
static __device__ __forceinline__ void dispatch(char* const* peers, int rank, uint64_t epoch, int tokens,
                                                const Buffers& b) {
  constexpr int W = C::WORLD, WMAX = C::WMAX, E = C::EXPERTS, L = E / W, K = C::TOPK;
  constexpr int NWARPS = C::THREADS / 32, VECS = C::HIDDEN / 8;  // 16-byte vectors per row
  __shared__ int s_total[W], s_before[W], s_base[W], s_into[W], s_run[W];
  __shared__ int s_from[W];  // block 0: rows from each source (recv_counts), read in step 2
  __shared__ int s_ecount[E];  // block 0: this rank's pairs per expert (step 1), then pairs received per local expert (step 2)
  __shared__ int s_warp[NWARPS][W];
  __shared__ int s_pos[C::THREADS][W];
  __shared__ uint32_t s_mask[C::THREADS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int lo, hi;
  token_chunk(tokens, blockIdx.x, gridDim.x, &lo, &hi);

  // 1. layout
  if (tid < W) s_total[tid] = s_before[tid] = 0;
  if (blockIdx.x == 0)
    for (int e = tid; e < E; e += C::THREADS) s_ecount[e] = 0;
  __syncthreads();
  int total[W], before[W];
#pragma unroll
  for (int d = 0; d < W; ++d) total[d] = before[d] = 0;
  for (int t = tid; t < tokens; t += C::THREADS) {
    const uint32_t m = route_mask<C>(b.topk_idx, t);
#pragma unroll
    for (int d = 0; d < W; ++d) {
      total[d] += (m >> d) & 1u;
      before[d] += t < lo ? (m >> d) & 1u : 0u;
    }
    if (blockIdx.x == 0)
      for (int k = 0; k < K; ++k) {
        const int e = b.topk_idx[(size_t)t * K + k];
        if (e >= 0 && e < E) atomicAdd(&s_ecount[e], 1);
      }
  }
#pragma unroll
  for (int d = 0; d < W; ++d) {
    const int tsum = __reduce_add_sync(0xffffffffu, total[d]), bsum = __reduce_add_sync(0xffffffffu, before[d]);
    if (lane == 0) {
      atomicAdd(&s_total[d], tsum);
      atomicAdd(&s_before[d], bsum);
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {  // this rank's counts row and per-expert counts, into every destination
    for (int i = tid; i < W * W; i += C::THREADS) {
      const int d = i / W, j = i % W;
      peer_ptr(b.cnt, peers, rank, d)[rank * WMAX + j] = s_total[j];
    }
    for (int i = tid; i < E; i += C::THREADS) {
      const int d = i / L, l = i % L;
      peer_ptr(b.cnt, peers, rank, d)[WMAX * WMAX + rank * E + l] = s_ecount[i];
    }
    __syncthreads();
    if (tid < W)
      st_release_sys_global_u64(peer_ptr(b.sig, peers, rank, tid) + SIG_COUNTS * WMAX + rank, epoch);
  }

  // 2. every rank's counts row
  if (tid < W)
    wait_ge_acquire_sys(b.sig + SIG_COUNTS * WMAX + tid, epoch, make_site("moe.counts", rank, rank, tid));
  __syncthreads();
  if (tid < W) {
    int base = 0, into = 0;
    for (int j = 0; j < W; ++j) {
      const int n = b.cnt[j * WMAX + tid];
      base += j < rank ? n : 0;
      into += n;
    }
    s_base[tid] = base;  // where this rank's rows start on rank tid
    s_into[tid] = into;  // rows rank tid receives in all
    s_run[tid] = base + s_before[tid];
  }
  // block 0: what recv_counts reports, out of `cnt` now, while every counts row of this call is
  // there; step 4 writes it from shared memory. A peer with no rows here may write its next
  // counts into `cnt` once it saw this rank's data arrivals ("Back-to-back calls" above), and
  // step 4's leading __syncthreads orders these reads before them. (s_ecount's per-expert counts
  // of step 1 were stored to the peers before the __syncthreads ahead of the counts release.)
  if (blockIdx.x == 0) {
    if (tid < W) s_from[tid] = b.cnt[tid * WMAX + rank];
    for (int l = tid; l < L; l += C::THREADS) {
      int sum = 0;
      for (int j = 0; j < W; ++j) sum += b.cnt[WMAX * WMAX + j * E + l];
      s_ecount[l] = sum;
    }
  }
  __syncthreads();

  // 3. positions and rows, THREADS tokens a round
  for (int round = lo; round < hi; round += C::THREADS) {
    const int t = round + tid, n = min(C::THREADS, hi - round);
    const uint32_t m = t < hi ? route_mask<C>(b.topk_idx, t) : 0u;
    int pre[W];
#pragma unroll
    for (int d = 0; d < W; ++d) {
      const uint32_t ballot = __ballot_sync(0xffffffffu, (m >> d) & 1u);
      pre[d] = __popc(ballot & lanemask_lt());
      if (lane == 0) s_warp[warp][d] = __popc(ballot);
    }
    __syncthreads();
    if (tid < W) {  // exclusive scan over warps, carried across rounds
      int acc = s_run[tid];
      for (int w = 0; w < NWARPS; ++w) {
        const int v = s_warp[w][tid];
        s_warp[w][tid] = acc;
        acc += v;
      }
      s_run[tid] = acc;
    }
    __syncthreads();
    s_mask[tid] = m;
#pragma unroll
    for (int d = 0; d < W; ++d) s_pos[tid][d] = s_warp[warp][d] + pre[d];  // a row on rank d
    __syncthreads();
    for (int i = warp; i < n; i += NWARPS) {
      const int tok = round + i;
      uint32_t mm = s_mask[i];
#pragma unroll
      for (int d = 0; d < W; ++d)
        if (((mm >> d) & 1u) && (unsigned)s_pos[i][d] >= (unsigned)C::RECV) mm &= ~(1u << d);  // past the capacity: dropped
      if (lane < W) b.sent_row[(size_t)tok * WMAX + lane] = (mm >> lane) & 1u ? s_pos[i][lane] : -1;  // for combine
      if (mm == 0) continue;
      if constexpr (C::FP8 && Fp8Send<C>::unroll > 0) {
        push_row_fp8_gathered<C>(b.x + (size_t)tok * C::HIDDEN, mm, s_pos[i], b.recv_q, b.recv_scale, peers, rank, lane);
      } else if constexpr (C::FP8) {
        push_row_fp8<C>(b.x + (size_t)tok * C::HIDDEN, mm, s_pos[i], b.recv_q, b.recv_scale, peers, rank, lane);
      } else {
      const uint4* src = reinterpret_cast<const uint4*>(b.x + (size_t)tok * C::HIDDEN);
      for (int v0 = lane; v0 < VECS; v0 += 32 * C::UNROLL) {
        uint4 v[C::UNROLL];
#pragma unroll
        for (int u = 0; u < C::UNROLL; ++u)
          if (v0 + u * 32 < VECS) v[u] = ld_nc_na_global_v4(src + v0 + u * 32);
#pragma unroll
        for (int d = 0; d < W; ++d) {
          if (!((mm >> d) & 1u)) continue;
          uint4* dst = reinterpret_cast<uint4*>(peer_ptr(b.recv_x, peers, rank, d) +
                                                (size_t)s_pos[i][d] * C::HIDDEN);
#pragma unroll
          for (int u = 0; u < C::UNROLL; ++u)
            if (v0 + u * 32 < VECS) st_na_global_v4(dst + v0 + u * 32, v[u]);
        }
      }
      }
      const int e = lane < K ? b.topk_idx[(size_t)tok * K + lane] : -1;
      const float w = lane < K ? b.topk_weights[(size_t)tok * K + lane] : 0.f;
#pragma unroll
      for (int d = 0; d < W; ++d) {
        if (!((mm >> d) & 1u)) continue;
        const size_t row = (size_t)s_pos[i][d];
        const bool here = e >= 0 && e < E && e / L == d;
        if (lane < K) {
          peer_ptr(b.recv_idx, peers, rank, d)[row * K + lane] = here ? e - d * L : -1;
          peer_ptr(b.recv_w, peers, rank, d)[row * K + lane] = here ? w : 0.f;
        } else if (lane >= 30) {
          peer_ptr(b.handle, peers, rank, d)[row * 2 + (lane - 30)] = lane == 30 ? rank : tok;
        }
      }
    }
    __syncthreads();  // s_pos, s_mask and s_warp are reused by the next round
  }

  // 4. arrivals
  __syncthreads();
  if (tid < W) red_add_release_sys_global_u64(peer_ptr(b.sig, peers, rank, tid) + SIG_DATA * WMAX + rank, 1ull);
  if (blockIdx.x != 0) return;
  if (tid < W)
    wait_ge_acquire_sys(b.sig + SIG_DATA * WMAX + tid, epoch * (uint64_t)gridDim.x,
                        make_site("moe.data", rank, rank, tid));
  __syncthreads();
  const int received = s_into[rank];
  int dropped = 0;
#pragma unroll
  for (int d = 0; d < W; ++d) dropped |= s_total[d] > 0 && s_base[d] + s_total[d] > C::RECV;
  if (tid == 0) {
    b.recv_counts[0] = received;
    b.recv_counts[1] = (received > C::RECV ? FLAG_RECV_OVERFLOW : 0) | (dropped ? FLAG_SENT_DROPPED : 0);
    if (received > C::RECV)
      printf("tsgen: moe_dispatch: rank %d receives %d rows, more than its receive capacity %d "
             "(params.recv_capacity); the rows past it were dropped (recv_counts[1] flags it)\n",
             rank, received, C::RECV);
  }
  // from shared memory (step 2): a peer may already have written its next counts into `cnt`
  for (int j = tid; j < WMAX; j += C::THREADS) b.recv_counts[2 + j] = j < W ? s_from[j] : 0;
  for (int l = tid; l < E; l += C::THREADS) b.recv_counts[2 + WMAX + l] = l < L ? s_ecount[l] : 0;
  if (tid == 0) b.sig[SIG_TOKENS * WMAX] = (uint64_t)tokens;  // for combine's count check (moe.cu.j2)
}

// Normal combine, one sender warp: rows [lo, hi) of this rank's receive buffer (all in chunk c) home,
// row r from another rank s into s's comb[token][this rank] (this rank's own rows stay in y: dispatch
// wrote where, sent_row[token][rank]); then chunk_sig[rank][c] raised to the epoch on every rank that
// got rows (release, sys scope, after __syncwarp: the lanes' row stores are ordered before it).
template <class C>
static __device__ __forceinline__ void push_chunk(char* const* peers, int rank, uint64_t epoch, const Buffers& b,
                                                  const __nv_bfloat16* y, int c, int lo, int hi, int lane) {
  constexpr int W = C::WORLD, NCHUNK = (C::RECV + C::CHUNK - 1) / C::CHUNK;
  uint32_t to = 0;  // ranks that had rows here
  for (int r = lo; r < hi; ++r) {
    const int s = b.handle[r * 2], t = b.handle[r * 2 + 1];
    if ((unsigned)s >= (unsigned)W || (unsigned)t >= (unsigned)C::CAP) continue;  // not a handle dispatch wrote
    if (s == rank) continue;  // this rank's own tokens: step 2 reads their rows in y (sent_row)
    copy_row<C, CombineSenders<C>::unroll>(peer_ptr(b.comb, peers, rank, s) + ((size_t)t * W + rank) * C::HIDDEN,
                                           y + (size_t)r * C::HIDDEN, lane);
    to |= 1u << s;
  }
  __syncwarp();  // every lane's row stores, before the release below (cumulativity carries them)
  if (lane < W && ((to >> lane) & 1u))
    st_release_sys_global_u64(peer_ptr(b.chunk_sig, peers, rank, lane) + rank * NCHUNK + c, epoch);
}

template <class C>
static __device__ __forceinline__ void combine(char* const* peers, int rank, uint64_t epoch, int tokens,
                                               const Buffers& b, const __nv_bfloat16* y) {
  constexpr int W = C::WORLD, WMAX = C::WMAX, E = C::EXPERTS, L = E / W, K = C::TOPK;
  constexpr int VECS = C::HIDDEN / 8, NWARPS = C::THREADS / 32, CHUNK = C::CHUNK;
  constexpr int NCHUNK = (C::RECV + CHUNK - 1) / CHUNK;
  constexpr int SENDERS = CombineSenders<C>::warps;  // warps of a block that push rows first (default: half)
  __shared__ int s_next;  // the block's next sum item (step 2)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) s_next = 0;
  __syncthreads();

  // 1. rows home, by the sender warps g = blockIdx.x SENDERS + warp, G of them
  if (warp < SENDERS) {
    const int rows = min(b.recv_counts[0], C::RECV);
    const int g = blockIdx.x * SENDERS + warp, G = gridDim.x * SENDERS;
    if constexpr (!C::PEER_ORDER) {
      // in row order: chunk c (rows [c CHUNK, (c + 1) CHUNK)) by warp c mod G. The rows are grouped by
      // source rank, so a rank's warps push to one peer at a time, and every rank starts with rank 0's
      // rows (W > 2: the other ranks all push to rank 0 first, then to rank 1, ...: incast)
      for (int c = g; c * CHUNK < rows; c += G)
        push_chunk<C>(peers, rank, epoch, b, y, c, c * CHUNK, min(rows, (c + 1) * CHUNK), lane);
    } else {
      // the peers' rows interleaved: lane s < W holds the rows from source s, [lo, hi) (recv_counts, in
      // rank order, as dispatch placed them), and their chunks [first, first + chunks) (0 for this rank's
      // own rows, which stay in y). Slot v = (W - 1) k + j is chunk k of peer (rank + 1 + j) mod W, so
      // every round of G slots pushes to every peer at once and each peer's rows go at one pace (a
      // token's rows from every rank arrive at about the same time). A chunk that straddles two sources
      // is pushed in two parts, each signalled to its source only. Warp g takes slot i G + (g + i) mod G
      // in round i: its chunks cycle over the peers (with G a multiple of W - 1 it would keep one).
      constexpr int P = W > 1 ? W - 1 : 1;
      const int n = lane < W ? b.recv_counts[2 + lane] : 0;
      int end = n;  // inclusive scan of the rows from each source
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, end, off);
        if (lane >= off) end += up;
      }
      const int lo = min(end - n, rows), hi = min(end, rows);
      const int first = lo / CHUNK, chunks = lane < W && lane != rank && hi > lo ? (hi - 1) / CHUNK + 1 - first : 0;
      const int slots = P * __reduce_max_sync(0xffffffffu, chunks);
      for (int i = 0; i * G < slots; ++i) {
        const int v = i * G + (g + i) % G, s = (rank + 1 + v % P) % W, k = v / P;
        const int c = __shfl_sync(0xffffffffu, first, s) + k;
        const int r0 = max(c * CHUNK, __shfl_sync(0xffffffffu, lo, s));
        const int r1 = min((c + 1) * CHUNK, __shfl_sync(0xffffffffu, hi, s));
        if (k < __shfl_sync(0xffffffffu, chunks, s)) push_chunk<C>(peers, rank, epoch, b, y, c, r0, r1, lane);
      }
    }
  }

  // 2. sums: block b's tokens b, b + gridDim.x, ... in order, a warp per token (or `parts` warps,
  //    sum_parts), each item taken from the block's counter as a warp gets free
  const int parts = sum_parts(tokens, gridDim.x * NWARPS);
  const int items = (tokens > (int)blockIdx.x ? (tokens - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0) * parts;
  for (;;) {
    int item = 0;
    if (lane == 0) item = atomicAdd(&s_next, 1);
    item = __shfl_sync(0xffffffffu, item, 0);
    if (item >= items) break;
    const int t = blockIdx.x + item / parts * gridDim.x, part = item % parts;
    // lane d < W: the token's row on rank d (-1: not sent there, or dropped past the capacity); a
    // peer's row is in the inbox once the chunk holding it on that peer was signalled
    const int row = lane < W ? b.sent_row[(size_t)t * WMAX + lane] : -1;
    const bool has = (unsigned)row < (unsigned)C::RECV;
    if (has && lane != rank)
      wait_ge_acquire_sys(b.chunk_sig + lane * NCHUNK + row / CHUNK, epoch,
                          make_site("moe.chunk_sig", rank, rank, lane * NCHUNK + row / CHUNK));
    __syncwarp();  // the waiting lanes' acquire, before every lane's loads of the inbox below
    const uint32_t m = __ballot_sync(0xffffffffu, has);
    const int own = __shfl_sync(0xffffffffu, row, rank);  // its row in y, or -1
    float scale[W];
#pragma unroll
    for (int d = 0; d < W; ++d) scale[d] = C::WEIGHTED ? 0.f : 1.f;
    if (C::WEIGHTED)
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int e = __ldg(b.topk_idx + (size_t)t * K + k);
        const float w = __ldg(b.topk_weights + (size_t)t * K + k);
#pragma unroll
        for (int d = 0; d < W; ++d) scale[d] += (e >= 0 && e < E && e / L == d) ? w : 0.f;
      }
    uint4* dst = reinterpret_cast<uint4*>(b.out + (size_t)t * C::HIDDEN);
    const uint4* slots = reinterpret_cast<const uint4*>(b.comb + (size_t)t * W * C::HIDDEN);
    const uint4* mine = reinterpret_cast<const uint4*>(y + (size_t)max(own, 0) * C::HIDDEN);
    // UNROLL vectors per lane: each rank's UNROLL loads are issued before they are summed (issue 34:
    // one vector per lane at a time left this local pass latency-bound on combine's few SMs)
    for (int v0 = part * 32 * C::UNROLL + lane; v0 < VECS; v0 += 32 * C::UNROLL * parts) {
      float acc[C::UNROLL][8];
#pragma unroll
      for (int u = 0; u < C::UNROLL; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
#pragma unroll
      for (int d = 0; d < W; ++d) {
        if (!((m >> d) & 1u)) continue;
        uint4 v[C::UNROLL];
#pragma unroll
        for (int u = 0; u < C::UNROLL; ++u)
          if (v0 + u * 32 < VECS)
            v[u] = ld_weak_global_v4((d == rank ? mine : slots + (size_t)d * VECS) + v0 + u * 32);
#pragma unroll
        for (int u = 0; u < C::UNROLL; ++u) {
          if (v0 + u * 32 >= VECS) continue;
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h[i]);
            acc[u][2 * i] = fmaf(f.x, scale[d], acc[u][2 * i]);
            acc[u][2 * i + 1] = fmaf(f.y, scale[d], acc[u][2 * i + 1]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < C::UNROLL; ++u) {
        if (v0 + u * 32 >= VECS) continue;
        uint4 o;
        __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
        for (int i = 0; i < 4; ++i) oh[i] = __floats2bfloat162_rn(acc[u][2 * i], acc[u][2 * i + 1]);
        st_weak_global_v4(dst + v0 + u * 32, o);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Low-latency mode (decode): rows go straight into per-(local expert, source rank) slots of
// SLOT rows each, one kernel per direction, no counts exchange before the rows.
//
// ll_dispatch: block b handles experts b, b + gridDim.x, ...; for expert e (rank d = e / L, local
//   l = e % L) it walks the (token, top-k slot) pairs of this rank in order and sends each pair
//   whose expert is e as a row into d's slot [parity][l][rank][i], i = the pair's place among
//   this rank's pairs for e (so a slot holds its source's rows in token order), with the handle
//   token * 32 + k; then raises d's lsig[l * W + rank] to (epoch << 32) | pairs (release): the
//   count travels with the signal. Pairs past SLOT are dropped and reported. Block 0 waits for
//   every (l, s) signal of this call and writes recv_counts. parity = epoch & 1 keeps the rows
//   of calls n and n + 1 in different slots. It does NOT let a rank dispatch again before its
//   peers have read the previous call's rows: the count rides on ONE signal word per (l, s),
//   and call n + 1's value would satisfy a late reader's wait for call n with the wrong count.
//   Correctness rests on the call order (dispatch, combine, dispatch: a rank's next dispatch
//   starts after its combine, which waited for every peer's rows of this call).
// ll_combine: the rows of the last dispatch (its parity from the dispatch call counter) go back
//   to its source as comb[token][k]; each block then raises the source's csig[rank] by one; a
//   source waits for every rank's arrivals and writes out[t] = sum over valid k of
//   topk_weights[t][k] * comb[t][k] (fp32, k order), bf16.
// ---------------------------------------------------------------------------
struct LLBuffers {
  const __nv_bfloat16* x;
  const int32_t* topk_idx;
  const float* topk_weights;
  __nv_bfloat16* out;
  int32_t* recv_counts;   // [0] rows, [1] flags, [2 + WMAX + l * W + s] rows from source s for local expert l
  __nv_bfloat16* recv_x;  // [2][L][W][SLOT][HIDDEN] (L * W = EXPERTS)
  int32_t* recv_src;      // [2][L][W][SLOT] token * 32 + k
  __nv_bfloat16* comb;    // [CAP][TOPK][HIDDEN]
  uint64_t* lsig;         // [EXPERTS] (epoch << 32) | rows, by (l, s)
  uint64_t* csig;         // [WMAX] combine arrivals
};

template <class C>
static __device__ __forceinline__ void ll_dispatch(char* const* peers, int rank, uint64_t epoch, int tokens,
                                                   const LLBuffers& b) {
  constexpr int W = C::WORLD, WMAX = C::WMAX, E = C::EXPERTS, L = E / W, K = C::TOPK, SLOT = C::SLOT;
  constexpr int NWARPS = C::THREADS / 32;
  __shared__ int s_warp[NWARPS];
  __shared__ int s_run;
  __shared__ int s_pair[C::THREADS * K];  // this round's pairs for the expert: token * 32 + k
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int par = (int)(epoch & 1ull);
  for (int e = blockIdx.x; e < E; e += gridDim.x) {
    const int d = e / L, l = e % L;
    const size_t slot = ((size_t)par * E + (size_t)l * W + rank) * SLOT;  // first row of our slot on d
    __nv_bfloat16* rx = peer_ptr(b.recv_x, peers, rank, d) + slot * C::HIDDEN;
    int32_t* rs = peer_ptr(b.recv_src, peers, rank, d) + slot;
    if (tid == 0) s_run = 0;
    __syncthreads();
    for (int round = 0; round < tokens; round += C::THREADS) {
      const int t = round + tid;
      int mine = 0;
      if (t < tokens)
#pragma unroll
        for (int k = 0; k < K; ++k) mine += __ldg(b.topk_idx + (size_t)t * K + k) == e;
      int incl = mine;  // inclusive scan over the warp
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += v;
      }
      if (lane == 31) s_warp[warp] = incl;
      __syncthreads();
      int before = 0, all = 0;
      for (int w = 0; w < NWARPS; ++w) {
        before += w < warp ? s_warp[w] : 0;
        all += s_warp[w];
      }
      int at = before + incl - mine;  // this thread's first pair within the round
      if (mine)
        for (int k = 0; k < K; ++k)
          if (__ldg(b.topk_idx + (size_t)t * K + k) == e) s_pair[at++] = t * 32 + k;
      const int run = s_run;
      __syncthreads();
      for (int j = warp; j < all; j += NWARPS) {
        const int i = run + j, p = s_pair[j];
        if (i >= SLOT) break;  // dropped: the count says so
        copy_row<C>(rx + (size_t)i * C::HIDDEN, b.x + (size_t)(p >> 5) * C::HIDDEN, lane);
        if (lane == 0) rs[i] = p;
      }
      __syncthreads();
      if (tid == 0) s_run = run + all;
      __syncthreads();
    }
    if (tid == 0)  // the rows (ordered before by __syncthreads) and the count, released together
      st_release_sys_global_u64(peer_ptr(b.lsig, peers, rank, d) + l * W + rank,
                                epoch << 32 | (uint64_t)(uint32_t)s_run);
  }
  if (blockIdx.x != 0) return;
  __shared__ int s_total, s_over;
  if (tid == 0) s_total = s_over = 0;
  __syncthreads();
  for (int i = tid; i < E; i += C::THREADS) {  // i = l * W + s
    const uint64_t v = wait_ge_acquire_sys(b.lsig + i, epoch << 32, make_site("moe.ll_rows", rank, rank, i));
    const int n = (int)(uint32_t)v;
    b.recv_counts[2 + WMAX + i] = n;
    atomicAdd(&s_total, n);
    if (n > SLOT) atomicOr(&s_over, 1);
  }
  for (int j = tid; j < WMAX; j += C::THREADS) b.recv_counts[2 + j] = 0;
  __syncthreads();
  if (tid == 0) {
    b.recv_counts[0] = s_total;
    b.recv_counts[1] = s_over ? FLAG_RECV_OVERFLOW : 0;
    if (s_over)
      printf("tsgen: moe_dispatch (low_latency): rank %d got more rows for one (local expert, source rank) "
             "than params.slot_tokens = %d; the rows past it were dropped (recv_counts[1] flags it)\n", rank, SLOT);
  }
}

template <class C>
static __device__ __forceinline__ void ll_combine(char* const* peers, int rank, uint64_t epoch, int tokens,
                                                  const LLBuffers& b, const __nv_bfloat16* y, uint64_t dispatched) {
  constexpr int W = C::WORLD, WMAX = C::WMAX, E = C::EXPERTS, K = C::TOPK, SLOT = C::SLOT;
  constexpr int NWARPS = C::THREADS / 32, VECS = C::HIDDEN / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int par = (int)(dispatched & 1ull);  // the half the last dispatch (call `dispatched`) filled
  if (y == nullptr) y = b.recv_x + (size_t)par * E * SLOT * C::HIDDEN;
  // 1. rows home: block b takes (l, s) pairs b, b + gridDim.x, ...; y is laid out as one parity
  //    of recv_x: [L][W][SLOT][HIDDEN]
  for (int i = blockIdx.x; i < E; i += gridDim.x) {
    const int s = i % W, n = min(b.recv_counts[2 + WMAX + i], SLOT);
    const int32_t* src = b.recv_src + ((size_t)par * E + i) * SLOT;
    for (int r = warp; r < n; r += NWARPS) {
      const int p = src[r], t = p >> 5, k = p & 31;
      if ((unsigned)t >= (unsigned)C::CAP || k >= K) continue;  // not a handle dispatch wrote
      copy_row<C>(peer_ptr(b.comb, peers, rank, s) + ((size_t)t * K + k) * C::HIDDEN,
                  y + ((size_t)i * SLOT + r) * C::HIDDEN, lane);
    }
  }
  __syncthreads();
  if (tid < W) red_add_release_sys_global_u64(peer_ptr(b.csig, peers, rank, tid) + rank, 1ull);
  if (tid < W)
    wait_ge_acquire_sys(b.csig + tid, epoch * (uint64_t)gridDim.x, make_site("moe.ll_comb", rank, rank, tid));
  __syncthreads();
  // 2. weighted sums, a warp per token (or `parts` warps, sum_parts)
  const int gwarp = blockIdx.x * NWARPS + warp, nwarps = gridDim.x * NWARPS;
  const int parts = sum_parts(tokens, nwarps);
  for (int item = gwarp; item < tokens * parts; item += nwarps) {
    const int t = item / parts, part = item % parts;
    uint4* dst = reinterpret_cast<uint4*>(b.out + (size_t)t * C::HIDDEN);
    const uint4* slots = reinterpret_cast<const uint4*>(b.comb + (size_t)t * K * C::HIDDEN);
    // The token's routing read once, then per vector every slot's load issued before any is summed
    // (issue 34: one slot at a time, the routing re-read per vector, kept K dependent loads in a row)
    bool on[K];
    float wk[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int e = __ldg(b.topk_idx + (size_t)t * K + k);
      on[k] = e >= 0 && e < E;
      wk[k] = on[k] ? __ldg(b.topk_weights + (size_t)t * K + k) : 0.f;
    }
    for (int v0 = part * 32 + lane; v0 < VECS; v0 += 32 * parts) {
      uint4 v[K];
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (on[k]) v[k] = ld_weak_global_v4(slots + (size_t)k * VECS + v0);
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.f;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (!on[k]) continue;
        const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[k]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __bfloat1622float2(h[i]);
          acc[2 * i] = fmaf(f.x, wk[k], acc[2 * i]);
          acc[2 * i + 1] = fmaf(f.y, wk[k], acc[2 * i + 1]);
        }
      }
      uint4 o;
      __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int i = 0; i < 4; ++i) oh[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      st_weak_global_v4(dst + v0, o);
    }
  }
}

}  // namespace moe
}  // namespace tsgen

#endif  // TSGEN_MOE_CUH
