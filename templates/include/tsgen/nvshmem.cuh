// tsgen/nvshmem.cuh -- running a communication plan over NVSHMEM.
//
// Hand-written; included by nvshmem-transport sources, after tsgen/plan.cuh in
// collectives (its plan executor is compiled only where TSGEN_PLAN_CUH is defined). The plan is the same data the p2p interpreter runs
// (tsgen/plan.cuh) with the same block schedule; only the way bytes and
// signals cross between ranks changes, so the same `tsgen verify` covers it:
//
//   plan                          p2p (tsgen/plan.cuh)            nvshmem (here)
//   copy to a peer + its signal   peer stores; red.release.sys    nvshmemx_putmem_signal_nbi_block(
//                                                                   ..., NVSHMEM_SIGNAL_ADD, pe)
//   copy from a peer (pull)       peer loads                      nvshmemx_getmem_block
//   local copy / local reduce     loads and stores                the same loads and stores
//   signal with no put            red.release.sys (peer ptr)      fence.sc.sys + nvshmemx_signal_op
//   wait                          ld.acquire.sys spin, timeout    the same spin, then
//                                                                   nvshmem_signal_wait_until
//
// Every share still adds exactly 1 to each of its counters (the put's signal
// *is* the share's signal), so the per-call targets epoch * per_call of the
// plan are unchanged. Reductions must be local (the spec check refuses plans
// whose reductions touch a peer's memory: NVSHMEM moves remote data only by
// put and get, and a reduction over nvshmem_ptr would work on NVLink only).
//
// Addresses: every rank's heap is one nvshmem_malloc'd region with the same
// layout, so the kernel's buffer arguments are this PE's symmetric addresses
// and NVSHMEM translates them for the target PE. `peers` is not used. The
// rank argument must equal nvshmem_my_pe() (checked once per block).
//
// The primitives with `transport: nvshmem` (put/get at warp and block level,
// simple_shift, barrier_all) use the first part only: the PE check, the
// bounded signal wait and the all-PE barrier; the plan executor below needs
// tsgen/plan.cuh and is compiled only after it.
#ifndef TSGEN_NVSHMEM_CUH
#define TSGEN_NVSHMEM_CUH

#include <nvshmem.h>
#include <nvshmemx.h>

#include "tsgen/ptx.cuh"
#include "tsgen/sync.cuh"

namespace tsgen {
namespace nvshmem {

// The rank the runtime passes is the PE this kernel runs as: NVSHMEM names
// target PEs by number, the plan by rank. A mismatch would send every put to
// the wrong GPU, so it traps with a message instead.
static __device__ __noinline__ void check_pe(int rank, int world) {
  const int pe = nvshmem_my_pe(), npes = nvshmem_n_pes();
  if (pe != rank || npes != world) {
    printf("tsgen: nvshmem: kernel for world size %d launched as rank %d, but NVSHMEM says PE %d of %d "
           "(initialize NVSHMEM with PE = rank over all ranks, and call nvshmemx_cumodule_init on this "
           "module)\n",
           world, rank, pe, npes);
    __trap();
  }
}

static __device__ __noinline__ __attribute__((noreturn)) void remote_reduce_trap(int rank,
                                                                                       int owner) {
  printf("tsgen: nvshmem: rank %d: a reduce step touches the memory of rank %d; the nvshmem transport "
         "reduces local memory only (the spec check should have refused this plan)\n",
         rank, owner);
  __trap();
}

// Wait until this PE's counter reaches `expected`. The spin is the repo's
// bounded one (ld.acquire.sys; prints who waited for what and traps after
// TSGEN_TIMEOUT_NS); once the value is there, nvshmem_signal_wait_until
// returns at once but runs the transport's consistency step (over IB/IBGDA,
// data that arrived before the signal is made visible to this GPU's loads),
// which a plain acquire load cannot do for NIC writes.
static __device__ __forceinline__ void wait_ge(uint64_t* sig, uint64_t expected, site at) {
  wait_ge_acquire_sys(sig, expected, at);
  nvshmem_signal_wait_until(sig, NVSHMEM_CMP_GE, expected);
}

// Every block of every PE meets here: the blocks of this grid first
// (barrier_blocks, generation 2g - 1), then block 0 meets the other PEs
// with nvshmemx_barrier_all_block (which also completes this PE's puts), then
// the grid again (2g). One block calls the NVSHMEM barrier: collectives on a
// team must not run concurrently.
static __device__ __forceinline__ void barrier_all(uint64_t* counter, int rank,
                                                   uint64_t generation) {
  barrier_blocks(counter, 2 * generation - 1, rank);
  if (blockIdx.x == 0) {
    // block 0 has acquired every block's arrival: its fence makes their stores
    // visible system-wide before the barrier tells the other PEs to go on
    __threadfence_system();
    nvshmemx_barrier_all_block();
  }
  barrier_blocks(counter, 2 * generation, rank);
}

#ifdef TSGEN_PLAN_CUH  // the plan executor

// Raise the step's signals [from, nsignal) by one, one thread per counter. The
// caller has synchronized the block after the share's data movement:
// fence.sc.sys after that bar.sync makes the whole block's stores (local
// ones, read by a peer's get or by NVLink) visible before the signal, which
// nvshmemx_signal_op alone does not order (over NVLink it is a relaxed atomic).
static __device__ __forceinline__ void signal(const step& st, int from,
                                              char* const* bufs) {
  const int i = (int)threadIdx.x + from;
  if (i < st.nsignal) {
    const step_signal s = st.signal[i];
    __threadfence_system();
    nvshmemx_signal_op((uint64_t*)bufs[s.buf] + s.index, 1ull, NVSHMEM_SIGNAL_ADD, s.rank);
  }
}

// Index of the first signal a put to `pe` can carry (a counter on the same
// PE), or -1.
static __device__ __forceinline__ int fusable(const step& st, int pe) {
  for (int i = 0; i < st.nsignal && i < TSGEN_MAX_SIGNALS; ++i)
    if (st.signal[i].rank == pe) return i;
  return -1;
}

// Execute this block's shares of the plan (see run_plan for the p2p
// form). Every thread of the block runs every share: the *_block NVSHMEM
// calls are collective over the block.
template <typename T, int UNROLL, int WORLD>
static __device__ __forceinline__ void run_plan(const step* steps,
                                                const share* shares, int first,
                                                int last, int rank, uint64_t epoch,
                                                uint64_t count, char* const* bufs,
                                                const char* const* names) {
  if (threadIdx.x == 0) check_pe(rank, WORLD);
  for (int k = first; k < last; ++k) {
    const share sh = shares[k];
    const step& st = steps[sh.step];
    if (threadIdx.x < st.nwait) {  // one thread per counter, all in this PE's memory
      const step_wait w = st.wait[threadIdx.x];
      wait_ge((uint64_t*)bufs[w.buf] + w.index, epoch * w.per_call,
              make_site(names[w.buf], rank, rank, w.index));
    }
    __syncthreads();
    int signalled = 0;  // signals [0, signalled) travelled with a put
    int fused = -1;
    if (st.op != TSGEN_OP_NONE) {
      uint64_t lo, hi;
      share_range<T>(st.dst, count, sh.share, sh.shares, &lo, &hi);
      T* dst = (T*)bufs[st.dst.buf] + lo;  // symmetric address: this PE's copy
      if (st.op == TSGEN_OP_COPY) {
        uint64_t slo, shi;
        share_range<T>(st.src[0], count, sh.share, sh.shares, &slo, &shi);
        T* src = (T*)bufs[st.src[0].buf] + slo;
        const size_t bytes = (size_t)(hi > lo ? hi - lo : 0) * sizeof(T);
        if (st.dst.rank != rank) {  // put (the source is ours: the spec check refuses remote -> remote)
          fused = fusable(st, st.dst.rank);
          if (fused >= 0) {
            const step_signal s = st.signal[fused];
            // Data then signal, in that order at the target: the share's +1 is
            // the put's own signal. An empty share still signals (0 bytes).
            if (bytes)
              nvshmemx_putmem_signal_nbi_block(dst, src, bytes, (uint64_t*)bufs[s.buf] + s.index, 1ull,
                                               NVSHMEM_SIGNAL_ADD, st.dst.rank);
            else if (threadIdx.x == 0)
              nvshmemx_signal_op((uint64_t*)bufs[s.buf] + s.index, 1ull, NVSHMEM_SIGNAL_ADD, st.dst.rank);
          } else if (bytes) {
            nvshmemx_putmem_nbi_block(dst, src, bytes, st.dst.rank);
          }
          if (st.nsignal > (fused >= 0 ? 1 : 0)) {
            // Other counters (other PEs, or more than one) must not move before
            // the data has landed: quiet completes this thread's puts (over NVLink
            // a fence.sc.sys, over IB a wait for the NIC's completions). Every
            // thread quiets: which threads issued a block put is NVSHMEM's choice.
            nvshmem_quiet();
          }
        } else if (st.src[0].rank != rank) {  // get: blocking, the data is here when it returns
          if (bytes) nvshmemx_getmem_block(dst, src, bytes, st.src[0].rank);
        } else if (hi > lo) {  // local copy
          copy_elems<T, UNROLL>(dst, src, hi - lo, st.src[0].read_only, threadIdx.x, blockDim.x);
        }
      } else if (hi > lo) {  // reduce: local operands only
        if (st.dst.rank != rank) remote_reduce_trap(rank, st.dst.rank);
        T* srcs[TSGEN_MAX_SRCS];
        TSGEN_FOR_SRC(j, st.nsrc) {
          if (st.src[j].rank != rank) remote_reduce_trap(rank, st.src[j].rank);
          uint64_t slo, shi;
          share_range<T>(st.src[j], count, sh.share, sh.shares, &slo, &shi);
          srcs[j] = (T*)bufs[st.src[j].buf] + slo;
        }
        reduce_elems<T, (UNROLL > 2 ? UNROLL / 2 : 1)>(dst, srcs, st.nsrc, hi - lo, threadIdx.x,
                                                      blockDim.x);
      }
    }
    __syncthreads();
    if (fused == 0) {
      signalled = 1;  // the common case: the put carried the step's only (first) signal
    } else if (fused > 0) {
      // A fused signal that is not first: raise the others around it.
      if (threadIdx.x < st.nsignal && (int)threadIdx.x != fused) {
        const step_signal s = st.signal[threadIdx.x];
        __threadfence_system();
        nvshmemx_signal_op((uint64_t*)bufs[s.buf] + s.index, 1ull, NVSHMEM_SIGNAL_ADD, s.rank);
      }
      continue;
    }
    signal(st, signalled, bufs);
  }
  // A non-blocking put may still be reading its source when the kernel would
  // end (over IB: the NIC reads it later). The caller may then overwrite the
  // input, so complete every put of this block before the call is over.
  nvshmem_quiet();
}

#endif  // TSGEN_PLAN_CUH

}  // namespace nvshmem
}  // namespace tsgen

#endif  // TSGEN_NVSHMEM_CUH
