// One-row matmuls (batch-1 decode) for CPUs: y = x W, streaming the weights with every core.
//
// An XLA FFI custom call built with paged_context.cc (kernels_pallas/native_cpu.py). XLA:CPU
// runs a one-row float32 dot at ~22 GB/s on the 2-core machine and a one-row bfloat16 dot by
// converting the whole weight to float32 first; this reads each weight once, split over the
// intra-op threads (parallel.h), in its stored type.
//
// Inputs: x [K] float32; one or more weights w_i [K, N_i] (transposed = 0: y_i[n] = sum_k x[k]
// w_i[k, n]) or [N_i, K] (transposed = 1: y_i[n] = sum_k w_i[n, k] x[k], the lm head's layout and
// the float32 projections pre-packed for the AMX tiles), q/k/v or gate/up in one call, float32 or
// bfloat16. Outputs: y_i [N_i] float32.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bits.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return jaxserve_native::bf16_to_f32(p[i]); }  // bf16 bits

// One weight [K, N] of a call and its output.
struct Operand {
  const void* w;
  float* y;
  int64_t N;
};

// Rows [k0, k1) of w [K, N] times x into acc [N] (added).
template <typename T>
void rows_into(const float* x, const T* w, float* acc, int64_t k0, int64_t k1, int64_t N) {
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {  // four rows per pass: the partial sums are loaded and stored 4x less
    const float x0 = x[k], x1 = x[k + 1], x2 = x[k + 2], x3 = x[k + 3];
    const T *r0 = w + k * N, *r1 = r0 + N, *r2 = r1 + N, *r3 = r2 + N;
#pragma omp simd
    for (int64_t n = 0; n < N; ++n)
      acc[n] += x0 * load(r0, n) + x1 * load(r1, n) + x2 * load(r2, n) + x3 * load(r3, n);
  }
  for (; k < k1; ++k) {
    const float xk = x[k];
    const T* row = w + k * N;
#pragma omp simd
    for (int64_t n = 0; n < N; ++n) acc[n] += xk * load(row, n);
  }
}

// w_i [K, N_i]: each thread takes a contiguous run of rows of every weight (one stream through
// memory each) into its own partial sums, which are added at the end. Several weights in one
// call: one fan-out to the threads instead of one each.
template <typename T>
void rows_times(ffi::ThreadPool& pool, const float* x, const std::vector<Operand>& ops, int64_t K) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), K / 64));
  int64_t total = 0;
  for (const Operand& op : ops) total += op.N;
  std::vector<float> partial(static_cast<size_t>(threads) * total, 0.0f);
  jaxserve_native::parallel_for(pool, threads, threads, [&](int64_t t) {
    const int64_t k0 = K * t / threads, k1 = K * (t + 1) / threads;
    float* acc = partial.data() + t * total;
    for (const Operand& op : ops) {
      rows_into(x, static_cast<const T*>(op.w), acc, k0, k1, op.N);
      acc += op.N;
    }
  });
  int64_t offset = 0;
  for (const Operand& op : ops) {
    std::copy(partial.begin() + offset, partial.begin() + offset + op.N, op.y);
    for (int64_t t = 1; t < threads; ++t)
      for (int64_t n = 0; n < op.N; ++n) op.y[n] += partial[t * total + offset + n];
    offset += op.N;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
using jaxserve_native::dot_row;   // sum_k w[k] x[k] of one [N, K] row
#else   // without AVX-512: every row one at a time
template <typename T>
inline float dot_row(const float* x, const T* w, int64_t K) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < K; ++k) sum += load(w, k) * x[k];
  return sum;
}
#endif

// w_i [N_i, K]: one dot product per output. The outputs of every weight (q/k/v in one call) are
// cut into a few runs per thread (a late helper leaves less to the others), and each run into
// four strands read side by side, a row of each at a time. One sequential stream per thread
// read 19-24 GB/s from memory on the 2-core machine, four 25-30 (benchmarks/RESULTS.md): the
// prefetchers follow each strand through its own pages (16 neighbouring rows side by side read the
// lm head ~1.3x slower than one row at a time, an earlier round). Rows side by side do not change a
// row's sums (`dot_rows_at`).
template <typename T>
void dots(ffi::ThreadPool& pool, const float* x, const std::vector<Operand>& ops, int64_t K) {
  constexpr int kStrands = 4;
  int64_t total = 0;
  for (const Operand& op : ops) total += op.N;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads()), runs = std::min<int64_t>(total, 4 * threads);
  auto row = [&](int64_t n, const T*& w, float*& y) {   // row n of the weights end to end
    for (const Operand& op : ops) {
      if (n < op.N) {
        w = static_cast<const T*>(op.w) + n * K, y = op.y + n;
        return;
      }
      n -= op.N;
    }
  };
  jaxserve_native::parallel_for(pool, runs, threads, [&](int64_t r) {
    const int64_t n0 = total * r / runs, len = total * (r + 1) / runs - n0;
    const int64_t strand = (len + kStrands - 1) / kStrands;   // rows a strand
    for (int64_t i = 0; i < strand; ++i) {
      const T* w[kStrands];
      float* y[kStrands];
      int c = 0;
      for (int s = 0; s < kStrands; ++s)
        if (s * strand + i < len) row(n0 + s * strand + i, w[c], y[c]), ++c;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      static_assert(kStrands == 4);
      if (c == 4) jaxserve_native::dot_rows_at<4>(x, w, K, y);
      else if (c == 3) jaxserve_native::dot_rows_at<3>(x, w, K, y);   // the last rows of a run
      else if (c == 2) jaxserve_native::dot_rows_at<2>(x, w, K, y);
      else *y[0] = dot_row(x, w[0], K);
#else
      for (int s = 0; s < c; ++s) *y[s] = dot_row(x, w[s], K);
#endif
    }
  });
}

ffi::Error MatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys,
                      int64_t transposed) {
  if (ws.size() == 0 || ws.size() != ys.size())
    return ffi::Error::InvalidArgument("matvec takes one result per weight");
  const int64_t K = static_cast<int64_t>(x.element_count());
  std::vector<Operand> ops;
  ffi::DataType type = ffi::DataType::F32;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("matvec: a weight or result of a wrong type");
    const auto wd = w->dimensions();
    if (wd.size() != 2) return ffi::Error::InvalidArgument("w must be rank 2");
    const int64_t k = transposed ? wd[1] : wd[0], n = transposed ? wd[0] : wd[1];
    if (k != K || (*y)->element_count() != static_cast<size_t>(n))
      return ffi::Error::InvalidArgument("x, w and y sizes disagree");
    if (w->element_type() != ffi::DataType::F32 && w->element_type() != ffi::DataType::BF16)
      return ffi::Error::InvalidArgument("w must be float32 or bfloat16");
    if (i > 0 && w->element_type() != type) return ffi::Error::InvalidArgument("the weights must share one dtype");
    type = w->element_type();
    ops.push_back({w->untyped_data(), (*y)->typed_data(), n});
  }
  const float* xp = x.typed_data();
  if (type == ffi::DataType::F32) {
    transposed ? dots<float>(pool, xp, ops, K) : rows_times<float>(pool, xp, ops, K);
  } else {
    transposed ? dots<uint16_t>(pool, xp, ops, K) : rows_times<uint16_t>(pool, xp, ops, K);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatvec, MatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .RemainingArgs()                // weights w_i
                                  .RemainingRets()                // results y_i float32
                                  .Attr<int64_t>("transposed"));
