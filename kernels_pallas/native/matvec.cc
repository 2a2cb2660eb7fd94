// One-row matmuls (batch-1 decode) for CPUs: y = x W, streaming the weights with every core.
//
// An XLA FFI custom call built with paged_context.cc (kernels_pallas/native_cpu.py). XLA:CPU
// runs a one-row float32 dot at ~22 GB/s on the 2-core machine and a one-row bfloat16 dot by
// converting the whole weight to float32 first; this reads each weight once, split over the
// intra-op threads (parallel.h), in its stored type.
//
// Inputs: x [K] float32; w [K, N] (transposed = 0: y[n] = sum_k x[k] w[k, n]) or [N, K]
// (transposed = 1: y[n] = sum_k w[n, k] x[k], the lm head's layout), float32 or bfloat16.
// Output: y [N] float32.

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bits.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return jaxserve_native::bf16_to_f32(p[i]); }  // bf16 bits

// w [K, N]: each thread takes a contiguous run of rows (one stream through memory) into its
// own partial sums, which are added at the end.
template <typename T>
void rows_times(ffi::ThreadPool& pool, const float* x, const T* w, float* y, int64_t K, int64_t N) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), K / 64));
  std::vector<float> partial(static_cast<size_t>(threads) * N, 0.0f);
  jaxserve_native::parallel_for(pool, threads, threads, [&](int64_t t) {
    const int64_t k0 = K * t / threads, k1 = K * (t + 1) / threads;
    float* acc = partial.data() + static_cast<int64_t>(t) * N;
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
  });
  std::copy(partial.begin(), partial.begin() + N, y);
  for (int t = 1; t < threads; ++t)
    for (int64_t n = 0; n < N; ++n) y[n] += partial[static_cast<size_t>(t) * N + n];
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {   // 16 bf16 -> float32, exactly
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// out[t] = sum of the 16 lanes of v[t] (a transpose-and-add tree, as in paged_context.cc).
inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 outputs y[n0 .. n0 + 16) of w [N, K] x for K a multiple of 16: each row's products summed
// in one vector, the 16 vectors reduced together.
template <typename T>
void dots16(const float* x, const T* w, float* y, int64_t K, int64_t n0) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 xv = _mm512_loadu_ps(x + k);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(load16(w + (n0 + i) * K + k), xv, acc[i]);
  }
  _mm512_storeu_ps(y + n0, sum_lanes16(acc));
}
#endif

// w [N, K]: one dot product per output, outputs split over the threads (16 at a time where K
// allows: one horizontal sum per 16 outputs instead of one each).
template <typename T>
void dots(ffi::ThreadPool& pool, const float* x, const T* w, float* y, int64_t K, int64_t N) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads()), chunks = std::min<int64_t>(N, 4 * threads);
  jaxserve_native::parallel_for(pool, chunks, threads, [&](int64_t c) {
    int64_t n = N * c / chunks;
    const int64_t end = N * (c + 1) / chunks;
#ifdef __AVX512F__
    if (K % 16 == 0)
      for (; n + 16 <= end; n += 16) dots16(x, w, y, K, n);
#endif
    for (; n < end; ++n) {
      const T* row = w + n * K;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < K; ++k) sum += load(row, k) * x[k];
      y[n] = sum;
    }
  });
}

ffi::Error MatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y, int64_t transposed) {
  const auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("w must be rank 2");
  const int64_t K = transposed ? wd[1] : wd[0], N = transposed ? wd[0] : wd[1];
  if (x.element_count() != static_cast<size_t>(K) || y->element_count() != static_cast<size_t>(N))
    return ffi::Error::InvalidArgument("x, w and y sizes disagree");
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  if (w.element_type() == ffi::DataType::F32) {
    const float* wp = static_cast<const float*>(w.untyped_data());
    transposed ? dots(pool, xp, wp, yp, K, N) : rows_times(pool, xp, wp, yp, K, N);
  } else if (w.element_type() == ffi::DataType::BF16) {
    const uint16_t* wp = static_cast<const uint16_t*>(w.untyped_data());
    transposed ? dots(pool, xp, wp, yp, K, N) : rows_times(pool, xp, wp, yp, K, N);
  } else {
    return ffi::Error::InvalidArgument("w must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatvec, MatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::AnyBuffer>()          // w
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<int64_t>("transposed"));
