// tsgen/ce.cuh -- running a communication plan on the copy engines.
//
// Hand-written; included by copy-engine collectives (it includes tsgen/plan.cuh).
//
// The plan is the same data the interpreter kernel runs (tsgen/plan.cuh),
// scheduled over streams instead of blocks: every copy step is one
// cudaMemcpyAsync between peer mappings (the DMA engines move the bytes, no
// SM is busy), every reduce step is a kernel over the whole grid, and the
// waits and signals around them are one-block "sync" kernels. Signals keep
// their meaning: counters that only grow, waited for at epoch x per_call,
// with the epoch read from the call counter on the device -- so a captured
// CUDA graph replays correctly. Stream order gives the rest: a step's
// signals are raised only after its copy has completed, its copy starts only
// after its waits returned.
#ifndef TSGEN_CE_CUH
#define TSGEN_CE_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>
#include <tuple>

#include "tsgen/ptx.cuh"
#include "tsgen/sync.cuh"
#include "tsgen/plan.cuh"

#define TSGEN_CE_MAX_STREAMS 32
#define TSGEN_CE_MAX_RANKS 64

namespace tsgen {
namespace ce {

// ---------------------------------------------------------------------------
// Device side: the sync kernel body and the reduce kernel body
// ---------------------------------------------------------------------------

// Raise the signals of step `sig` (after its copy or reduce finished earlier on
// this stream), then wait for the waits of step `wait` (before the next op on
// this stream). One thread per counter, one block.
static __device__ __forceinline__ void sync(const step* steps, int sig, int wait,
                                            int rank, uint64_t epoch, char* const* bufs,
                                            char* const* peers,
                                            const char* const* names) {
  if (sig >= 0 && threadIdx.x < steps[sig].nsignal) {
    // The copy engine's writes completed before this kernel started (stream
    // order); the fence makes that order visible at system scope as well.
    __threadfence_system();
    const step_signal s = steps[sig].signal[threadIdx.x];
    uint64_t* c = (uint64_t*)bufs[s.buf] + s.index;
    red_add_release_sys_global_u64(s.rank == rank ? c : peer_ptr(c, peers, rank, s.rank), 1ull);
  }
  if (wait >= 0 && threadIdx.x < steps[wait].nwait) {
    const step_wait w = steps[wait].wait[threadIdx.x];
    wait_ge_acquire_sys((const uint64_t*)bufs[w.buf] + w.index, epoch * w.per_call,
                        make_site(names[w.buf], rank, rank, w.index));
  }
}

// The reduction of one step, spread over every thread of the grid (its waits
// and signals are done by sync kernels around it on the same stream).
template <typename T, int UNROLL>
static __device__ __forceinline__ void reduce(const step& st, int rank,
                                              uint64_t count, char* const* bufs,
                                              char* const* peers) {
  uint64_t lo, hi;
  share_range<T>(st.dst, count, 0, 1, &lo, &hi);
  if (hi <= lo) return;
  T* srcs[TSGEN_MAX_SRCS];
  TSGEN_FOR_SRC(j, st.nsrc) {
    uint64_t slo, shi;
    share_range<T>(st.src[j], count, 0, 1, &slo, &shi);
    srcs[j] = slice_ptr<T>(st.src[j], bufs, peers, rank) + slo;
  }
  reduce_elems<T, UNROLL>(slice_ptr<T>(st.dst, bufs, peers, rank) + lo, srcs, st.nsrc,
                          hi - lo, blockIdx.x * blockDim.x + threadIdx.x,
                          gridDim.x * blockDim.x);
}

// ---------------------------------------------------------------------------
// Host side: streams, and the copy of one step
// ---------------------------------------------------------------------------

// The side streams of one rank (stream 0 of a plan is the caller's stream),
// with the events that fork them from it and join them back. Made on the current device
// (the rank's) by the module's NAME_wW_prepare before any rank's first call, else at the
// rank's first call (ranks that share a GPU must not share them; made at a first call they
// can stall it: on a GPU shared by ranks, creating a stream waited for the peers' kernels
// already spinning there, measured: docs/lab/shared_gpu.md), kept for the life of the process.
struct lanes {
  cudaStream_t side[TSGEN_CE_MAX_STREAMS];
  cudaEvent_t fork;
  cudaEvent_t join[TSGEN_CE_MAX_STREAMS];
  int device;  // where they were made
  bool ready;
};

static cudaError_t lanes_get(int rank, lanes** out) {
  static lanes all[TSGEN_CE_MAX_RANKS];
  static std::mutex made;  // ranks launch from threads of their own
  if (rank < 0 || rank >= TSGEN_CE_MAX_RANKS) return cudaErrorInvalidValue;
  lanes* l = &all[rank];
  int device;
  std::lock_guard<std::mutex> lock(made);
  TSGEN_TRY(tsgen::lanes_device(l->ready, l->device, &device));  // prepared on another device?
  if (!l->ready) {  // a failed attempt leaves ready false; the next call makes them again
    l->device = device;
    TSGEN_TRY(tsgen::make_lanes({{l->side + 1, TSGEN_CE_MAX_STREAMS - 1, false}},
                                   {{&l->fork, 1}, {l->join + 1, TSGEN_CE_MAX_STREAMS - 1}}));
    l->ready = true;
  }
  *out = l;
  return cudaSuccess;
}

// Streams 1..n-1 start after everything already queued on `stream`.
static cudaError_t fork(cudaStream_t stream, lanes* l, int n) {
  TSGEN_TRY(cudaEventRecord(l->fork, stream));
  for (int i = 1; i < n; ++i) TSGEN_TRY(cudaStreamWaitEvent(l->side[i], l->fork, 0));
  return cudaSuccess;
}

// `stream` continues after everything queued on streams 1..n-1.
static cudaError_t join(cudaStream_t stream, lanes* l, int n) {
  for (int i = 1; i < n; ++i) {
    TSGEN_TRY(cudaEventRecord(l->join[i], l->side[i]));
    TSGEN_TRY(cudaStreamWaitEvent(stream, l->join[i], 0));
  }
  return cudaSuccess;
}

// Address of slice `s` as this process sees it: local buffers directly, a
// peer's through its heap base in `peers_host` (same offset in every heap).
template <typename T>
static T* slice_ptr(const slice& s, char* const* bufs, char* const* peers_host,
                    int rank, uint64_t elem) {
  char* local = bufs[s.buf] + elem * sizeof(T);
  return (T*)(s.rank == rank ? local : peers_host[s.rank] + (local - peers_host[rank]));
}

// The copy of one plan step (dst = src) as a DMA transfer.
template <typename T>
static cudaError_t copy(cudaStream_t stream, const slice& dst, const slice& src,
                        char* const* bufs, char* const* peers_host, int rank,
                        uint64_t count) {
  uint64_t lo, hi, slo, shi;
  share_range<T>(dst, count, 0, 1, &lo, &hi);
  share_range<T>(src, count, 0, 1, &slo, &shi);
  if (hi <= lo) return cudaSuccess;
  return cudaMemcpyAsync(slice_ptr<T>(dst, bufs, peers_host, rank, lo),
                         slice_ptr<T>(src, bufs, peers_host, rank, slo),
                         (hi - lo) * sizeof(T), cudaMemcpyDefault, stream);
}


// ---------------------------------------------------------------------------
// Host side: one call (a module's NAME_wW_launch) and its prepare
// ---------------------------------------------------------------------------

// What a rank's stream program enqueues, on stream b of the call (0: the caller's): sync (the
// signals of step `sig`, then the waits of step `wait`: the SYNC kernel, one block), copy (a
// copy step's DMA transfer) and reduce (a reduce step's REDUCE kernel, GRID x BLOCK). `args`
// are the kernels' calling-convention arguments, passed before their own. After the first
// error nothing more is enqueued; `err` keeps it.
template <typename T, int NSTREAMS, unsigned GRID, unsigned BLOCK, auto SYNC, auto REDUCE, typename... Args>
struct queue {
  cudaStream_t s[NSTREAMS];
  char* const* bufs;
  char* const* peers_host;
  int rank;
  uint64_t count;
  std::tuple<Args...> args;
  cudaError_t err;

  void sync(int b, int sig, int wait) {
    if (err != cudaSuccess) return;
    std::apply([&](auto... a) { SYNC<<<1, 32, 0, s[b]>>>(a..., sig, wait); }, args);
    err = cudaGetLastError();
  }
  void copy(int b, const slice& dst, const slice& src) {
    if (err == cudaSuccess) err = tsgen::ce::copy<T>(s[b], dst, src, bufs, peers_host, rank, count);
  }
  void reduce(int b, int step) {
    if (err != cudaSuccess) return;
    std::apply([&](auto... a) { REDUCE<<<GRID, BLOCK, 0, s[b]>>>(a..., step); }, args);
    err = cudaGetLastError();
  }
};

// One call of rank `rank` (world size WORLD): streams 1..NSTREAMS-1 forked from `stream`,
// `program(q)` enqueues the rank's stream program through a queue q, the streams are joined
// back (after an error too: an unjoined fork would break a stream capture and hide the error),
// then END marks the call over. Returns the first CUDA error. bufs: the plan's buffer table;
// peers_host: the heap bases in host memory; args: the kernels' calling-convention arguments.
template <typename T, int WORLD, int NSTREAMS, unsigned GRID, unsigned BLOCK, auto SYNC, auto REDUCE, auto END,
          class Program, typename... Args>
static cudaError_t launch(cudaStream_t stream, char* const* peers_host, char* const* bufs, int rank, uint64_t* calls,
                          uint64_t count, Program program, Args... args) {
  static_assert(NSTREAMS >= 1 && NSTREAMS <= TSGEN_CE_MAX_STREAMS, "a plan's streams fit the lanes");
  if (rank < 0 || rank >= WORLD) return cudaErrorInvalidValue;
  TSGEN_TRY(tsgen::use_device_of(calls));
  lanes* l = nullptr;
  TSGEN_TRY(lanes_get(rank, &l));
  queue<T, NSTREAMS, GRID, BLOCK, SYNC, REDUCE, Args...> q{{stream}, bufs, peers_host, rank, count, {args...}, cudaSuccess};
  for (int i = 1; i < NSTREAMS; ++i) q.s[i] = l->side[i];
  TSGEN_TRY(fork(stream, l, NSTREAMS));
  program(q);
  const cudaError_t joined = join(stream, l, NSTREAMS);
  if (q.err != cudaSuccess) return q.err;
  if (joined != cudaSuccess) return joined;
  END<<<1, 1, 0, stream>>>(calls);
  return cudaGetLastError();
}

// Rank `rank`'s side streams, made on `device` before any rank's first call (the manifest's
// "prepare"; see lanes).
template <int WORLD>
static cudaError_t prepare(int rank, int device) {
  TSGEN_TRY(tsgen::prepare_on(WORLD, rank, device));
  lanes* l = nullptr;
  return lanes_get(rank, &l);
}

}  // namespace ce
}  // namespace tsgen

#endif  // TSGEN_CE_CUH
