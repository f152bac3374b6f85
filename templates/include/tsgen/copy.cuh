// tsgen/copy.cuh -- put / get at warp and block granularity.
//
// Hand-written; included by every generated source.
//
// A copy is split among `nthreads` cooperating threads (a warp, a block, or
// a whole grid). The body moves 16-byte vectors, UNROLL loads in flight per
// thread before the first store; a tail of nbytes % 16 bytes is copied byte
// by byte, so any byte count works. dst and src must be 16-byte aligned
// (symmetric buffers are 256-byte aligned; chunk starts are multiples of 16).
//
// SRC_READ_ONLY: the source does not change while the kernel runs, so it is
// read through the non-coherent path without L1 allocation (ld.global.nc.
// L1::no_allocate). Sources another GPU or block may write during the kernel
// (peer memory, inboxes) are read with plain coherent loads.
#ifndef TSGEN_COPY_CUH
#define TSGEN_COPY_CUH

#include <stdint.h>

#include "tsgen/ptx.cuh"

namespace tsgen {

template <int UNROLL, bool SRC_READ_ONLY>
static __device__ __forceinline__ void copy(void* dst_, const void* src_, uint64_t nbytes,
                                            uint32_t tid, uint32_t nthreads) {
  uint4* dst = (uint4*)dst_;
  const uint4* src = (const uint4*)src_;
  const uint64_t nvec = nbytes / 16;
  uint64_t i = tid;
  for (; i + (uint64_t)(UNROLL - 1) * nthreads < nvec; i += (uint64_t)UNROLL * nthreads) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      v[u] = SRC_READ_ONLY ? ld_nc_na_global_v4(src + i + (uint64_t)u * nthreads)
                           : ld_weak_global_v4(src + i + (uint64_t)u * nthreads);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) st_weak_global_v4(dst + i + (uint64_t)u * nthreads, v[u]);
  }
  for (; i < nvec; i += nthreads) st_weak_global_v4(dst + i, ld_weak_global_v4(src + i));
  unsigned char* dst_b = (unsigned char*)dst_;
  const unsigned char* src_b = (const unsigned char*)src_;
  for (uint64_t b = nvec * 16 + tid; b < nbytes; b += nthreads) dst_b[b] = src_b[b];
}

// Split nbytes into `parts` chunks whose starts are multiples of 16 bytes;
// part p covers [*begin, *end). Parts past the end are empty.
static __device__ __forceinline__ void chunk(uint64_t nbytes, uint64_t parts, uint64_t p,
                                             uint64_t* begin, uint64_t* end) {
  uint64_t chunk = (nbytes + parts - 1) / parts;
  chunk = (chunk + 15) & ~15ull;
  const uint64_t b = p * chunk;
  *begin = b < nbytes ? b : nbytes;
  *end = b + chunk < nbytes ? b + chunk : nbytes;
}

// One warp copies nbytes (call with the whole warp; lanes split the work).
template <int UNROLL>
static __device__ __forceinline__ void put_warp(void* dst_peer, const void* src_local,
                                                uint64_t nbytes) {
  copy<UNROLL, true>(dst_peer, src_local, nbytes, threadIdx.x & 31u, 32u);
}

template <int UNROLL>
static __device__ __forceinline__ void get_warp(void* dst_local, const void* src_peer,
                                                uint64_t nbytes) {
  copy<UNROLL, false>(dst_local, src_peer, nbytes, threadIdx.x & 31u, 32u);
}

// One block copies nbytes (call with the whole block).
template <int UNROLL>
static __device__ __forceinline__ void put_block(void* dst_peer, const void* src_local,
                                                 uint64_t nbytes) {
  copy<UNROLL, true>(dst_peer, src_local, nbytes, threadIdx.x, blockDim.x);
}

template <int UNROLL>
static __device__ __forceinline__ void get_block(void* dst_local, const void* src_peer,
                                                 uint64_t nbytes) {
  copy<UNROLL, false>(dst_local, src_peer, nbytes, threadIdx.x, blockDim.x);
}

}  // namespace tsgen

#endif  // TSGEN_COPY_CUH
