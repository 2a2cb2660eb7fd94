// Small ops of the step for CPUs, XLA FFI custom calls built with paged_context.cc
// (kernels_pallas/native_cpu.py); one source, so the build parses jaxlib's FFI headers once for both.
//
// JaxserveSiluMul: SwiGLU's elementwise half for bfloat16 models, h = silu(gate) * up, from the
// float32 products of the gate/up projections, bit for bit as XLA computes it.
//
// In a bfloat16 model XLA rounds silu's result to bfloat16 (and each step before it: negate, exp,
// add one, reciprocal, multiply) before the product with up, so silu(bf16(gate)) is one of 65,536
// bf16 values, one per input: the caller passes XLA's own results for all of them (`table`, as
// float32), and this kernel looks them up instead of evaluating exp (XLA's fusion spent ~8
// cycles an element on that chain). The rest
// is exact: gate and up rounded to bfloat16 (to nearest even, NaNs kept quiet, subnormals kept,
// as XLA's convert), one float32 product of two bfloat16 values (exact but for overflow and
// underflow) and its rounding to bfloat16.
//
// Inputs: gate [M, N] and up [M, N], both float32 or both bfloat16 (already rounded: the same h),
// table [65536] float32. Output: h [M, N] bfloat16 (raw bits).
//
// JaxserveAddRmsNorm: a decoder's residual add and the RMSNorm after it, in one pass (a bfloat16
// model as below; a float32 model's the same way with nothing rounded).
//
// XLA keeps a bf16 model's residual stream in float32 (its excess precision: the rounding of
// each bf16 add is dropped inside fusions), and this does the same: x_out = x + bf16(delta) in
// float32 (delta: a projection's float32 product plus its bias, rounded as the projection's
// output is; or already bfloat16), then HF's RMSNorm of x_out: normed = bf16(bf16(x_out * r) *
// weight), r = 1 / sqrt(mean(x_out^2) + eps) in float32. XLA ran this as four fusions a norm
// (add, sum of squares, rsqrt, scaling), ~70 us at 64 rows here, mostly fixed cost. The sum of
// squares takes a fixed order (16 lane sums by fused multiply-adds over the columns in order,
// then sum16's tree), so a row's bits depend only on the row; XLA's reduction order and its
// approximate rsqrt may differ in r's last bit, which moves a bf16 output once in tens of
// thousands (the tests bound it). With `add` = 0, delta is ignored: x_out = x.
//
// Inputs: x [T, H] float32 or bfloat16, delta [T, H] float32 or bfloat16, weight [H] bfloat16 (or,
// a float32 model: x, delta and weight float32); attributes eps (float32), add (0 or 1). Outputs:
// x_out [T, H] float32, normed [T, H] of the weight's dtype.
//
// JaxserveLogSoftmax: log_softmax over the last axis of logits [S, V] float32, row by row. XLA's
// fused reductions (YNNPACK) take a row's sum of exponentials in an order that follows the row
// count, so a step's logprobs moved in their last bits with its batch (a prefix-cache hit, another
// request beside it). Each row here: its max m, the sum of exp(x - m) as 16 lane sums over the
// columns in order and sum16's tree, then (x - m) - log(sum), as jax.nn.log_softmax writes it; a
// row with a NaN or no finite max gives NaNs, as jax's does. Input x [S, V]; output y [S, V].
//
// JaxserveWriteKv: a step's keys and values into their slots of the paged KV pool, in place.
//
// The jnp `write_kv_cache` is a scatter whose updates XLA lays out token-major ([T, 2, KVH, 1, D]), so
// the fusion that feeds it (RoPE of k, the rounding to the pool's dtype) ends in a transposing
// copy: ~50 us a layer for a 64-token decode step and ~330 us for a 512-token chunk here,
// against a few for the same elementwise work without the transpose. This copies each token's
// rows straight from k and v to the pool, which the call returns as its output (aliased: XLA
// updates the donated pool where it lies).
//
// Inputs: kv [2, KVH, NB, BS, D] (float32, or uint16 holding 16-bit float bits), k and v
// [T, KVH, D] of the pool's element type, slot_mapping [T] int32 (slot = block * BS + offset;
// a negative slot counts from the end, one outside the pool is dropped, as jnp's
// `.at[...].set(mode="drop")` does). Output: kv, updated.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "bits.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using jaxserve_native::bits_of;
using jaxserve_native::round_to_bf16;

// A value as bfloat16 bits: a float32 rounded (to nearest even, NaNs quiet), or bfloat16 bits as they are.
using jaxserve_native::bf16_bits;
inline uint32_t bf16_bits(uint16_t h) { return h; }

template <typename T>
inline uint16_t silu_mul_one(T gate, T up, const float* table) {
  const float product = table[bf16_bits(gate)] * jaxserve_native::bf16_to_f32(static_cast<uint16_t>(bf16_bits(up)));
  return static_cast<uint16_t>(bf16_bits(product));
}

#ifdef __AVX512F__
inline __m512i round_to_bf16(__m512i bits) { return jaxserve_native::round_to_bf16x16(bits); }

// 16 values as bfloat16 bits in 32-bit lanes: float32 ones rounded, bfloat16 ones widened.
inline __m512i bf16_bits16(const float* p) { return round_to_bf16(_mm512_castps_si512(_mm512_loadu_ps(p))); }
inline __m512i bf16_bits16(const uint16_t* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Elements [begin, end) of gate and up (float32, or bfloat16 bits already rounded): 16 at a time,
// the table read with one gather per 16.
template <typename T>
void silu_mul_range(const T* gate, const T* up, const float* table, uint16_t* h, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 s = _mm512_i32gather_ps(bf16_bits16(gate + i), table, 4);
    const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(up + i), 16));
    const __m512i out = round_to_bf16(_mm512_castps_si512(_mm512_mul_ps(s, u)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), _mm512_cvtepi32_epi16(out));
  }
  for (; i < end; ++i) h[i] = silu_mul_one(gate[i], up[i], table);
}
#else
template <typename T>
void silu_mul_range(const T* gate, const T* up, const float* table, uint16_t* h, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) h[i] = silu_mul_one(gate[i], up[i], table);
}
#endif

constexpr int64_t kChunk = 8192;  // elements per work item: 80 kB of inputs and output

ffi::Error SiluMulImpl(ffi::ThreadPool pool, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::Buffer<ffi::F32> table,
                       ffi::Result<ffi::Buffer<ffi::BF16>> h) {
  const int64_t n = static_cast<int64_t>(gate.element_count());
  if (up.element_count() != gate.element_count() || h->element_count() != gate.element_count())
    return ffi::Error::InvalidArgument("silu_mul: gate, up and h sizes disagree");
  const bool bf16 = gate.element_type() == ffi::DataType::BF16;
  if (up.element_type() != gate.element_type() || (!bf16 && gate.element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("silu_mul: gate and up must both be float32 or both bfloat16");
  if (table.element_count() != 65536) return ffi::Error::InvalidArgument("silu_mul: the table needs 65536 entries");
  const float* t = table.typed_data();
  uint16_t* out = reinterpret_cast<uint16_t*>(h->untyped_data());
  const int64_t items = (n + kChunk - 1) / kChunk;
  jaxserve_native::parallel_for(pool, items, items, [&](int64_t item) {
    const int64_t begin = item * kChunk, end = std::min(n, (item + 1) * kChunk);
    if (bf16)
      silu_mul_range(static_cast<const uint16_t*>(gate.untyped_data()), static_cast<const uint16_t*>(up.untyped_data()),
                     t, out, begin, end);
    else
      silu_mul_range(static_cast<const float*>(gate.untyped_data()), static_cast<const float*>(up.untyped_data()), t,
                     out, begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSiluMul, SiluMulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()          // gate: float32, or bfloat16 (rounded)
                                  .Arg<ffi::AnyBuffer>()          // up: gate's type
                                  .Arg<ffi::Buffer<ffi::F32>>()   // table: silu of every bf16 value
                                  .Ret<ffi::Buffer<ffi::BF16>>()); // h

namespace {

ffi::Error WriteKvImpl(ffi::ThreadPool threads, ffi::AnyBuffer kv, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::S32> slot_mapping, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                       ffi::Result<ffi::AnyBuffer> out, int64_t rope) {
  const auto kd = kv.dimensions(), td = k.dimensions();
  if (kd.size() != 5 || kd[0] != 2) return ffi::Error::InvalidArgument("write_kv: kv must be [2, KVH, NB, BS, D]");
  const int64_t KVH = kd[1], NB = kd[2], BS = kd[3], D = kd[4];
  if (td.size() != 3 || td[1] != KVH || td[2] != D || v.dimensions().size() != 3 || v.element_count() != k.element_count())
    return ffi::Error::InvalidArgument("write_kv: k and v must be [T, KVH, D] of the pool's heads and head dim");
  const auto fits = [&kv](ffi::DataType t) {   // the pool's type, or bfloat16 into a pool of their bits
    return t == kv.element_type() || (t == ffi::DataType::BF16 && kv.element_type() == ffi::DataType::U16);
  };
  if (!fits(k.element_type()) || !fits(v.element_type()) || out->element_type() != kv.element_type())
    return ffi::Error::InvalidArgument("write_kv: k, v and the pool must share one element type (bfloat16 k and v "
                                       "go into a uint16 pool as their bits)");
  const int64_t T = td[0], slots = NB * BS;
  if (static_cast<int64_t>(slot_mapping.element_count()) != T)
    return ffi::Error::InvalidArgument("write_kv: slot_mapping must have one slot per token");
#ifdef __AVX512F__
  if (rope && (k.element_type() != ffi::DataType::BF16 || D % 32 != 0 || cos.element_type() != ffi::DataType::BF16 ||
               sin.element_type() != ffi::DataType::BF16 || static_cast<int64_t>(cos.element_count()) != T * D ||
               static_cast<int64_t>(sin.element_count()) != T * D))
    return ffi::Error::InvalidArgument("write_kv: rope takes bfloat16 k with a head dim of a multiple of 32 and "
                                       "bfloat16 cos and sin [T, D]");
#else
  if (rope) return ffi::Error::InvalidArgument("write_kv: rope needs AVX-512");
#endif
  const size_t elem = ffi::ByteWidth(kv.element_type());
  char* pool = static_cast<char*>(out->untyped_data());
  if (pool != kv.untyped_data())   // not aliased (XLA gave the output its own buffer): start from kv
    std::memcpy(pool, kv.untyped_data(), kv.size_bytes());
  const size_t row = static_cast<size_t>(D) * elem;
  const char* src[2] = {static_cast<const char*>(k.untyped_data()), static_cast<const char*>(v.untyped_data())};
  const int32_t* slot = slot_mapping.typed_data();
  // One item per (K or V, head): each writes its own rows of the pool (stores that miss the cache,
  // one row per token, so two threads take them about twice as fast).
  jaxserve_native::parallel_for(threads, 2 * KVH, std::max<int64_t>(1, threads.num_threads()), [&](int64_t item) {
    const int64_t half = item / KVH, h = item % KVH;
    char* dst = pool + item * slots * row;
    for (int64_t t = 0; t < T; ++t) {
      int64_t s = slot[t];
      if (s < 0) s += slots;
      if (s < 0 || s >= slots) continue;
      const char* from = src[half] + (t * KVH + h) * row;
#ifdef __AVX512F__
      if (rope && half == 0) {   // K rotated on its way in
        uint16_t* to = reinterpret_cast<uint16_t*>(dst + s * row);
        jaxserve_native::rope_row_bf16(reinterpret_cast<const uint16_t*>(from),
                                       static_cast<const uint16_t*>(cos.untyped_data()) + t * D,
                                       static_cast<const uint16_t*>(sin.untyped_data()) + t * D, D,
                                       [to](int64_t d, __m512 sum) {   // rounded to bf16 (XLA's convert)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + d), _mm512_cvtepi32_epi16(round_to_bf16(
              _mm512_castps_si512(sum))));
        });
        continue;
      }
#endif
      std::memcpy(dst + s * row, from, row);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, WriteKvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()          // kv pool
                                  .Arg<ffi::AnyBuffer>()          // k [T, KVH, D]
                                  .Arg<ffi::AnyBuffer>()          // v [T, KVH, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping [T]
                                  .Arg<ffi::AnyBuffer>()          // cos [T, D] bfloat16 (rope) or anything
                                  .Arg<ffi::AnyBuffer>()          // sin [T, D]
                                  .Ret<ffi::AnyBuffer>()          // kv pool, updated (aliased)
                                  .Attr<int64_t>("rope"));        // 1: K rotated (RoPE) on its way in

namespace {

// Rows [r0, r1) of x_out and normed; the element types as template arguments, so the loops vectorise.
// Out uint16_t: a bfloat16 model (delta rounded to bf16 before the add, weight and normed bf16);
// float: a float32 model (x, delta, weight and normed float32, nothing rounded).
template <typename X, typename Delta, bool kAdd, typename Out>
void add_rms_norm_rows(const X* x, const Delta* delta, const Out* weight, float eps, int64_t H, float* x_out,
                       Out* normed, int64_t r0, int64_t r1) {
  using jaxserve_native::bf16_to_f32;
  constexpr bool kBf16 = sizeof(Out) == 2;
  const float inv_h = 1.0f / static_cast<float>(H);   // XLA divides a mean by its count as a multiply
  for (int64_t r = r0; r < r1; ++r) {
    float* row = x_out + r * H;
    const X* xr = x + r * H;
    const Delta* dr = kAdd ? delta + r * H : nullptr;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) {
      float v;
      if constexpr (sizeof(X) == 2) v = bf16_to_f32(xr[i]);   // the residual: bf16 (the embedding) or float32
      else v = xr[i];
      if constexpr (kAdd && kBf16) v += bf16_to_f32(static_cast<uint16_t>(bf16_bits(dr[i])));   // delta rounded
      else if constexpr (kAdd) v += dr[i];
      row[i] = v;
    }
    const float squares = jaxserve_native::ordered_sum16(H, [row](float lane, int64_t i) {
      return std::fma(row[i], row[i], lane);
    });
    const float scale = 1.0f / std::sqrt(squares * inv_h + eps);
    Out* out = normed + r * H;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) {
      if constexpr (kBf16) {
        const float n = bf16_to_f32(static_cast<uint16_t>(bf16_bits(row[i] * scale)));
        out[i] = static_cast<uint16_t>(bf16_bits(n * bf16_to_f32(weight[i])));
      } else {
        out[i] = weight[i] * (row[i] * scale);
      }
    }
  }
}

constexpr int64_t kNormRows = 16;   // rows per work item

ffi::Error AddRmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer delta, ffi::AnyBuffer weight,
                          ffi::Result<ffi::Buffer<ffi::F32>> x_out, ffi::Result<ffi::AnyBuffer> normed, float eps,
                          int64_t add) {
  const auto xd = x.dimensions();
  const bool x_bf16 = x.element_type() == ffi::DataType::BF16, delta_bf16 = delta.element_type() == ffi::DataType::BF16;
  const bool f32 = weight.element_type() == ffi::DataType::F32;   // a float32 model's norm
  if (xd.size() != 2 || (!x_bf16 && x.element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("add_rms_norm: x must be [T, H] float32 or bfloat16");
  const int64_t T = xd[0], H = xd[1];
  if ((!f32 && weight.element_type() != ffi::DataType::BF16) || static_cast<int64_t>(weight.element_count()) != H)
    return ffi::Error::InvalidArgument("add_rms_norm: weight must be [H] bfloat16 or float32");
  if (add && ((!delta_bf16 && delta.element_type() != ffi::DataType::F32) || delta.element_count() != x.element_count()))
    return ffi::Error::InvalidArgument("add_rms_norm: delta must be [T, H] float32 or bfloat16");
  if (f32 && (x_bf16 || (add && delta_bf16)))
    return ffi::Error::InvalidArgument("add_rms_norm: a float32 weight takes float32 x and delta");
  if (normed->element_type() != weight.element_type())
    return ffi::Error::InvalidArgument("add_rms_norm: normed must have the weight's dtype");
  if (x_out->element_count() != x.element_count() || normed->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("add_rms_norm: the outputs must be [T, H]");
  float* xo = x_out->typed_data();
  const int64_t items = (T + kNormRows - 1) / kNormRows;
  jaxserve_native::parallel_for(pool, items, std::max<int64_t>(1, pool.num_threads()), [&](int64_t item) {
    const int64_t r0 = item * kNormRows, r1 = std::min(T, (item + 1) * kNormRows);
    const void *xv = x.untyped_data(), *dv = delta.untyped_data();
    const auto* x16 = static_cast<const uint16_t*>(xv);
    const auto* x32 = static_cast<const float*>(xv);
    const auto* d16 = static_cast<const uint16_t*>(dv);
    const auto* d32 = static_cast<const float*>(dv);
    if (f32) {
      const auto* wp = static_cast<const float*>(weight.untyped_data());
      auto* no = static_cast<float*>(normed->untyped_data());
      if (add) add_rms_norm_rows<float, float, true>(x32, d32, wp, eps, H, xo, no, r0, r1);
      else add_rms_norm_rows<float, float, false>(x32, d32, wp, eps, H, xo, no, r0, r1);
      return;
    }
    const auto* wp = static_cast<const uint16_t*>(weight.untyped_data());
    auto* no = static_cast<uint16_t*>(normed->untyped_data());
    if (!add) {
      if (x_bf16) add_rms_norm_rows<uint16_t, float, false>(x16, d32, wp, eps, H, xo, no, r0, r1);
      else add_rms_norm_rows<float, float, false>(x32, d32, wp, eps, H, xo, no, r0, r1);
    } else if (x_bf16) {
      if (delta_bf16) add_rms_norm_rows<uint16_t, uint16_t, true>(x16, d16, wp, eps, H, xo, no, r0, r1);
      else add_rms_norm_rows<uint16_t, float, true>(x16, d32, wp, eps, H, xo, no, r0, r1);
    } else {
      if (delta_bf16) add_rms_norm_rows<float, uint16_t, true>(x32, d16, wp, eps, H, xo, no, r0, r1);
      else add_rms_norm_rows<float, float, true>(x32, d32, wp, eps, H, xo, no, r0, r1);
    }
  });
  return ffi::Error::Success();
}

// Rows [r0, r1) of log_softmax(x) [*, V] into y.
void log_softmax_rows(const float* x, float* y, int64_t V, int64_t r0, int64_t r1) {
  using jaxserve_native::fast_exp;
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * V;
    float* yr = y + r * V;
    float top[16], odd[16];   // per lane: the max, and a NaN seen (as 1) -- both vectorise
    std::fill(top, top + 16, -std::numeric_limits<float>::infinity());
    std::fill(odd, odd + 16, 0.0f);
    int64_t c = 0;
    for (; c + 16 <= V; c += 16)
#pragma omp simd
      for (int64_t l = 0; l < 16; ++l) {
        const float v = xr[c + l];
        top[l] = v > top[l] ? v : top[l];
        odd[l] = v != v ? 1.0f : odd[l];
      }
    for (int64_t l = 0; c + l < V; ++l) {
      const float v = xr[c + l];
      top[l] = v > top[l] ? v : top[l];
      odd[l] = v != v ? 1.0f : odd[l];
    }
    const float m = *std::max_element(top, top + 16);   // exact: any order gives the max
    if (*std::max_element(odd, odd + 16) > 0.0f || !std::isfinite(m)) {   // jax: a NaN, or inf - inf: NaN
      std::fill(yr, yr + V, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    // exp(x - m), 0 below e^-87 (-inf included: fast_exp clamps there, the factor zeroes it)
    const float sum = jaxserve_native::ordered_sum16(V, [xr, m](float lane, int64_t i) {
      const float d = xr[i] - m;
      return lane + fast_exp(d) * (d >= -87.0f ? 1.0f : 0.0f);
    });
    const float log_sum = std::log(sum);
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) yr[i] = (xr[i] - m) - log_sum;
  }
}

ffi::Error LogSoftmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("log_softmax takes x [S, V] float32");
  if (y->element_count() != x.element_count()) return ffi::Error::InvalidArgument("log_softmax: y must be [S, V]");
  const int64_t S = xd[0], V = xd[1];
  if (S == 0 || V == 0) return ffi::Error::Success();
  jaxserve_native::parallel_for(pool, S, std::max<int64_t>(1, pool.num_threads()), [&](int64_t r) {
    log_softmax_rows(x.typed_data(), y->typed_data(), V, r, r + 1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLogSoftmax, LogSoftmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [S, V]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // log_softmax(x) over V

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAddRmsNorm, AddRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()           // x [T, H] float32 or bfloat16
                                  .Arg<ffi::AnyBuffer>()           // delta [T, H] float32 or bfloat16
                                  .Arg<ffi::AnyBuffer>()           // weight [H] bfloat16 or float32
                                  .Ret<ffi::Buffer<ffi::F32>>()    // x_out [T, H]
                                  .Ret<ffi::AnyBuffer>()           // normed [T, H], the weight's dtype
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("add"));          // 0: x_out = x, delta ignored
