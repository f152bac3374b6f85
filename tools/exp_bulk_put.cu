// Experiment kernels for tools/exp_bulk_put.py: can bulk async copies (the TMA engine)
// push more bytes per second into three peers at once than 16-byte SM stores?
//
// Both kernels move `bytes` from this GPU's `src` into every peer's `dst` at offset
// rank * bytes (the all_to_all / allgather pattern: one outgoing stream per peer). CTAs
// are split evenly over the peers (ctas_per_peer each) and each CTA walks its peer's
// bytes in CHUNK-byte pieces, grid-stride.
//
//   put_v4    ld.global.v4 from src, st.global.v4 to the peer (what tsgen's copies do)
//   put_bulk  cp.async.bulk global -> shared (local read, mbarrier completion), then
//             cp.async.bulk shared -> global into the peer (bulk_group completion),
//             STAGES buffers in flight per CTA, one thread issuing everything
//
// bytes must be a multiple of 16 (bulk copies move 16-byte multiples).
#include <cstdint>

#define CHUNK (32 * 1024)
#define STAGES 4

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

extern "C" __global__ void put_v4(char* const* peers, const char* src, uint64_t dst_offset, uint64_t bytes,
                                  int rank, int world, int ctas_per_peer) {
  const int j = blockIdx.x / ctas_per_peer;  // which peer this CTA feeds: rank + 1 + j
  if (j >= world - 1) return;
  const int peer = (rank + 1 + j) % world;
  char* dst = peers[peer] + dst_offset + (uint64_t)rank * bytes;
  const uint64_t vecs = bytes / 16;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  const uint64_t stride = (uint64_t)ctas_per_peer * blockDim.x;
  uint64_t i = (uint64_t)(blockIdx.x % ctas_per_peer) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < vecs; i += 4 * stride) {  // four 16-byte loads in flight per thread
    uint4 v0 = s[i], v1 = s[i + stride], v2 = s[i + 2 * stride], v3 = s[i + 3 * stride];
    d[i] = v0, d[i + stride] = v1, d[i + 2 * stride] = v2, d[i + 3 * stride] = v3;
  }
  for (; i < vecs; i += stride) d[i] = s[i];
}

extern "C" __global__ void put_bulk(char* const* peers, const char* src, uint64_t dst_offset, uint64_t bytes,
                                    int rank, int world, int ctas_per_peer) {
  extern __shared__ __align__(128) char buf[];  // STAGES x CHUNK (dynamic)
  __shared__ __align__(8) uint64_t full[STAGES];
  const int j = blockIdx.x / ctas_per_peer;
  if (j >= world - 1 || threadIdx.x != 0) return;
  const int peer = (rank + 1 + j) % world;
  char* dst = peers[peer] + dst_offset + (uint64_t)rank * bytes;
  for (int s = 0; s < STAGES; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const uint64_t chunks = (bytes + CHUNK - 1) / CHUNK;
  uint32_t phase = 0;
  // windows of STAGES chunks: load them all (local reads into shared memory), then store
  // each to the peer as it lands; the next window reuses the buffers once those stores
  // have read them (their writes to the peer may still be in flight)
  for (uint64_t c0 = blockIdx.x % ctas_per_peer; c0 < chunks; c0 += (uint64_t)STAGES * ctas_per_peer) {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    int in_window = 0;
    for (int s = 0; s < STAGES; ++s) {
      const uint64_t c = c0 + (uint64_t)s * ctas_per_peer;
      if (c >= chunks) break;
      const uint64_t off = c * CHUNK;
      const uint32_t n = (uint32_t)(bytes - off < CHUNK ? bytes - off : CHUNK);
      const uint32_t bar = smem_u32(&full[s]);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(smem_u32(buf + s * CHUNK)), "l"(src + off), "r"(n), "r"(bar) : "memory");
      ++in_window;
    }
    for (int s = 0; s < in_window; ++s) {
      const uint64_t off = (c0 + (uint64_t)s * ctas_per_peer) * CHUNK;
      const uint32_t n = (uint32_t)(bytes - off < CHUNK ? bytes - off : CHUNK);
      asm volatile(
          "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n"
          ::"r"(smem_u32(&full[s])), "r"(phase) : "memory");
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + off),
                   "r"(smem_u32(buf + s * CHUNK)), "r"(n) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    phase ^= 1;
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
