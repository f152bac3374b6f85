// tsgen/ulysses.cuh -- the Ulysses all-to-alls: a head group of every local token pushed
// into a peer's full-sequence tensor (pre), or a token range of the local full-sequence tensor
// pushed into a peer's sequence shard (post), the transpose done by the addressing.
//
// Hand-written; included by the sources of ops ulysses_pre_a2a and
// ulysses_post_a2a (tsgen/ops/ulysses.py says what moves where and why it pushes).
//
// Everything moves as 16-byte vectors (head_dim x itemsize is a multiple of 16; symmetric
// buffers are 256-byte aligned). A transfer is a set of ROWS runs of ROW_VEC vectors: run k is
// read at src + k * SRC_STRIDE and written at dst + k * DST_STRIDE (vectors), so each vector is
// loaded once and stored once. Strides and run lengths are compile-time (the head counts and
// head_dim of the spec); only the number of runs (tokens per rank) is a run-time value.
#ifndef TSGEN_ULYSSES_CUH
#define TSGEN_ULYSSES_CUH

#include <stdint.h>

#include "tsgen/ptx.cuh"
#include "tsgen/sync.cuh"
#include "tsgen/copy.cuh"

namespace tsgen {
namespace ulysses {

// Copy `rows` runs of ROW_VEC vectors, strided as above, shared by `parts` blocks (this one is
// part `part`); every thread keeps UNROLL loads in flight before its stores. The source is the
// caller's own input, which nothing writes during the call: read-only, non-allocating loads.
template <int ROW_VEC, int SRC_STRIDE, int DST_STRIDE, int UNROLL>
static __device__ __forceinline__ void copy_rows(uint4* dst, const uint4* src, uint64_t rows, uint32_t part,
                                                 uint32_t parts) {
  const uint64_t n = rows * (uint64_t)ROW_VEC;
  const uint64_t step = (uint64_t)parts * blockDim.x;
  uint64_t i = (uint64_t)part * blockDim.x + threadIdx.x;
  for (; i + (uint64_t)(UNROLL - 1) * step < n; i += (uint64_t)UNROLL * step) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const uint64_t k = (i + u * step) / ROW_VEC, c = (i + u * step) % ROW_VEC;
      v[u] = ld_nc_na_global_v4(src + k * SRC_STRIDE + c);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const uint64_t k = (i + u * step) / ROW_VEC, c = (i + u * step) % ROW_VEC;
      st_weak_global_v4(dst + k * DST_STRIDE + c, v[u]);
    }
  }
  for (; i < n; i += step) {
    const uint64_t k = i / ROW_VEC, c = i % ROW_VEC;
    st_weak_global_v4(dst + k * DST_STRIDE + c, ld_nc_na_global_v4(src + k * SRC_STRIDE + c));
  }
}

// pre: heads [head0, head0 + HL) of every local token of src [BATCH, count, IN_HEADS, head_dim]
// into dst, a full-sequence tensor of HL heads, at sequence offset seq0 of seq:
// bshd [BATCH, seq, HL, head_dim] (per batch one contiguous run of count x HL heads) or
// bhsd [BATCH, HL, seq, head_dim] (per batch and head one run of count rows). HV: vectors per head.
template <int BATCH, int IN_HEADS, int HL, int HV, bool BHSD, int UNROLL>
static __device__ __forceinline__ void scatter(uint4* dst, const uint4* src, int head0, uint64_t count,
                                               uint64_t seq, uint64_t seq0, uint32_t part,
                                               uint32_t parts) {
  for (int b = 0; b < BATCH; ++b) {
    const uint4* from = src + ((uint64_t)b * count * IN_HEADS + head0) * HV;
    if (!BHSD) {
      copy_rows<HL * HV, IN_HEADS * HV, HL * HV, UNROLL>(dst + ((uint64_t)b * seq + seq0) * HL * HV, from,
                                                          count, part, parts);
    } else {
      for (int h = 0; h < HL; ++h)
        copy_rows<HV, IN_HEADS * HV, HV, UNROLL>(dst + (((uint64_t)b * HL + h) * seq + seq0) * HV,
                                                 from + (uint64_t)h * HV, count, part, parts);
    }
  }
}

// post: the tokens [seq0, seq0 + count) of src, a full-sequence tensor of HL heads (bshd or
// bhsd as above), into heads [head0, head0 + HL) of dst [BATCH, count, OUT_HEADS, head_dim].
template <int BATCH, int OUT_HEADS, int HL, int HV, bool BHSD, int UNROLL>
static __device__ __forceinline__ void gather(uint4* dst, const uint4* src, int head0, uint64_t count,
                                              uint64_t seq, uint64_t seq0, uint32_t part,
                                              uint32_t parts) {
  for (int b = 0; b < BATCH; ++b) {
    uint4* to = dst + ((uint64_t)b * count * OUT_HEADS + head0) * HV;
    if (!BHSD) {
      copy_rows<HL * HV, HL * HV, OUT_HEADS * HV, UNROLL>(to, src + ((uint64_t)b * seq + seq0) * HL * HV,
                                                           count, part, parts);
    } else {
      for (int h = 0; h < HL; ++h)
        copy_rows<HV, HV, OUT_HEADS * HV, UNROLL>(to + (uint64_t)h * HV,
                                                  src + (((uint64_t)b * HL + h) * seq + seq0) * HV, count,
                                                  part, parts);
    }
  }
}

// The exchange's signals (tsgen/ops/ulysses.py, "Synchronization"): entry[WORLD] and
// arrive[WORLD] u64 epoch counters in every rank's heap.
//
// Open: block 0 tells every peer that our call `epoch` started (our output may be written);
// the blocks that push to `peer` wait for the peer's word. Call with the whole block.
template <int WORLD>
static __device__ __forceinline__ void open(uint64_t* entry, char* const* peers, int rank, int peer,
                                            uint64_t epoch) {
  if (blockIdx.x == 0 && threadIdx.x < WORLD && (int)threadIdx.x != rank)
    st_release_sys_global_u64(peer_ptr(entry, peers, rank, (int)threadIdx.x) + rank, epoch);
  if (peer != rank && threadIdx.x == 0)
    wait_ge_acquire_sys(entry + peer, epoch, make_site("entry", rank, rank, peer));
  __syncthreads();
}

// Close: after its pushes every block adds one to arrive[rank] in the peer's memory (release:
// the block's stores, ordered before by __syncthreads, are visible to whoever acquires it);
// `waiter` blocks then wait until every peer's BLOCKS_PER_PEER blocks have arrived, so the
// output is complete when the kernel returns. Call with the whole block.
template <int WORLD, int BLOCKS_PER_PEER>
static __device__ __forceinline__ void close(uint64_t* arrive, char* const* peers, int rank, int peer,
                                             uint64_t epoch, bool waiter) {
  __syncthreads();
  if (peer != rank && threadIdx.x == 0)
    red_add_release_sys_global_u64(peer_ptr(arrive, peers, rank, peer) + rank, 1ull);
  if (waiter && threadIdx.x < WORLD && (int)threadIdx.x != rank)
    wait_ge_acquire_sys(arrive + threadIdx.x, epoch * BLOCKS_PER_PEER,
                        make_site("arrive", rank, rank, (int)threadIdx.x));
}

}  // namespace ulysses
}  // namespace tsgen

#endif  // TSGEN_ULYSSES_CUH
