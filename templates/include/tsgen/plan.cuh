// tsgen/plan.cuh -- the interpreter of communication plans.
//
// Hand-written; included by every collective.
//
// A plan is data (see tsgen/plan.py): per rank a list of steps, per block
// the list of step shares it executes in order. A share: wait until every
// listed counter of this rank reaches epoch * per_call (acquire, sys scope),
// copy or reduce its part of the step's element range, then add 1 to every
// listed counter (release, sys scope) in whichever rank's memory holds it.
// `tsgen verify` runs the same tables on the CPU under many interleavings.
// A small plan is also rendered as straight-line code (plan<W>::run) that
// makes the same share calls with each step a compile-time constant.
#ifndef TSGEN_PLAN_CUH
#define TSGEN_PLAN_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "tsgen/ptx.cuh"
#include "tsgen/sync.cuh"
#include "tsgen/copy.cuh"

// The table limits: a generated source defines them from tsgen.plan.ir before its includes;
// these defaults, the same values, serve this header used alone.
#ifndef TSGEN_MAX_SRCS
#define TSGEN_MAX_SRCS 8
#endif
#ifndef TSGEN_MAX_WAITS
#define TSGEN_MAX_WAITS 8
#endif
#ifndef TSGEN_MAX_SIGNALS
#define TSGEN_MAX_SIGNALS 8
#endif
#ifndef TSGEN_MAX_ALSO
#define TSGEN_MAX_ALSO 7
#endif

enum { TSGEN_OP_NONE = 0, TSGEN_OP_COPY = 1, TSGEN_OP_REDUCE = 2 };

namespace tsgen {

// Part of a data buffer: unit `unit` of `count` elements, piece `piece` of
// `pieces` (piece boundaries are multiples of 16 bytes within the unit).
struct slice {
  int8_t rank;      // whose memory
  uint8_t buf;      // index into the kernel's buffer table
  uint8_t read_only;  // source not written while the kernel runs: ld.global.nc
  uint8_t pieces;
  uint16_t unit;
  uint16_t piece;
};

struct step_wait {
  uint8_t buf;       // signal buffer (this rank's memory)
  uint8_t pad;
  uint16_t index;
  uint32_t per_call; // adds the counter receives per call
};

struct step_signal {
  int8_t rank;  // whose memory holds the counter
  uint8_t buf;
  uint16_t index;
};

struct step {
  uint8_t op, nsrc, nwait, nsignal, nalso;
  slice dst;
  slice src[TSGEN_MAX_SRCS];
  slice also[TSGEN_MAX_ALSO];  // (reduce) more destinations, written with dst's values
  step_wait wait[TSGEN_MAX_WAITS];
  step_signal signal[TSGEN_MAX_SIGNALS];
};

// Loop over sources, unrolled to the table limit so that arrays indexed by j
// stay in registers (a run-time index would move them to local memory).
#define TSGEN_FOR_SRC(j, n) _Pragma("unroll") for (int j = 0; j < TSGEN_MAX_SRCS; ++j) if (j < (n))

struct share {
  uint16_t step, share, shares;
};

// A share table as the source writes it, run-length encoded twice: a run stands for the n
// entries {step + k*dstep, share + k*dshare, shares}, k = 0..n-1, written reps times, the
// m-th time with step + m*rstep and share + m*rshare (m = 0..reps-1). share_table<N> holds
// the expanded table, computed at compile time (the device sees the plain entries).
struct share_run {
  uint16_t step, share, shares, n;
  int16_t dstep, dshare;
  uint16_t reps;
  int16_t rstep, rshare;
};
template <int N>
struct share_table {
  share v[N];
};
template <int N, int R>
static __host__ __device__ constexpr share_table<N> expand_shares(const share_run (&runs)[R]) {
  share_table<N> t{};
  int k = 0;
  for (int i = 0; i < R; ++i)
    for (int m = 0; m < runs[i].reps; ++m)
      for (int j = 0; j < runs[i].n; ++j)
        t.v[k++] = share{uint16_t(runs[i].step + m * runs[i].rstep + j * runs[i].dstep),
                         uint16_t(runs[i].share + m * runs[i].rshare + j * runs[i].dshare), runs[i].shares};
  return t;
}

// Element range [*lo, *hi) of slice `s`'s share `share` of `shares`.
template <typename T>
static __host__ __device__ __forceinline__ void share_range(const slice& s, uint64_t count,
                                                         int share, int shares, uint64_t* lo,
                                                         uint64_t* hi) {
  constexpr uint64_t VEC = 16 / sizeof(T);
  uint64_t piece = (count + s.pieces - 1) / s.pieces;
  piece = (piece + VEC - 1) / VEC * VEC;
  uint64_t b = (uint64_t)s.piece * piece, e = b + piece;
  b = b < count ? b : count;
  e = e < count ? e : count;
  uint64_t part = (e - b + shares - 1) / shares;
  part = (part + VEC - 1) / VEC * VEC;
  uint64_t sb = b + (uint64_t)share * part, se = sb + part;
  *lo = (uint64_t)s.unit * count + (sb < e ? sb : e);
  *hi = (uint64_t)s.unit * count + (se < e ? se : e);
}

template <typename T>
static __device__ __forceinline__ T* slice_ptr(const slice& s, char* const* bufs,
                                               char* const* peers, int rank) {
  T* local = (T*)bufs[s.buf];
  return s.rank == rank ? local : peer_ptr(local, peers, rank, s.rank);
}

// Copy n elements; fast path when both ends share their alignment mod 16.
template <typename T, int UNROLL>
static __device__ __forceinline__ void copy_elems(T* dst, const T* src, uint64_t n,
                                                  bool read_only, uint32_t tid,
                                                  uint32_t nthreads) {
  const uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
  if (((d ^ s) & 15) == 0) {
    uint64_t head = ((16 - (d & 15)) & 15) / sizeof(T);
    head = head < n ? head : n;
    for (uint64_t i = tid; i < head; i += nthreads) dst[i] = src[i];
    if (read_only)
      copy<UNROLL, true>(dst + head, src + head, (n - head) * sizeof(T), tid, nthreads);
    else
      copy<UNROLL, false>(dst + head, src + head, (n - head) * sizeof(T), tid, nthreads);
  } else {
    for (uint64_t i = tid; i < n; i += nthreads) dst[i] = src[i];  // slow path: misaligned
  }
}

// fp32 (int32) accumulation of 16-byte vectors of T.
template <typename T> struct vec_math;
template <> struct vec_math<float> {
  typedef float acc_t;
  static constexpr int N = 4;
  static __device__ __forceinline__ void add(acc_t* a, uint4 v) {
    a[0] += __uint_as_float(v.x); a[1] += __uint_as_float(v.y);
    a[2] += __uint_as_float(v.z); a[3] += __uint_as_float(v.w);
  }
  static __device__ __forceinline__ uint4 pack(const acc_t* a) {
    return make_uint4(__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]),
                      __float_as_uint(a[3]));
  }
  static __device__ __forceinline__ acc_t load1(const float* p) { return *p; }
  static __device__ __forceinline__ float store1(acc_t a) { return a; }
};
template <> struct vec_math<int32_t> {
  typedef int32_t acc_t;
  static constexpr int N = 4;
  static __device__ __forceinline__ void add(acc_t* a, uint4 v) {
    a[0] += (int32_t)v.x; a[1] += (int32_t)v.y; a[2] += (int32_t)v.z; a[3] += (int32_t)v.w;
  }
  static __device__ __forceinline__ uint4 pack(const acc_t* a) {
    return make_uint4((uint32_t)a[0], (uint32_t)a[1], (uint32_t)a[2], (uint32_t)a[3]);
  }
  static __device__ __forceinline__ acc_t load1(const int32_t* p) { return *p; }
  static __device__ __forceinline__ int32_t store1(acc_t a) { return a; }
};
template <> struct vec_math<__nv_bfloat16> {
  typedef float acc_t;
  static constexpr int N = 8;
  static __device__ __forceinline__ void add(acc_t* a, uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 f = __bfloat1622float2(*(const __nv_bfloat162*)&w[i]);
      a[2 * i] += f.x;
      a[2 * i + 1] += f.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const acc_t* a) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h = __floats2bfloat162_rn(a[2 * i], a[2 * i + 1]);
      w[i] = *(uint32_t*)&h;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  static __device__ __forceinline__ acc_t load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  static __device__ __forceinline__ __nv_bfloat16 store1(acc_t a) { return __float2bfloat16_rn(a); }
};
template <> struct vec_math<__half> {
  typedef float acc_t;
  static constexpr int N = 8;
  static __device__ __forceinline__ void add(acc_t* a, uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 f = __half22float2(*(const __half2*)&w[i]);
      a[2 * i] += f.x;
      a[2 * i + 1] += f.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const acc_t* a) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h = __floats2half2_rn(a[2 * i], a[2 * i + 1]);
      w[i] = *(uint32_t*)&h;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
  static __device__ __forceinline__ acc_t load1(const __half* p) { return __half2float(*p); }
  static __device__ __forceinline__ __half store1(acc_t a) { return __float2half_rn(a); }
};

// dst[i] = sum_j srcs[j][i] for i < n, accumulating in acc_t (fp32 for 16-bit
// types). Sources are summed in table order on every rank, so every rank
// computes bit-identical results. NSRC > 0: exactly NSRC sources, and every
// source's loads are issued before the first add (NSRC x UNROLL vectors in
// flight per thread); NSRC = 0: nsrc sources known at run time, one source's
// loads in flight at a time (a load behind `j < nsrc` cannot be hoisted).
template <typename T, int UNROLL, int NSRC>
static __device__ __forceinline__ void reduce_n(T* dst, T* const* srcs, int nsrc, uint64_t n, uint32_t tid,
                                                uint32_t nthreads) {
  typedef vec_math<T> M;
  typedef typename M::acc_t acc_t;
  uintptr_t any = (uintptr_t)dst;
  TSGEN_FOR_SRC(j, nsrc) any |= (uintptr_t)srcs[j];
  uint64_t nvec = (any & 15) == 0 ? n / M::N : 0;  // misaligned: all scalar
  uint4* d = (uint4*)dst;
  uint64_t i = tid;
  for (; i + (uint64_t)(UNROLL - 1) * nthreads < nvec; i += (uint64_t)UNROLL * nthreads) {
    acc_t acc[UNROLL][M::N];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int k = 0; k < M::N; ++k) acc[u][k] = 0;
    if constexpr (NSRC > 0) {
      uint4 v[NSRC][UNROLL];
#pragma unroll
      for (int j = 0; j < NSRC; ++j)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[j][u] = ld_weak_global_v4((const uint4*)srcs[j] + i + (uint64_t)u * nthreads);
#pragma unroll
      for (int j = 0; j < NSRC; ++j)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) M::add(acc[u], v[j][u]);
    } else {
      TSGEN_FOR_SRC(j, nsrc) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = ld_weak_global_v4((const uint4*)srcs[j] + i + (uint64_t)u * nthreads);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) M::add(acc[u], v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) st_weak_global_v4(d + i + (uint64_t)u * nthreads, M::pack(acc[u]));
  }
  for (; i < nvec; i += nthreads) {
    acc_t acc[M::N];
#pragma unroll
    for (int k = 0; k < M::N; ++k) acc[k] = 0;
    TSGEN_FOR_SRC(j, nsrc) M::add(acc, ld_weak_global_v4((const uint4*)srcs[j] + i));
    st_weak_global_v4(d + i, M::pack(acc));
  }
  for (uint64_t e = nvec * M::N + tid; e < n; e += nthreads) {
    acc_t acc = 0;
    TSGEN_FOR_SRC(j, nsrc) acc += M::load1(srcs[j] + e);
    dst[e] = M::store1(acc);
  }
}

// The reduction of a step. Two sources (a ring hop: the partial sum so far + our input) with
// both sources' loads in flight: +4-6 % busbw for reduce_scatter_ring (run 43). More sources
// one at a time: with every load in flight, a table kernel at 4 sources needs more than the
// 64 registers ptxas may give it, and spills. Straight-line code knows nsrc at compile time
// (every source in flight, whatever the count), so there only its case is compiled in.
template <typename T, int UNROLL>
static __device__ __forceinline__ void reduce_elems(T* dst, T* const* srcs, int nsrc, uint64_t n,
                                                    uint32_t tid, uint32_t nthreads) {
  if (nsrc == 2) {
    reduce_n<T, UNROLL, 2>(dst, srcs, 2, n, tid, nthreads);
  } else {
    reduce_n<T, UNROLL, 0>(dst, srcs, nsrc, n, tid, nthreads);
  }
}

// to[m][i] = src[i] for i < n and every m < nto (one load, nto stores: a step's extra
// destinations; `to` points to shared memory).
template <typename T>
static __device__ __forceinline__ void copy_multi(T* const* to, int nto, const T* src, uint64_t n,
                                                  uint32_t tid, uint32_t nthreads) {
  uintptr_t any = (uintptr_t)src;
  for (int m = 0; m < nto; ++m) any |= (uintptr_t)to[m];
  const uint64_t nvec = (any & 15) == 0 ? n * sizeof(T) / 16 : 0;  // misaligned: all scalar
  for (uint64_t i = tid; i < nvec; i += nthreads) {
    const uint4 v = ld_weak_global_v4((const uint4*)src + i);
    for (int m = 0; m < nto; ++m) st_weak_global_v4((uint4*)to[m] + i, v);
  }
  for (uint64_t e = nvec * 16 / sizeof(T) + tid; e < n; e += nthreads) {
    const T v = src[e];
    for (int m = 0; m < nto; ++m) to[m][e] = v;
  }
}

// A plan's opening signal (its entry step, rendered as code): block 0 raises counter
// `index` of signal buffer `sig` at every peer q with bit q of `peer_mask`, before
// anything else. Relaxed: no write of this kernel precedes it, and what it stands for --
// this rank's input, written before the kernel in stream order, and its last call's reads
// of peers, finished -- is complete (PyTorch's symm-mem entry barrier is relaxed too).
static __device__ __forceinline__ void open_signal(uint32_t peer_mask, char* sig, int index, int rank,
                                                   char* const* peers) {
  if (blockIdx.x == 0 && threadIdx.x < 32 && ((peer_mask >> threadIdx.x) & 1u))
    red_add_relaxed_sys_global_u64(peer_ptr((uint64_t*)sig + index, peers, rank, (int)threadIdx.x), 1ull);
}

// This thread's entry of one of a step's lists (waits, signals, extra destinations; thread
// j < n takes entry j), picked by unrolled compares instead of a run-time index: when the
// step is a compile-time constant (straight-line plans), so is every entry, and nothing
// is read from the tables.
template <typename E, int MAX>
static __device__ __forceinline__ E entry(const E (&list)[MAX], int n) {
  E e = list[0];
#pragma unroll
  for (int j = 1; j < MAX; ++j)
    if (j < n && threadIdx.x == (unsigned)j) e = list[j];
  return e;
}

// One share of a step, as a block runs it: wait until every listed counter of this rank
// reaches epoch * per_call (one thread per counter), copy or reduce share `share` of
// `shares` of the step's element range, then add 1 to every listed counter (one thread
// each). Reductions keep UNROLL / 2 vectors per thread in flight per source (their fp32
// accumulators cost registers; with several sources there is as much memory parallelism
// as a copy's UNROLL). The table interpreter below calls it once per share; a small
// plan's straight-line code (plan<W>::run) calls it with a step whose address is a
// compile-time constant, so that every field of the step folds into the code (and the
// loads of every source are issued together: the interpreter, which tests j < nsrc at
// run time, has one source's in flight at a time, in fewer registers).
template <typename T, int UNROLL>
static __device__ __forceinline__ void run_share(const step& st, int share, int shares, int rank,
                                                 uint64_t epoch, uint64_t count, char* const* bufs,
                                                 char* const* peers, const char* const* names) {
  if (threadIdx.x < st.nwait) {  // one thread per counter
    const step_wait w = entry(st.wait, st.nwait);
    wait_ge_acquire_sys((const uint64_t*)bufs[w.buf] + w.index, epoch * w.per_call,
                        make_site(names[w.buf], rank, rank, w.index));
  }
  __syncthreads();
  if (st.op != TSGEN_OP_NONE) {
    uint64_t lo, hi;
    share_range<T>(st.dst, count, share, shares, &lo, &hi);
    T* dst = slice_ptr<T>(st.dst, bufs, peers, rank);
    const int nalso = st.nalso;
    __shared__ T* more[TSGEN_MAX_ALSO];  // the extra destinations' pointers (same range as dst)
    if (nalso) {  // the same for the whole block
      if (threadIdx.x < (unsigned)nalso) {
        const slice a = entry(st.also, nalso);
        uint64_t alo, ahi;
        share_range<T>(a, count, share, shares, &alo, &ahi);
        more[threadIdx.x] = slice_ptr<T>(a, bufs, peers, rank) + alo;
      }
      __syncthreads();
    }
    if (hi > lo) {
      if (st.op == TSGEN_OP_COPY) {
        uint64_t slo, shi;
        share_range<T>(st.src[0], count, share, shares, &slo, &shi);
        const T* src = slice_ptr<T>(st.src[0], bufs, peers, rank);
        copy_elems<T, UNROLL>(dst + lo, src + slo, hi - lo, st.src[0].read_only,
                              threadIdx.x, blockDim.x);
      } else {
        T* srcs[TSGEN_MAX_SRCS];
        TSGEN_FOR_SRC(j, st.nsrc) {
          uint64_t slo, shi;
          share_range<T>(st.src[j], count, share, shares, &slo, &shi);
          srcs[j] = slice_ptr<T>(st.src[j], bufs, peers, rank) + slo;
        }
        reduce_elems<T, (UNROLL > 2 ? UNROLL / 2 : 1)>(dst + lo, srcs, st.nsrc, hi - lo, threadIdx.x,
                                                      blockDim.x);
        if (nalso) {  // the sums, as this block wrote them, to the extra destinations
          __syncthreads();
          copy_multi<T>(more, nalso, dst + lo, hi - lo, threadIdx.x, blockDim.x);
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < st.nsignal) {  // one thread per counter
    const step_signal s = entry(st.signal, st.nsignal);
    uint64_t* c = (uint64_t*)bufs[s.buf] + s.index;
    red_add_release_sys_global_u64(s.rank == rank ? c : peer_ptr(c, peers, rank, s.rank), 1ull);
  }
}

// A small plan's straight-line code (plan<W>::run, templates/ops/plan_tables.cu.j2) runs
// share SHARE of SHARES of step ST with this, one line per block group: it names run's own
// template and function parameters (T, UNROLL, rank, epoch, count, bufs, peers) and the
// op's buffer_names.
#define TSGEN_RUN_SHARE(ST, SHARE, SHARES) \
  tsgen::run_share<T, UNROLL>(ST, SHARE, SHARES, rank, epoch, count, bufs, peers, buffer_names)

// Execute this block's shares of the plan: shares[first..last) of this rank's tables.
template <typename T, int UNROLL>
static __device__ __forceinline__ void run_plan(const step* steps,
                                                const share* shares, int first,
                                                int last, int rank, uint64_t epoch,
                                                uint64_t count, char* const* bufs,
                                                char* const* peers,
                                                const char* const* names) {
  for (int k = first; k < last; ++k) {
    const share sh = shares[k];
    run_share<T, UNROLL>(steps[sh.step], sh.share, sh.shares, rank, epoch, count, bufs, peers, names);
  }
}

}  // namespace tsgen

#endif  // TSGEN_PLAN_CUH
