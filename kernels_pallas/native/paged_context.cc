// Paged attention of a step's query runs (decodes, prefill chunks) over their whole context, for CPUs.
//
// An XLA FFI custom call (jax.ffi), built on first use by kernels_pallas/native_cpu.py and
// called from inside the engine's jitted step. It reads K/V pages where they lie in the
// pool (which already holds this step's keys): no gathered copy, one pass over each run's
// pages, with an online softmax per page. Work items, on XLA's intra-op threads
// (parallel.h), are (item, KV head): a block of 16 queries of a longer run, or a group of
// up to 16 short runs (those starting from the same block side by side) walked page by page
// together. Pages that several of an item's rows read whole from the same block (a shared
// prefix; a 16-query block's earlier pages) are folded for 16 rows at a time, rows in vector
// lanes (`fold_lanes16`): each K and V value loaded serves 16 rows. A row goes through the
// same operations in the same order either way, so its result does not depend on the path,
// its group or its batch (tests/kernels/test_ragged_paged_attention_cpu.py checks the bits).
// A bf16 q against a bf16 pool on a CPU with AMX tiles (`amx` set) takes `attend_amx` for every
// row instead: scores and P x V from `tdpbf16ps`, the softmax weights rounded to bf16 first.
//
// Inputs: q [T, QH, D] float32, already scaled by sm_scale (on the tiles, `score_scale` may carry
// a scale that is no power of two instead, q unscaled; or, with `rope`, a bf16 q before its RoPE,
// which each work item rotates and scales itself: cos, sin [T, D] bf16, `q_scale`); with `q_bf16`
// set q is a bf16 model's (times a power-of-two scale) and against a bf16 pool the scores come
// from bf16 products on the raw K pages, q rounded to bf16 (to nearest even) on every path: XLA
// leaves a bf16 model's RoPE sum unrounded, so q may hold more bits; kv [2, KVH, NB, BS, D] float32,
// or uint16 holding bfloat16 (bits_dtype 1) or float16 (bits_dtype 2) bits; block_tables
// [S, MB] int32; context_lens [S] int32 (tokens cached after this step); query_start_loc
// [S + 1] int32; num_seqs [] int32. For sequence s with q_len = query_start_loc[s+1] -
// query_start_loc[s] in 1..max_q_len, each query row (position context_len - q_len + j)
// attends the keys at positions <= its own (the pool already holds this step's keys),
// limited to the last `sliding_window` positions when it is > 0, logits soft-capped when
// soft_cap > 0. Outputs: out [T, QH, D] float32 normalised (or bfloat16, rounded as XLA's
// convert rounds: its consumer's dtype, without a pass of XLA's over it), lse [T, QH] float32
// log-sum-exp; rows of other sequences are 0 and -inf. It computes what the reference
// computes for those rows; the tests check it against a float64 oracle (on the tiles, within
// what rounding the softmax weights to bf16 allows).

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "amx.h"
#include "bits.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_native::bf16_to_f32;
using jaxserve_native::fast_exp;
#ifdef __AVX512F__
using jaxserve_native::bf16x16_to_f32;
using jaxserve_native::load_bf16x16;
using jaxserve_native::sum_lanes16;
#endif

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16-row blocks times pages folded by `fold_lanes16` (or shared pages folded on the tiles) and
// blocks times 16 keys taken on AMX tiles (a block that sees none of them included), since the
// library loaded (for the tests).
std::atomic<int64_t> lane_block_pages{0};
std::atomic<int64_t> amx_folds{0};

// A finite stand-in for -inf: masked scores and empty rows (exp of it underflows to 0).
constexpr float kMasked = -1e30f;

// One page of K or V as float32 rows: a pointer into the pool for float32, else converted into `buf`.
inline const float* page_rows(const void* kv, int64_t bits_dtype, int64_t page, int64_t page_elems, float* buf) {
  if (bits_dtype == 0) return static_cast<const float*>(kv) + page * page_elems;
  const uint16_t* src = static_cast<const uint16_t*>(kv) + page * page_elems;
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= page_elems; i += 16) {   // exact conversions, 16 at a time
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(buf + i, bits_dtype == 1 ? bf16x16_to_f32(h) : _mm512_cvtph_ps(h));
  }
#endif
  if (bits_dtype == 1) {
    for (; i < page_elems; ++i) buf[i] = bf16_to_f32(src[i]);
  } else {
    for (; i < page_elems; ++i) buf[i] = f16_to_f32(src[i]);
  }
  return buf;
}

struct Problem {
  const float* q;           // [T, QH, D] scaled queries
  const void* kv;           // [2, KVH, NB, BS, D]
  const int32_t* tables;    // [S, MB]
  const int32_t* ctx_lens;  // [S]
  const int32_t* qsl;       // [S + 1]
  void* out;                // [T, QH, D] float32, or bfloat16 bits (out_bf16)
  float* lse;               // [T, QH]
  int64_t T, QH, D, KVH, NB, BS, MB, G, bits_dtype, sliding_window;
  float soft_cap;
  bool q_bf16;              // q holds bfloat16 values exactly
  int64_t min_lane_fill;    // fold shared pages 16 rows at a time when that fills lanes this well (0: never)
  bool amx;                 // every fold on AMX tiles (attend_amx)
  float score_scale;        // the tiles' scores times this (q unscaled: a scale that is no power of two)
  bool out_bf16;            // out rounded to bfloat16 as XLA's convert rounds (its consumer's dtype)

  void put_out(int64_t i, float value) const {
    if (out_bf16) static_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(jaxserve_native::bf16_bits(value));
    else static_cast<float*>(out)[i] = value;
  }
};

constexpr int64_t kSeqGroup = 16;    // short runs walked page by page together (see `attend`)
constexpr int64_t kQueryBlock = 16;  // longer runs are cut into blocks of this many queries, one item each

struct Segment {  // queries j0 .. j0 + nq - 1 of sequence s's run in this step
  int64_t s, j0, nq;
};

// Up to 16 query rows of a group, one per lane, folded together over the pages all their runs
// share (a shared prefix; every full page of a prefill block): each K and V value loaded
// serves 16 rows, and the online softmax runs lane-wise, with no lane-sum tree of the scores.
struct LaneBlock {
  float *q, *acc, *m, *l;        // [D][16] scaled queries, [D][16] output, [16] max, [16] sum
  alignas(64) int32_t pos[16];   // the lanes' query positions (-1: no row)
  int64_t run[16], row[16];      // where each lane's row lives in the group
  int64_t lanes;
};

// attend_amx's (below)
struct AmxBlock {                     // up to 16 query rows reading the same pages, one per lane
  alignas(64) uint32_t q[64 * 16];    // [kD / 2][16]: the rows' q as bf16 pairs (head dims up to 128)
  alignas(64) float acc[16 * 128];    // [16][kD] the rows' sums (amx_col order)
  alignas(64) float m[16], l[16];     // the rows' running max and sum
  alignas(64) int32_t pos[16];        // query positions (-1: no row)
  float *run_m[16], *run_l[16], *run_acc[16];   // where each row's state lives in its run
  int64_t n;
};

struct AmxScratch {                   // per thread
  alignas(64) float S[2][16 * 16];    // scores [key][lane], two folds' in turn (see amx_pages)
  alignas(64) uint16_t P[16 * 16];    // bf16 weights [lane][key]
  alignas(64) float pv[8 * 256];      // P V [kD / 16][lane][16]
  alignas(64) uint32_t vp[2][8 * 128];   // V's key pairs [8][kD] (amx_col order), two 16-key pieces' in turn
  alignas(64) float alpha[16];
  std::vector<AmxBlock> blocks;
};

struct Scratch {  // per thread, kept between calls
  std::vector<float> kbuf, vbuf, m, l, acc, scores;
  std::vector<float> row_weights, row_alpha;   // `fold_page16`: a run's rows' weights of 16 keys, rescales
  std::vector<int64_t> active_rows;           // and which rows see a key of the 16
  std::vector<float> lanes;        // rows folded 16 at a time (`fold_lanes16`): per block q, acc, m, l
  std::vector<LaneBlock> blocks;
  std::unique_ptr<AmxScratch> amx;   // attend_amx's, made on first use
  Scratch(const Problem& pr, int64_t max_rows)
      : kbuf(pr.BS * pr.D), vbuf(pr.BS * pr.D), m(kSeqGroup * max_rows), l(kSeqGroup * max_rows),
        acc(kSeqGroup * max_rows * pr.D), scores(pr.BS), row_weights(16 * max_rows), row_alpha(max_rows),
        active_rows(max_rows), lanes(lane_blocks(max_rows) * lane_floats(pr) + 16),
        blocks(lane_blocks(max_rows)) {}
  static int64_t lane_floats(const Problem& pr) { return 16 * (2 * pr.D + 2); }   // one block's, 64-byte multiple
  float* lane_block(const Problem& pr, int64_t bi) {   // 64-byte aligned
    const auto base = (reinterpret_cast<uintptr_t>(lanes.data()) + 63) & ~uintptr_t{63};
    return reinterpret_cast<float*>(base) + bi * lane_floats(pr);
  }
  static int64_t lane_blocks(int64_t max_rows) { return (kSeqGroup * max_rows + 15) / 16; }
  bool fits(const Problem& pr, int64_t max_rows) const {
    return kbuf.size() >= static_cast<size_t>(pr.BS * pr.D) && m.size() >= static_cast<size_t>(kSeqGroup * max_rows) &&
           acc.size() >= static_cast<size_t>(kSeqGroup * max_rows * pr.D) && scores.size() >= static_cast<size_t>(pr.BS) &&
           active_rows.size() >= static_cast<size_t>(max_rows) &&
           lanes.size() >= static_cast<size_t>(lane_blocks(max_rows) * lane_floats(pr) + 16) &&
           blocks.size() >= static_cast<size_t>(lane_blocks(max_rows));
  }
};

struct Run {  // one sequence's query rows in a group
  int64_t s, start, q_len, rows, pos0, limit, first_page, last_page;
  int64_t next_page;   // the first page not yet folded into its rows
  float *m, *l, *acc;  // online-softmax state of its rows, in the thread's scratch
};

// Pool page of KV head h's K (half 0) or V (half 1) for page index p of run `run`'s sequence
// (out-of-range table entries clamp into the pool).
inline int64_t pool_page(const Problem& pr, const Run& run, int half, int64_t h, int64_t p) {
  const int64_t block = std::clamp<int64_t>(pr.tables[run.s * pr.MB + p], 0, pr.NB - 1);
  return (half * pr.KVH + h) * pr.NB + block;
}

// Raw addresses of the K and V pages after page p (null when p is the run's last page), to
// prefetch: pages are scattered 2-4 KB runs, too short for the hardware prefetcher to get ahead.
inline std::pair<const char*, const char*> next_pages(const Problem& pr, const Run& run, int64_t h, int64_t p,
                                                      int64_t page_bytes) {
  if (p + 1 >= run.last_page) return {nullptr, nullptr};
  const char* base = static_cast<const char*>(pr.kv);
  return {base + pool_page(pr, run, 0, h, p + 1) * page_bytes, base + pool_page(pr, run, 1, h, p + 1) * page_bytes};
}

// Fold page p of run `r` (KV head h) into its rows' online softmax.
template <int64_t kBS, int64_t kD>
void fold_page(const Problem& pr, Scratch& w, const Run& run, int64_t h, int64_t p) {
  const int64_t BS = kBS ? kBS : pr.BS, D = kD ? kD : pr.D, G = pr.G, QH = pr.QH;
  const int64_t start = run.start, rows = run.rows, pos0 = run.pos0, limit = run.limit;
  float *m = run.m, *l = run.l, *acc = run.acc, *sc = w.scores.data();
  const float* kpage = page_rows(pr.kv, pr.bits_dtype, pool_page(pr, run, 0, h, p), BS * D, w.kbuf.data());
  const float* vpage = page_rows(pr.kv, pr.bits_dtype, pool_page(pr, run, 1, h, p), BS * D, w.vbuf.data());
  const int64_t key0 = p * BS, nkeys = std::min<int64_t>(BS, limit - key0);
  // The next page's K and V, a few cache lines at a time while this page computes.
  const int64_t elem = pr.bits_dtype ? 2 : 4, lines_per_key = std::max<int64_t>(1, D * elem / 64);
  const auto [next_k, next_v] = next_pages(pr, run, h, p, BS * D * elem);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t j = r / G, g = r % G;
    const int64_t q_pos = pos0 + j;
    const float* qrow = pr.q + ((start + j) * QH + h * G + g) * D;
    for (int64_t t = 0; t < BS; ++t) {
      if (r == 0 && next_k != nullptr) {
        for (int64_t line = 0; line < lines_per_key; ++line) {
          __builtin_prefetch(next_k + (t * lines_per_key + line) * 64);
          __builtin_prefetch(next_v + (t * lines_per_key + line) * 64);
        }
      }
      const float* krow = kpage + t * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qrow[d] * krow[d];
      sc[t] = dot;
    }
    float page_max = kMasked;
    for (int64_t t = 0; t < BS; ++t) {
      float x = sc[t];
      if (pr.soft_cap > 0.0f) x = pr.soft_cap * std::tanh(x / pr.soft_cap);
      const int64_t key = key0 + t;
      if (t >= nkeys || key > q_pos || (pr.sliding_window > 0 && key <= q_pos - pr.sliding_window)) x = kMasked;
      sc[t] = x;
      page_max = std::max(page_max, x);
    }
    if (page_max == kMasked) continue;  // no visible key in this page for this row
    const float m_new = std::max(m[r], page_max);
    const float alpha = m[r] == kMasked ? 0.0f : fast_exp(m[r] - m_new);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < BS; ++t) {
      const float e = sc[t] == kMasked ? 0.0f : fast_exp(sc[t] - m_new);
      sc[t] = e;
      sum += e;
    }
    float* a = acc + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
    for (int64_t t = 0; t < nkeys; ++t) {
      const float e = sc[t];
      const float* vrow = vpage + t * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += e * vrow[d];
    }
    l[r] = l[r] * alpha + sum;
    m[r] = m_new;
  }
}

#ifdef __AVX512F__
// fast_exp of 16 lanes (the same polynomial; 2^n applied by scalef).
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, f), f, f), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline float exp_lane0(float x) { return _mm512_cvtss_f32(fast_exp16(_mm512_set1_ps(x))); }

// The rows folded 16 keys at a time by `fold_page16` (keys in lanes) and 16 rows at a time by
// `fold_lanes16` (rows in lanes) go through the same operations in the same order, so a row's
// result does not depend on which path took it (nor on which runs shared its group). The two
// sums that order matters for are spelled out here in both layouts.

// Sum of e's 16 lanes: lanes i + 8, then i + 4, i + 2, i + 1.
inline float sum16(__m512 e) {
  const __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(e), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
  const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}

// sum16 lane by lane: lane i of the result sums lane i of e[0..15] in sum16's order.
inline __m512 sum16_vertical(const __m512 e[16]) {
  __m512 a[8], b[4];
  #pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = _mm512_add_ps(e[i], e[i + 8]);
  #pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) b[i] = _mm512_add_ps(a[i], a[i + 4]);
  return _mm512_add_ps(_mm512_add_ps(b[0], b[2]), _mm512_add_ps(b[1], b[3]));
}

// Lines [first, end) (64 bytes each) of the next K and V pages (nk, nv) into L2, K's and V's in turn.
inline void prefetch_pages_l2(const char* nk, const char* nv, int64_t first, int64_t end) {
  for (int64_t line = first; line < end; ++line) {
    _mm_prefetch(nk + line * 64, _MM_HINT_T1);
    _mm_prefetch(nv + line * 64, _MM_HINT_T1);
  }
}

// fold_page16's V pass over 16 keys (v: their [16][kD] rows, bf16 bits when kRaw, else float32):
// each key's V row is loaded (converted) once for up to kChunk active rows at a time, whose outputs
// stay in registers; each row's sums take the keys in order, as that row alone would. The first
// chunk also prefetches `v_lines` lines of the next K and V pages (nk, nv) per key from line `line0`.
template <int64_t kD, bool kRaw>
inline void v_pass(const Run& run, const void* v, const float* row_e, const float* row_alpha, const int64_t* active,
                   int64_t num_active, int64_t nkeys, const char* nk, const char* nv, int64_t line0, int64_t v_lines) {
  constexpr int NV = static_cast<int>(kD / 16);
  constexpr int64_t kChunk = NV <= 4 ? 4 : 2;
  for (int64_t c0 = 0; c0 < num_active; c0 += kChunk) {
    const int64_t rows = std::min(kChunk, num_active - c0);
    __m512 acc[kChunk][NV];
    #pragma GCC unroll 4
    for (int64_t i = 0; i < kChunk; ++i) {
      if (i >= rows) break;
      const float* a = run.acc + active[c0 + i] * kD;
      const float alpha = row_alpha[c0 + i];
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j)
        acc[i][j] = alpha == 1.0f ? _mm512_loadu_ps(a + 16 * j) : _mm512_mul_ps(_mm512_loadu_ps(a + 16 * j), _mm512_set1_ps(alpha));
    }
    for (int64_t t = 0; t < nkeys; ++t) {
      if (kRaw && c0 == 0) prefetch_pages_l2(nk, nv, line0 + t * v_lines, line0 + (t + 1) * v_lines);
      __m512 vt[NV];
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) {
        if constexpr (kRaw) vt[j] = load_bf16x16(static_cast<const uint16_t*>(v) + t * kD + 16 * j);
        else vt[j] = _mm512_loadu_ps(static_cast<const float*>(v) + t * kD + 16 * j);
      }
      #pragma GCC unroll 4
      for (int64_t i = 0; i < kChunk; ++i) {
        if (i >= rows) break;
        const __m512 et = _mm512_set1_ps(row_e[16 * (c0 + i) + t]);
        #pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(et, vt[j], acc[i][j]);
      }
    }
    #pragma GCC unroll 4
    for (int64_t i = 0; i < kChunk; ++i) {
      if (i >= rows) break;
      float* a = run.acc + active[c0 + i] * kD;
      #pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(a + 16 * j, acc[i][j]);
    }
  }
}

// fold_page for pages of a multiple of 16 keys and a head dim of kD (a multiple of 16) without
// soft-capping, 16 keys at a time: the 16 scores of a row come out in one vector, masked,
// exponentiated and summed 16 at a time, and the row's output accumulates in registers.
template <int64_t kD>
void fold_page16(const Problem& pr, Scratch& w, const Run& run, int64_t h, int64_t p) {
  constexpr int64_t D = kD;
  const int64_t BS = pr.BS;
  constexpr int NV = static_cast<int>(kD / 16);
  const int64_t G = pr.G, QH = pr.QH;
  // bf16 q against a bf16 pool: K stays as it lies (pairs of bf16 into vdpbf16ps), else float32 rows
#ifdef __AVX512BF16__
  const bool dot_bf16 = kD % 32 == 0 && pr.q_bf16 && pr.bits_dtype == 1;
#else
  const bool dot_bf16 = false;
#endif
  const int64_t k_page = pool_page(pr, run, 0, h, p);
  const float* kpage_all = dot_bf16 ? nullptr : page_rows(pr.kv, pr.bits_dtype, k_page, BS * D, w.kbuf.data());
  const uint16_t* kraw_all = static_cast<const uint16_t*>(pr.kv) + k_page * BS * D;
  const int64_t v_page = pool_page(pr, run, 1, h, p);
  const int64_t page_bytes = BS * D * (pr.bits_dtype ? 2 : 4);
  const auto [nk, nv] = next_pages(pr, run, h, p, page_bytes);
  // float32 16-key pages: the next pages' prefetches go out 8 lines per key of the first row's scores
  const bool spread = BS == 16 && pr.bits_dtype == 0 && nk != nullptr;
  const int64_t lines_per_key = page_bytes / 64 / 16;
  // V: a bf16 pool's page is read as it lies, each key's row converted where the rows use it; a
  // float32 pool's in place; a float16 pool's converted into vbuf first.
  const bool v_raw = pr.bits_dtype == 1;
  const uint16_t* vraw_all = static_cast<const uint16_t*>(pr.kv) + v_page * BS * D;
  const float* vpage_all = v_raw ? nullptr : page_rows(pr.kv, pr.bits_dtype, v_page, BS * D, w.vbuf.data());
  // Prefetches of the next K and V pages into L2: float32 16-key pages spread them over the first
  // row's scores (`spread`); a bf16 pool over the keys of the V pass, `v_lines` lines of each a key
  // (spread out, the prefetches do not fill the miss queue in one burst and stall); else all at once.
  const int64_t v_lines = v_raw && nk != nullptr ? page_bytes / 64 / BS : 0;
  if (nk != nullptr && !spread && v_lines == 0)   // into L2: a group's pages ahead overflow L1
    prefetch_pages_l2(nk, nv, 0, page_bytes / 64);
  float* row_e = w.row_weights.data();   // [rows][16] each row's softmax weights of the 16 keys
  float* row_alpha = w.row_alpha.data();
  int64_t* active = w.active_rows.data();
  for (int64_t sub = 0; sub < BS / 16; ++sub) {   // 16 keys at a time
    const int64_t key0 = p * BS + 16 * sub, nkeys = std::min<int64_t>(16, run.limit - key0);
    if (nkeys <= 0) break;
    const float* kpage = kpage_all == nullptr ? nullptr : kpage_all + 16 * sub * D;
    const uint16_t* kraw = kraw_all + 16 * sub * D;
    const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(key0)),
                                          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __mmask16 in_page = nkeys >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nkeys) - 1);
    // Scores and softmax weights of every row with a visible key (its max and sum updated here).
    int64_t num_active = 0;
    for (int64_t r = 0; r < run.rows; ++r) {
      const int64_t j = r / G, g = r % G, q_pos = run.pos0 + j;
      __mmask16 valid = in_page & _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(static_cast<int32_t>(q_pos)));
      if (pr.sliding_window > 0)
        valid &= _mm512_cmpgt_epi32_mask(keys, _mm512_set1_epi32(static_cast<int32_t>(q_pos - pr.sliding_window)));
      if (!valid) continue;  // no visible key in this page for this row
      const float* qrow = pr.q + ((run.start + j) * QH + h * G + g) * D;
      __m512 qv[NV], partial[16];
      #pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(qrow + 16 * v);
#ifdef __AVX512BF16__
      if (dot_bf16) {
        constexpr int NB = NV / 2 > 0 ? NV / 2 : 1;   // 32 bf16 per vector
        __m512bh qb[NB];
        #pragma GCC unroll 8
        for (int b = 0; b < NB; ++b) qb[b] = _mm512_cvtne2ps_pbh(qv[2 * b + 1], qv[2 * b]);   // to nearest even
#pragma GCC unroll 16
        for (int64_t t = 0; t < 16; ++t) {
          __m512 d = _mm512_setzero_ps();
          #pragma GCC unroll 8
          for (int b = 0; b < NB; ++b)
            d = _mm512_dpbf16_ps(d, qb[b], (__m512bh)_mm512_loadu_si512(kraw + t * D + 32 * b));
          partial[t] = d;
        }
      } else
#endif
      {
#pragma GCC unroll 16
        for (int64_t t = 0; t < 16; ++t) {
          if (spread && r == 0) prefetch_pages_l2(nk, nv, t * lines_per_key, (t + 1) * lines_per_key);
          __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kpage + t * D));
          #pragma GCC unroll 16
          for (int v = 1; v < NV; ++v) d = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(kpage + t * D + 16 * v), d);
          partial[t] = d;
        }
      }
      const __m512 scores = sum_lanes16(partial);
      const float page_max = _mm512_mask_reduce_max_ps(valid, scores);
      const float m_old = run.m[r], m_new = std::max(m_old, page_max);
      // an unchanged max (most pages after the first few) rescales by exactly 1: skipped (alpha 1)
      const float alpha = m_old == kMasked ? 0.0f : m_new == m_old ? 1.0f : exp_lane0(m_old - m_new);
      const __m512 e = _mm512_maskz_mov_ps(valid, fast_exp16(_mm512_sub_ps(scores, _mm512_set1_ps(m_new))));
      _mm512_storeu_ps(row_e + 16 * num_active, e);
      row_alpha[num_active] = alpha;
      active[num_active++] = r;
      run.l[r] = std::fma(run.l[r], alpha, sum16(e));
      run.m[r] = m_new;
    }
    const uint16_t* vraw = vraw_all + 16 * sub * D;
    const float* vpage = vpage_all == nullptr ? nullptr : vpage_all + 16 * sub * D;
    const int64_t key_line0 = 16 * sub * v_lines;   // this sub-block's first prefetch line
    if (num_active == 0) prefetch_pages_l2(nk, nv, key_line0, key_line0 + 16 * v_lines);
    if (v_raw)
      v_pass<kD, true>(run, vraw, row_e, row_alpha, active, num_active, nkeys, nk, nv, key_line0, v_lines);
    else
      v_pass<kD, false>(run, vpage, row_e, row_alpha, active, num_active, nkeys, nk, nv, key_line0, v_lines);
  }
}

// The online softmax of 16 rows in lanes over 16 keys: s[t] the keys' scores, valid[t] which rows
// see key t; m, l the rows' running max and sum ([16], updated). The weights into e[t] (0 where
// not visible); returns the rows' rescale of their sums so far: 0 for a row's first visible keys,
// 1 while its max holds, else exp(m_old - m_new) (fold_page16's, lane by lane; 1 or 0 for a row
// with no visible key, whose m and l stay as they are). `seen`: the rows with a visible key.
inline __m512 softmax_lanes16(const __m512 s[16], const __mmask16 valid[16], float* m, float* l, __m512 e[16],
                              __mmask16* seen) {
  const __m512 masked = _mm512_set1_ps(kMasked);
  __m512 page_max = masked;
  #pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) page_max = _mm512_mask_max_ps(page_max, valid[t], page_max, s[t]);
  *seen = _mm512_cmp_ps_mask(page_max, masked, _CMP_NEQ_OQ);
  const __m512 m_old = _mm512_load_ps(m), m_new = _mm512_max_ps(m_old, page_max);
  __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), _mm512_cmp_ps_mask(m_new, m_old, _CMP_NEQ_UQ),
                                    fast_exp16(_mm512_sub_ps(m_old, m_new)));
  alpha = _mm512_mask_mov_ps(alpha, _mm512_cmp_ps_mask(m_old, masked, _CMP_EQ_OQ), _mm512_setzero_ps());
  #pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) e[t] = _mm512_maskz_mov_ps(valid[t], fast_exp16(_mm512_sub_ps(s[t], m_new)));
  _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), alpha, sum16_vertical(e)));
  _mm512_store_ps(m, m_new);
  return alpha;
}

// Folds 16 full keys (k, v: [16][kD] rows, from key0 on) into block b's rows. Each row's scores
// take fold_page16's order: a chain per lane l of sum_lanes16's input, then its tree over l.
// float32 (kBf16 false): k is float32; lane l chains fused multiply-adds over d = l, 16 + l, ...
// bfloat16: k holds the raw bf16 page and b.q the rows' q as bf16 pairs ([kD / 2][16] words);
// lane l chains `vdpbf16ps` over the pairs at d = 2l, 32 + 2l, ...
template <int64_t kD, bool kBf16>
__attribute__((noinline)) void fold_lanes16(const Problem& pr, LaneBlock& b, const void* k_page, const float* v, int64_t key0) {
  constexpr int NV = static_cast<int>(kBf16 ? kD / 32 : kD / 16);   // links of each lane's chain
  const float* q = b.q;
  __m512 s[16];
  for (int t0 = 0; t0 < 16; t0 += 4) {   // 4 keys at a time: each q vector loaded serves 4 keys
    __m512 c0[4], b2[4];
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {         // lanes 4j .. 4j + 3 of sum_lanes16's 128-bit lane j
      __m512 p[4][4];
      #pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const int l = 4 * j + u;
#ifdef __AVX512BF16__
        if constexpr (kBf16) {
          const uint16_t* k = static_cast<const uint16_t*>(k_page);
          auto pair = [&](int t, int w) {   // k[t][32w + 2l], k[t][32w + 2l + 1] as one 32-bit word, broadcast
            uint32_t word;
            std::memcpy(&word, k + t * kD + 32 * w + 2 * l, sizeof word);
            return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(word));
          };
          #pragma GCC unroll 4
          for (int kk = 0; kk < 4; ++kk) p[u][kk] = _mm512_setzero_ps();
          #pragma GCC unroll 8
          for (int w = 0; w < NV; ++w) {
            const __m512bh qw = (__m512bh)_mm512_load_si512(q + 16 * (16 * w + l));
            #pragma GCC unroll 4
            for (int kk = 0; kk < 4; ++kk) p[u][kk] = _mm512_dpbf16_ps(p[u][kk], qw, pair(t0 + kk, w));
          }
          continue;
        }
#endif
        const float* k = static_cast<const float*>(k_page);
        #pragma GCC unroll 4
        for (int kk = 0; kk < 4; ++kk)
          p[u][kk] = _mm512_mul_ps(_mm512_load_ps(q + 16 * l), _mm512_set1_ps(k[(t0 + kk) * kD + l]));
        #pragma GCC unroll 8
        for (int w = 1; w < NV; ++w) {
          #pragma GCC unroll 4
          for (int kk = 0; kk < 4; ++kk)
            p[u][kk] = _mm512_fmadd_ps(_mm512_load_ps(q + 16 * (16 * w + l)), _mm512_set1_ps(k[(t0 + kk) * kD + 16 * w + l]),
                                       p[u][kk]);
        }
      }
      #pragma GCC unroll 4
      for (int kk = 0; kk < 4; ++kk) {
        const __m512 bj = _mm512_add_ps(_mm512_add_ps(p[0][kk], p[2][kk]), _mm512_add_ps(p[1][kk], p[3][kk]));
        if (j == 0) c0[kk] = bj;
        else if (j == 1) c0[kk] = _mm512_add_ps(c0[kk], bj);
        else if (j == 2) b2[kk] = bj;
        else s[t0 + kk] = _mm512_add_ps(c0[kk], _mm512_add_ps(b2[kk], bj));
      }
    }
  }
  const __m512i pos = _mm512_load_si512(b.pos);
  const __m512i window_lo = _mm512_sub_epi32(pos, _mm512_set1_epi32(static_cast<int32_t>(pr.sliding_window)));
  __mmask16 valid[16], seen;
  #pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(key0 + t));
    valid[t] = _mm512_cmple_epi32_mask(key, pos);
    if (pr.sliding_window > 0) valid[t] &= _mm512_cmpgt_epi32_mask(key, window_lo);
  }
  __m512 e[16];
  const __m512 alpha = softmax_lanes16(s, valid, b.m, b.l, e, &seen);
  for (int64_t d = 0; d < kD; d += 4) {   // 4 independent chains over the 16 keys
    __m512 a[4];
    #pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) a[i] = _mm512_mul_ps(_mm512_load_ps(b.acc + 16 * (d + i)), alpha);
    #pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      #pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) a[i] = _mm512_fmadd_ps(e[t], _mm512_set1_ps(v[t * kD + d + i]), a[i]);
    }
    #pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm512_store_ps(b.acc + 16 * (d + i), a[i]);
  }
}
#endif

// A query row's float32 values as bf16 pairs (q[2c], q[2c + 1]), one 32-bit word each, rounded to
// nearest even as `vcvtne2ps2bf16` rounds them on the rows-one-by-one path (a bf16 model's q comes
// with its RoPE sum unrounded: XLA drops that rounding, so both paths must round alike), into lane
// `lane` of `words` ([d / 2][16]): the second operand of `vdpbf16ps` with rows in lanes and of the
// tiles' scores.
// `vcvtne2ps2bf16`'s rounding of one float: to nearest even, a NaN made quiet, subnormals to zero.
inline uint32_t cvtne_bf16(float value) {
  const uint32_t bits = jaxserve_native::bits_of(value);
  if ((bits & 0x7F800000u) == 0) return (bits >> 16) & 0x8000u;
  return jaxserve_native::round_to_bf16(bits);
}

// Where the CPU has `vcvtne2ps2bf16`, 16 pairs at a time with it (cvtne_bf16 spells out its rounding).
inline void q_pairs_into_lane(const float* qrow, int64_t d, uint32_t* words, int64_t lane) {
  int64_t c = 0;
#ifdef __AVX512BF16__
  const __m512i rows = _mm512_slli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 4);
  for (; 2 * c + 32 <= d; c += 16) {   // word j: the pair (q[2c + 2j], q[2c + 2j + 1]), for row c + j of words
    const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qrow + 2 * c + 16), _mm512_loadu_ps(qrow + 2 * c));
    _mm512_i32scatter_epi32(words + c * 16 + lane, rows, pairs, 4);
  }
#endif
  for (; c < d / 2; ++c) words[c * 16 + lane] = cvtne_bf16(qrow[2 * c]) | cvtne_bf16(qrow[2 * c + 1]) << 16;
}

// The pages to fold for several runs' rows together: those that runs read whole from the same
// pool blocks from the first page of the group's most common first block (the anchor) on, as
// many and as far as gives the most row-pages, where the runs' rows fill 16-row blocks with at
// least `min_fill` rows on average. `shared[i]`: pages from `lo` run i reads whole from the
// anchor's blocks (it is taken when that is at least end - lo). end == lo: nothing to fold.
struct SharedSpan {
  int64_t anchor = 0, lo = 0, end = 0, rows = 0;   // rows: those of the runs taken
  int64_t shared[kSeqGroup] = {};
};

inline SharedSpan shared_span(const Problem& pr, const Run* runs, int64_t n, int64_t min_fill) {
  SharedSpan span;
  if (n == 0) return span;
  const int64_t BS = pr.BS;
  auto table = [&](const Run& run, int64_t p) { return pr.tables[run.s * pr.MB + p]; };
  int64_t most = 0;
  for (int64_t a = 0; a < n; ++a) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i)
      count += runs[i].first_page == runs[a].first_page &&
               table(runs[i], runs[i].first_page) == table(runs[a], runs[a].first_page);
    if (count > most) { most = count; span.anchor = a; }
  }
  const Run& anchor = runs[span.anchor];
  const int64_t lo = anchor.first_page;
  for (int64_t i = 0; i < n; ++i) {
    const Run& run = runs[i];
    int64_t p = lo;
    if (run.first_page == lo)
      while (p < run.last_page && p < anchor.last_page && (p + 1) * BS <= run.limit && table(run, p) == table(anchor, p))
        ++p;
    span.shared[i] = p - lo;
  }
  int64_t best_pages = 0;
  for (int64_t c = 0; c < n; ++c) {   // candidate: fold the first shared[c] pages of the runs sharing that many
    const int64_t pages = span.shared[c];
    int64_t taken = 0;
    for (int64_t i = 0; i < n; ++i) taken += span.shared[i] >= pages ? runs[i].rows : 0;
    if (pages == 0 || taken < min_fill * ((taken + 15) / 16)) continue;
    if (taken * pages > span.rows * best_pages) { span.rows = taken; best_pages = pages; }
  }
  span.lo = lo;
  span.end = lo + best_pages;
  return span;
}

#ifdef __AVX512F__
// Folds the pages that several of the group's runs read whole from the same pool blocks (a
// shared prefix; every full page of a prefill block) for all their rows 16 at a time
// (`fold_lanes16`), and moves those runs' `next_page` past them; `fold_page16` takes the rest.
// The runs taken: those that share their first pages with the group's most common first block,
// as many and as far as gives the most row-pages, where their rows fill the 16-row blocks with
// at least `min_lane_fill` rows on average (below that, rows one by one are faster). Not with a
// soft cap (fold_page16 does not take those either).
template <int64_t kD>
void fold_shared_pages(const Problem& pr, Scratch& w, Run* runs, int64_t n, int64_t h) {
  const int64_t BS = pr.BS;   // a multiple of 16
#ifdef __AVX512BF16__
  const bool bf16_scores = pr.q_bf16 && pr.bits_dtype == 1 && kD % 32 == 0;   // fold_page16's dot_bf16
#else
  const bool bf16_scores = false;
#endif
  if (pr.min_lane_fill <= 0 || n == 0 || pr.soft_cap > 0.0f) return;
  const SharedSpan span = shared_span(pr, runs, n, pr.min_lane_fill);
  const int64_t lo = span.lo, end = span.end, rows = span.rows, anchor = span.anchor;
  const int64_t* shared = span.shared;
  const int64_t best_pages = end - lo;
  if (best_pages == 0 || (rows + 15) / 16 > static_cast<int64_t>(w.blocks.size())) return;
  const int64_t QH = pr.QH, G = pr.G, num_blocks = (rows + 15) / 16;
  LaneBlock* blocks = w.blocks.data();
  for (int64_t bi = 0, i = 0, r = 0; bi < num_blocks; ++bi) {
    LaneBlock& b = blocks[bi];
    b.q = w.lane_block(pr, bi);
    b.acc = b.q + 16 * kD;
    b.m = b.acc + 16 * kD;
    b.l = b.m + 16;
    std::fill(b.q, b.q + 16 * kD, 0.0f);
    std::fill(b.acc, b.acc + 16 * kD, 0.0f);
    std::fill(b.m, b.m + 16, kMasked);
    std::fill(b.l, b.l + 16, 0.0f);
    b.lanes = 0;
    for (int64_t lane = 0; lane < 16; ++lane) {
      b.pos[lane] = -1;   // no key is at or before it: an empty lane sees nothing
      while (i < n && shared[i] < best_pages) ++i;   // a run not taken
      if (i == n) continue;
      const Run& run = runs[i];
      const int64_t j = r / G, g = r % G;
      const float* qrow = pr.q + ((run.start + j) * QH + h * G + g) * kD;
      if (bf16_scores) {   // pairs (q[2c], q[2c + 1]) as one word, c = 16w + l
        q_pairs_into_lane(qrow, kD, reinterpret_cast<uint32_t*>(b.q), lane);
      } else {
        for (int64_t d = 0; d < kD; ++d) b.q[d * 16 + lane] = qrow[d];
      }
      b.pos[lane] = static_cast<int32_t>(run.pos0 + j);
      b.run[lane] = i;
      b.row[lane] = r;
      b.lanes = lane + 1;
      if (++r == run.rows) { r = 0; ++i; }
    }
  }
  const int64_t page_elems = BS * kD, page_bytes = page_elems * (pr.bits_dtype ? 2 : 4);
  for (int64_t p = lo; p < end; ++p) {
    if (p + 1 < end) {   // the next pages into L2 while this one computes
      const auto [nk, nv] = next_pages(pr, runs[anchor], h, p, page_bytes);
      prefetch_pages_l2(nk, nv, 0, page_bytes / 64);
    }
    const int64_t k_page = pool_page(pr, runs[anchor], 0, h, p);
    const float* v = page_rows(pr.kv, pr.bits_dtype, pool_page(pr, runs[anchor], 1, h, p), page_elems, w.vbuf.data());
    if (bf16_scores) {
#ifdef __AVX512BF16__
      const uint16_t* k = static_cast<const uint16_t*>(pr.kv) + k_page * page_elems;
      for (int64_t bi = 0; bi < num_blocks; ++bi)
        for (int64_t sub = 0; sub < BS / 16; ++sub)
          fold_lanes16<kD, true>(pr, blocks[bi], k + 16 * sub * kD, v + 16 * sub * kD, p * BS + 16 * sub);
#endif
    } else {
      const float* k = page_rows(pr.kv, pr.bits_dtype, k_page, page_elems, w.kbuf.data());
      for (int64_t bi = 0; bi < num_blocks; ++bi)
        for (int64_t sub = 0; sub < BS / 16; ++sub)
          fold_lanes16<kD, false>(pr, blocks[bi], k + 16 * sub * kD, v + 16 * sub * kD, p * BS + 16 * sub);
    }
  }
  lane_block_pages.fetch_add(num_blocks * (end - lo), std::memory_order_relaxed);
  for (int64_t bi = 0; bi < num_blocks; ++bi) {   // back into the runs' row-major state
    const LaneBlock& b = blocks[bi];
    for (int64_t lane = 0; lane < b.lanes; ++lane) {
      Run& run = runs[b.run[lane]];
      const int64_t r = b.row[lane];
      run.m[r] = b.m[lane];
      run.l[r] = b.l[lane];
      for (int64_t d = 0; d < kD; ++d) run.acc[r * kD + d] = b.acc[d * 16 + lane];
      run.next_page = end;
    }
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- On AMX tiles (a bf16 q against a bf16 pool, `amx` set) ----
//
// Blocks of up to 16 query rows that read the same pages (a run's rows; the rows of several runs
// over the pages they share), 16 keys at a time: the scores S = K Q^T come from `tdpbf16ps` with
// the K page as it lies as the first operand and the block's q as bf16 pairs (row = lane) as the
// second; each row's online softmax runs as in fold_page16 (keys in lanes); its weights are
// rounded to bf16 (as HF's and vLLM's bf16 attention have them) and P V comes from `tdpbf16ps`
// with V's key pairs interleaved. Every row of every item takes this one path (no other fold
// runs when it is on), so a row's bits do not depend on its block, group or batch; the tiles'
// sums do not depend on the other rows of a tile.

// V's 32-column pieces are interleaved key pair by key pair with unpacklo/hi (per 128-bit lane),
// so the output columns come in this order: position dp of the sums holds column amx_col(dp).
inline int64_t amx_col(int64_t dp) { return 32 * (dp / 32) + 8 * ((dp % 16) / 4) + dp % 4 + 4 * ((dp % 32) / 16); }

// tiles: 0 and 7 scores (in turn), 1 K (16 keys x 32 columns), 2 q pairs, 3 P (16 rows x 16
// keys), 4 V pairs (8 key pairs x 16 columns), 5-6 P V sums
inline void amx_attention_tiles() {
  jaxserve_native::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  cfg.colsb[3] = 32;
  cfg.rows[4] = 8;
  jaxserve_native::load_tile_config(cfg);
}

template <int64_t kD>
inline void amx_block_start(AmxBlock& b) {
  b.n = 0;
  std::fill(b.q, b.q + kD / 2 * 16, 0u);   // the pairs the scores read
  std::fill(b.pos, b.pos + 16, -1);   // no key is at or before it
  std::fill(b.m, b.m + 16, kMasked);
  std::fill(b.l, b.l + 16, 0.0f);
}

// Row r of `run` (KV head h), with its state so far, into the block's next lane.
template <int64_t kD>
inline void amx_block_add(const Problem& pr, AmxBlock& b, Run& run, int64_t r, int64_t h) {
  const int64_t j = r / pr.G, g = r % pr.G, lane = b.n++;
  q_pairs_into_lane(pr.q + ((run.start + j) * pr.QH + h * pr.G + g) * kD, kD, b.q, lane);
  b.pos[lane] = static_cast<int32_t>(run.pos0 + j);
  b.run_m[lane] = run.m + r;
  b.run_l[lane] = run.l + r;
  b.run_acc[lane] = run.acc + r * kD;
  b.m[lane] = run.m[r];
  b.l[lane] = run.l[r];
  std::copy(run.acc + r * kD, run.acc + (r + 1) * kD, b.acc + lane * kD);
}

// The block's rows' state back into their runs.
template <int64_t kD>
inline void amx_block_finish(AmxBlock& b) {
  for (int64_t i = 0; i < b.n; ++i) {
    *b.run_m[i] = b.m[i];
    *b.run_l[i] = b.l[i];
    std::copy(b.acc + i * kD, b.acc + (i + 1) * kD, b.run_acc[i]);
  }
}

// 16 keys of V ([16][kD] bf16 rows) as key pairs: vp[i][dp] = (v[2i][c], v[2i + 1][c]), c = amx_col(dp);
// keys from `nkeys` on are zeros (beyond a run's last key the page holds whatever was there).
// With each pair, `lines` lines of the next K and V pages (nk, nv; none when null) from line0 + i lines.
template <int64_t kD>
inline void amx_v_pairs(const uint16_t* v, int64_t nkeys, uint32_t* vp, const char* nk, const char* nv, int64_t line0,
                        int64_t lines) {
  #pragma GCC unroll 8
  for (int64_t i = 0; i < 8; ++i) {
    if (nk != nullptr) prefetch_pages_l2(nk, nv, line0 + i * lines, line0 + (i + 1) * lines);
    #pragma GCC unroll 4
    for (int64_t c = 0; c < kD; c += 32) {
      const __m512i a = 2 * i < nkeys ? _mm512_loadu_si512(v + 2 * i * kD + c) : _mm512_setzero_si512();
      const __m512i b = 2 * i + 1 < nkeys ? _mm512_loadu_si512(v + (2 * i + 1) * kD + c) : _mm512_setzero_si512();
      _mm512_store_si512(vp + i * kD + c, _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(vp + i * kD + c + 16, _mm512_unpackhi_epi16(a, b));
    }
  }
}

// The rows' weights as 8 x 16 key pairs ([pair][lane] words) into P's [lane][pair] rows.
inline void amx_transpose_pairs(const __m512i p[8], uint16_t* P) {
  __m512i t[8], u[8];
  #pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(p[2 * i], p[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(p[2 * i], p[2 * i + 1]);
  }
  #pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {   // u[4i + c]: pairs 4i .. 4i + 3 of lanes 4l + c (128-bit piece l)
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  #pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {   // lanes c, 4 + c (pieces 0, 1) and 8 + c, 12 + c (pieces 2, 3)
    const __m512i lo = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i hi = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i a = _mm512_shuffle_i32x4(lo, lo, _MM_SHUFFLE(3, 1, 2, 0));
    const __m512i b = _mm512_shuffle_i32x4(hi, hi, _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_store_si256(reinterpret_cast<__m256i*>(P + 16 * c), _mm512_castsi512_si256(a));
    _mm256_store_si256(reinterpret_cast<__m256i*>(P + 16 * (4 + c)), _mm512_extracti64x4_epi64(a, 1));
    _mm256_store_si256(reinterpret_cast<__m256i*>(P + 16 * (8 + c)), _mm512_castsi512_si256(b));
    _mm256_store_si256(reinterpret_cast<__m256i*>(P + 16 * (12 + c)), _mm512_extracti64x4_epi64(b, 1));
  }
}

// Rows at least this many fold with rows in lanes (no gather, no per-row reductions); fewer
// one by one. The same operations per row in the same order either way, so the same bits.
constexpr int64_t kAmxLaneRows = 8;

// Block b's scores of 16 keys (k: their [16][kD] bf16 rows) into S [key][lane], on sum tile 0 or 7
// (the tile intrinsics take literal tile numbers).
#define JAXSERVE_AMX_SCORES(T)                                      \
  _tile_zero(T);                                                    \
  for (int64_t c = 0; c < kD; c += 32) {                            \
    _tile_loadd(1, k + c, kD * 2);                                  \
    _tile_loadd(2, b.q + 8 * c, 64); /* k pairs c / 2 .. + 15 */    \
    _tile_dpbf16ps(T, 1, 2);                                        \
  }                                                                 \
  _tile_stored(T, S, 64);
template <int kTile, int64_t kD>
inline void amx_scores(const AmxBlock& b, const uint16_t* k, float* S) {
  if constexpr (kTile == 0) {
    JAXSERVE_AMX_SCORES(0)
  } else {
    JAXSERVE_AMX_SCORES(7)
  }
}
#undef JAXSERVE_AMX_SCORES

// Folds 16 keys from key0 into block b's rows: their scores S (amx_scores), V's key pairs vp
// (amx_v_pairs); nkeys of them exist.
template <int64_t kD>
void fold_amx(const Problem& pr, AmxBlock& b, AmxScratch& s, const float* S, const uint32_t* vp, int64_t key0,
              int64_t nkeys) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int32_t window = static_cast<int32_t>(pr.sliding_window);
  const __m512 scale = _mm512_set1_ps(pr.score_scale);   // 1: exact, the scores as they are
  bool any = false;
  if (b.n >= kAmxLaneRows) {   // rows in lanes: S's rows are each key's scores
    const __m512i pos = _mm512_load_si512(b.pos);
    const __m512i window_lo = _mm512_sub_epi32(pos, _mm512_set1_epi32(window));
    __m512 sc[16], e[16];
    __mmask16 valid[16], seen;
    #pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(key0 + t));
      valid[t] = t < nkeys ? _mm512_cmple_epi32_mask(key, pos) : __mmask16(0);
      if (window > 0) valid[t] &= _mm512_cmpgt_epi32_mask(key, window_lo);
      sc[t] = _mm512_mul_ps(_mm512_load_ps(S + 16 * t), scale);
    }
    const __m512 alpha = softmax_lanes16(sc, valid, b.m, b.l, e, &seen);
    if (!seen) return;
    any = true;
    _mm512_store_ps(s.alpha, _mm512_mask_mov_ps(_mm512_set1_ps(-1.0f), seen, alpha));   // -1: nothing to add
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i pairs[8];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      pairs[i] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(e[2 * i + 1], e[2 * i]));
    amx_transpose_pairs(pairs, s.P);
  } else {   // row by row: each row's scores (a column of S) in lanes
    const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(key0)), iota);
    const __m512i column = _mm512_slli_epi32(iota, 4);   // S[t][lane] at t * 16 + lane
    const __mmask16 in_page = jaxserve_native::tail_mask(nkeys);
    for (int64_t i = 0; i < b.n; ++i) {
      __mmask16 valid = in_page & _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(b.pos[i]));
      if (window > 0) valid &= _mm512_cmpgt_epi32_mask(keys, _mm512_set1_epi32(b.pos[i] - window));
      __m256i weights = _mm256_setzero_si256();
      float alpha = -1.0f;   // nothing to add
      const __m512 scores = valid ? _mm512_mul_ps(_mm512_i32gather_ps(column, S + i, 4), scale) : _mm512_setzero_ps();
      const float page_max = valid ? _mm512_mask_reduce_max_ps(valid, scores) : kMasked;
      if (page_max > kMasked) {   // the lanes' `seen`: a visible key scored above the stand-in for -inf
        const float m_old = b.m[i], m_new = std::max(m_old, page_max);
        alpha = m_old == kMasked ? 0.0f : m_new == m_old ? 1.0f : exp_lane0(m_old - m_new);
        const __m512 e = _mm512_maskz_mov_ps(valid, fast_exp16(_mm512_sub_ps(scores, _mm512_set1_ps(m_new))));
        b.l[i] = std::fma(b.l[i], alpha, sum16(e));
        b.m[i] = m_new;
        weights = (__m256i)_mm512_cvtneps_pbh(e);
        any = true;
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(s.P + 16 * i), weights);
      s.alpha[i] = alpha;
    }
  }
  if (!any) return;
  _tile_loadd(3, s.P, 32);
  #pragma GCC unroll 4
  for (int64_t c = 0; c < kD; c += 32) {   // two sum tiles in turn
    _tile_zero(5);
    _tile_loadd(4, vp + c, kD * 4);
    _tile_dpbf16ps(5, 3, 4);
    _tile_zero(6);
    _tile_loadd(4, vp + c + 16, kD * 4);
    _tile_dpbf16ps(6, 3, 4);
    _tile_stored(5, s.pv + 16 * c, 64);
    _tile_stored(6, s.pv + 16 * (c + 16), 64);
  }
  for (int64_t i = 0; i < b.n; ++i) {
    if (s.alpha[i] < 0.0f) continue;
    const __m512 alpha = _mm512_set1_ps(s.alpha[i]);
    float* acc = b.acc + i * kD;
    #pragma GCC unroll 8
    for (int64_t c = 0; c < kD; c += 16)
      _mm512_store_ps(acc + c, _mm512_fmadd_ps(_mm512_load_ps(acc + c), alpha, _mm512_load_ps(s.pv + 16 * c + 16 * i)));
  }
}

// Pages [p0, p1) of `run`'s table (KV head h), keys before `limit`, folded into blocks[0, nb), 16 keys at a time, then
// the blocks' state back into their runs; returns the folds. Software-pipelined: the next fold's scores (and, for a
// new 16 keys, V's pairs) are under way on the other score tile while this one's softmax runs
// (the tiles are not renamed: one tile would serialise the folds).
template <int64_t kD>
int64_t amx_pages(const Problem& pr, AmxScratch& s, const Run& run, int64_t h, int64_t p0, int64_t p1, int64_t limit,
                  AmxBlock* blocks, int64_t nb) {
  const int64_t BS = pr.BS, page_elems = BS * kD, page_bytes = page_elems * 2, subs = BS / 16;
  const uint16_t* kv = static_cast<const uint16_t*>(pr.kv);
  const char* base = static_cast<const char*>(pr.kv);
  const int64_t lines = page_bytes / 64 / subs / 8;   // prefetched lines of the next pages per key pair
  auto keys_at = [&](int64_t p, int64_t sub) { return std::min<int64_t>(16, limit - (p * BS + 16 * sub)); };
  struct Unit {   // one fold: 16 keys (page p, piece sub) into block bi; g counts the pieces, u the folds
    int64_t p, sub, bi, g, u;
  };
  // Starts fold x: V's pairs for a new piece (prefetching the next pages' lines), then its scores.
  auto start = [&](const Unit& x) {
    const int64_t key_off = 16 * x.sub * kD;
    if (x.bi == 0) {
      const bool more = x.p + 1 < p1;
      const char* nk = more ? base + pool_page(pr, run, 0, h, x.p + 1) * page_bytes : nullptr;
      const char* nv = more ? base + pool_page(pr, run, 1, h, x.p + 1) * page_bytes : nullptr;
      amx_v_pairs<kD>(kv + pool_page(pr, run, 1, h, x.p) * page_elems + key_off, keys_at(x.p, x.sub), s.vp[x.g % 2],
                      nk, nv, 8 * lines * x.sub, lines);
    }
    const uint16_t* k = kv + pool_page(pr, run, 0, h, x.p) * page_elems + key_off;
    if (x.u % 2) amx_scores<7, kD>(blocks[x.bi], k, s.S[1]);
    else amx_scores<0, kD>(blocks[x.bi], k, s.S[0]);
  };
  auto next = [&](const Unit& x, Unit& y) {   // false after the last fold
    y = Unit{x.p, x.sub, x.bi + 1, x.g, x.u + 1};
    if (y.bi < nb) return true;
    y.bi = 0;
    ++y.g;
    if (++y.sub == subs) y.sub = 0, ++y.p;
    return y.p < p1 && keys_at(y.p, y.sub) > 0;
  };
  if (nb == 0 || p0 >= p1 || keys_at(p0, 0) <= 0) return 0;
  Unit x{p0, 0, 0, 0, 0}, y;
  start(x);
  while (true) {
    const bool more = next(x, y);
    if (more) start(y);
    fold_amx<kD>(pr, blocks[x.bi], s, s.S[x.u % 2], s.vp[x.g % 2], x.p * BS + 16 * x.sub, keys_at(x.p, x.sub));
    if (!more) break;
    x = y;
  }
  for (int64_t bi = 0; bi < nb; ++bi) amx_block_finish<kD>(blocks[bi]);
  return x.u + 1;
}

// `attend` on the tiles: the pages several runs share first, for all their rows together, then
// each run's other pages for its own rows.
template <int64_t kD>
void attend_amx(const Problem& pr, Scratch& w, Run* runs, int64_t n, int64_t h) {
  AmxScratch& s = *w.amx;
  amx_attention_tiles();
  auto blocks_for = [&](int64_t rows) -> AmxBlock* {
    const size_t need = static_cast<size_t>((rows + 15) / 16);
    if (s.blocks.size() < need) s.blocks.resize(need);
    return s.blocks.data();
  };
  auto add_rows = [&](AmxBlock* blocks, int64_t& nb, Run& run) {   // run's rows into the blocks' next lanes
    for (int64_t r = 0; r < run.rows; ++r) {
      if (nb == 0 || blocks[nb - 1].n == 16) amx_block_start<kD>(blocks[nb++]);
      amx_block_add<kD>(pr, blocks[nb - 1], run, r, h);
    }
  };
  // several runs share pages (min_lane_fill 0: never together, the A/B switch; the bits are the same)
  const SharedSpan span = shared_span(pr, runs, n, 1);
  int64_t folds = 0, taken = 0;
  for (int64_t i = 0; i < n; ++i) taken += span.end > span.lo && span.shared[i] >= span.end - span.lo;
  if (pr.min_lane_fill > 0 && taken >= 2) {
    AmxBlock* blocks = blocks_for(span.rows);
    int64_t nb = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (span.shared[i] < span.end - span.lo) continue;
      add_rows(blocks, nb, runs[i]);
      runs[i].next_page = span.end;
    }
    // every taken run reads these pages whole (the anchor itself may not: its limit is not theirs)
    folds += amx_pages<kD>(pr, s, runs[span.anchor], h, span.lo, span.end, span.end * pr.BS, blocks, nb);
    lane_block_pages.fetch_add(nb * (span.end - span.lo), std::memory_order_relaxed);
  }
  for (int64_t i = 0; i < n; ++i) {
    Run& run = runs[i];
    if (run.next_page >= run.last_page) continue;
    AmxBlock* blocks = blocks_for(run.rows);
    int64_t nb = 0;
    add_rows(blocks, nb, run);
    folds += amx_pages<kD>(pr, s, run, h, run.next_page, run.last_page, run.limit, blocks, nb);
  }
  amx_folds.fetch_add(folds, std::memory_order_relaxed);   // once: a locked add waits for every store before it
  _tile_release();   // the tile state back (no 8 KB to save at each switch, deeper idle states)
}
#endif

// Output row `row`: a row's sums acc [D] times inv (one float32 multiply each), in column order
// (the sums in amx_col order when `amx_columns`), as float32 or rounded to bfloat16 as put_out
// rounds them; 16 columns at a time (the same values as one by one).
inline void put_row(const Problem& pr, int64_t row, const float* acc, float inv, bool amx_columns) {
  const int64_t D = pr.D;
  int64_t d = 0;
#ifdef __AVX512F__
  const __m512 scale = _mm512_set1_ps(inv);
  auto store16 = [&](int64_t col, __m512 v) {
    if (pr.out_bf16) {
      const __m512i bits = jaxserve_native::round_to_bf16x16(_mm512_castps_si512(v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(pr.out) + row * D + col),
                          _mm512_cvtepi32_epi16(bits));
    } else {
      _mm512_storeu_ps(static_cast<float*>(pr.out) + row * D + col, v);
    }
  };
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_columns) {   // D a multiple of 32: each 32 sums hold columns amx_col(dp) of their 32
    static const auto from = [] {   // from[c]: the position dp (of 32) that holds column c
      std::array<int32_t, 32> f{};
      for (int32_t dp = 0; dp < 32; ++dp) f[amx_col(dp)] = dp;
      return f;
    }();
    const __m512i lo = _mm512_loadu_si512(from.data()), hi = _mm512_loadu_si512(from.data() + 16);
    for (; d + 32 <= D; d += 32) {
      const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + d), scale);
      const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 16), scale);
      store16(d, _mm512_permutex2var_ps(a, lo, b));
      store16(d + 16, _mm512_permutex2var_ps(a, hi, b));
    }
  }
#endif
  if (!amx_columns)
    for (; d + 16 <= D; d += 16) store16(d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), scale));
#endif
  // Only the vector folds' rows reach here (the tiles take head dims of 64 and 128, done above).
  for (; d < D; ++d) pr.put_out(row * D + d, acc[d] * inv);
}

// Rows of up to kSeqGroup sequences over KV head h, walked page index by page index: when
// sequences share a prefix, their shared pages are read from memory once and from cache by
// the others (cascade attention without a separate pass). kD: the head dim of the common
// shapes, with pages of a multiple of 16 keys (the vector folds); 0 for any other shape.
template <int64_t kD>
void attend(const Problem& pr, Scratch& w, const Segment* segs, int64_t count, int64_t h, int64_t max_rows) {
  const int64_t BS = pr.BS, D = kD ? kD : pr.D, G = pr.G, QH = pr.QH;
  Run runs[kSeqGroup];
  int64_t n = 0, lo = INT64_MAX, hi = 0;
  for (int64_t i = 0; i < count; ++i) {
    const Segment& seg = segs[i];
    const int64_t s = seg.s, q_len = pr.qsl[s + 1] - pr.qsl[s];
    const int64_t earlier = pr.ctx_lens[s] - q_len;  // keys cached before this step
    if (earlier < 0) continue;
    const int64_t start = pr.qsl[s] + seg.j0, pos0 = earlier + seg.j0;
    const int64_t limit = pos0 + seg.nq;  // keys up to the segment's last query (the pool holds this step's)
    // Earliest key any row may see (the window of the first query position).
    const int64_t first_key = pr.sliding_window > 0 ? std::max<int64_t>(0, pos0 - pr.sliding_window + 1) : 0;
    Run& r = runs[n];
    r = Run{s, start, seg.nq, seg.nq * G, pos0, limit, first_key / BS,
            std::min<int64_t>((limit + BS - 1) / BS, pr.MB), first_key / BS, w.m.data() + n * max_rows,
            w.l.data() + n * max_rows, w.acc.data() + n * max_rows * D};
    std::fill(r.m, r.m + r.rows, kMasked);
    std::fill(r.l, r.l + r.rows, 0.0f);
    std::fill(r.acc, r.acc + r.rows * D, 0.0f);
    lo = std::min(lo, r.first_page);
    hi = std::max(hi, r.last_page);
    ++n;
  }
  bool amx_columns = false;   // the sums in amx_col order
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (kD == 64 || kD == 128) {
    if (pr.amx) {
      if (!w.amx) w.amx = std::make_unique<AmxScratch>();
      attend_amx<kD>(pr, w, runs, n, h);
      amx_columns = true;
      lo = hi;   // every page folded
    }
  }
#endif
#ifdef __AVX512F__
  if constexpr (kD > 0) {
    if (!amx_columns) fold_shared_pages<kD>(pr, w, runs, n, h);
  }
#endif
  for (int64_t p = lo; p < hi; ++p)
    for (int64_t i = 0; i < n; ++i)
      if (p >= runs[i].next_page && p < runs[i].last_page) {
#ifdef __AVX512F__
        if constexpr (kD > 0) {
          if (pr.soft_cap <= 0.0f) {
            fold_page16<kD>(pr, w, runs[i], h, p);
            continue;
          }
        }
#endif
        fold_page<0, kD>(pr, w, runs[i], h, p);
      }
  for (int64_t i = 0; i < n; ++i) {
    const Run& r = runs[i];
    for (int64_t k = 0; k < r.rows; ++k) {
      if (r.l[k] == 0.0f) continue;
      const int64_t j = k / G, g = k % G;
      const int64_t row = (r.start + j) * QH + h * G + g;
      put_row(pr, row, r.acc + k * D, 1.0f / r.l[k], amx_columns);
      pr.lse[row] = r.m[k] + std::log(r.l[k]);
    }
  }
}

ffi::Error PagedContextImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> block_tables,
                            ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::S32> query_start_loc,
                            ffi::Buffer<ffi::S32> num_seqs_buf, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                            ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> lse, int64_t rope,
                            float q_scale, int64_t bits_dtype, int64_t max_q_len,
                            int64_t sliding_window, float soft_cap, int64_t q_bf16, int64_t min_lane_fill,
                            int64_t amx, float score_scale) {
  const auto qd = q.dimensions();
  const auto kd = kv.dimensions();
  if (qd.size() != 3 || kd.size() != 5) return ffi::Error::InvalidArgument("q must be rank 3 and kv rank 5");
  if (q.element_type() != (rope ? ffi::DataType::BF16 : ffi::DataType::F32))
    return ffi::Error::InvalidArgument("q must be float32 (or bfloat16 before its RoPE, with rope)");
  if (rope) {
#ifdef __AVX512F__
    const int64_t rows_d = qd[0] * qd[2];
    if (qd[2] % 32 != 0 || cos.element_type() != ffi::DataType::BF16 || sin.element_type() != ffi::DataType::BF16 ||
        static_cast<int64_t>(cos.element_count()) != rows_d || static_cast<int64_t>(sin.element_count()) != rows_d)
      return ffi::Error::InvalidArgument("rope takes a head dim of a multiple of 32 and bfloat16 cos and sin [T, D]");
#else
    return ffi::Error::InvalidArgument("rope needs AVX-512");
#endif
  }
  // With rope: each work item rotates and scales its own rows of q (its runs, its KV head's query
  // heads) into this buffer before it reads them.
  // The calling thread's (the helpers get its pointer): kept up to 16 MB, larger ones freed on return.
  constexpr size_t kKeptFloats = size_t{4} << 20;
  thread_local std::vector<float> kept;
  std::vector<float> once;
  std::vector<float>& rotated_buffer = q.element_count() <= kKeptFloats ? kept : once;
  if (rope) rotated_buffer.resize(static_cast<size_t>(q.element_count()));
  float* rotated = rope ? rotated_buffer.data() : nullptr;
  const float* q_rows = rope ? rotated : static_cast<const float*>(q.untyped_data());
  const bool out_bf16 = out->element_type() == ffi::DataType::BF16;
  if (!out_bf16 && out->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("out must be float32 or bfloat16");
  if (out->element_count() != q.element_count()) return ffi::Error::InvalidArgument("out must be [T, QH, D]");
  Problem pr{q_rows, kv.untyped_data(), block_tables.typed_data(), context_lens.typed_data(),
             query_start_loc.typed_data(), out->untyped_data(), lse->typed_data(),
             qd[0], qd[1], qd[2], kd[1], kd[2], kd[3], block_tables.dimensions()[1], 0, bits_dtype,
             sliding_window, soft_cap, q_bf16 != 0, min_lane_fill, false, score_scale, out_bf16};
  if (kd[4] != pr.D || pr.QH % pr.KVH) return ffi::Error::InvalidArgument("q and kv shapes disagree");
  pr.G = pr.QH / pr.KVH;
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
  pr.amx = amx != 0 && jaxserve_native::amx_permitted() && pr.bits_dtype == 1 && pr.q_bf16 && pr.soft_cap <= 0.0f &&
           pr.BS % 16 == 0 && (pr.D == 64 || pr.D == 128);
#endif
  if (score_scale != 1.0f && !pr.amx)
    return ffi::Error::InvalidArgument("score_scale other than 1 needs the AMX path (amx set, a bf16 q against a bf16 "
                                       "pool, head dim 64 or 128, pages of a multiple of 16, no soft cap, AMX usable)");
  const int64_t num_seqs = std::min<int64_t>(num_seqs_buf.typed_data()[0], block_tables.dimensions()[0]);
  std::memset(pr.out, 0, out->size_bytes());   // 0 in either dtype
  std::fill(pr.lse, pr.lse + pr.T * pr.QH, -std::numeric_limits<float>::infinity());
  auto fn = &attend<0>;   // the vector folds take pages of 16, 32, ... keys and head dims 64 / 128
  if (pr.BS % 16 == 0 && pr.D == 64) fn = &attend<64>;
  else if (pr.BS % 16 == 0 && pr.D == 128) fn = &attend<128>;

  // Work items: each longer run (prefill, chunk) cut into blocks of kQueryBlock queries, one item
  // each and first (the heavy ones); then the short runs (decodes) in groups of up to kSeqGroup
  // (below). Each item runs once per KV head.
  std::vector<Segment> segs;
  std::vector<std::pair<int64_t, int64_t>> items;  // (first segment, count)
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t start = pr.qsl[s], q_len = pr.qsl[s + 1] - pr.qsl[s];
    if (q_len <= kQueryBlock || q_len > max_q_len || start < 0 || start + q_len > pr.T) continue;
    for (int64_t j0 = 0; j0 < q_len; j0 += kQueryBlock) {
      items.emplace_back(static_cast<int64_t>(segs.size()), 1);
      segs.push_back({s, j0, std::min(kQueryBlock, q_len - j0)});
    }
  }
  const int64_t first_short = static_cast<int64_t>(segs.size());
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t start = pr.qsl[s], q_len = pr.qsl[s + 1] - pr.qsl[s];
    if (q_len >= 1 && q_len <= std::min(kQueryBlock, max_q_len) && start >= 0 && start + q_len <= pr.T)
      segs.push_back({s, 0, q_len});
  }
  // Runs that start from the same pool block (a shared prefix) next to each other, then groups
  // of at most kSeqGroup of even sizes. A row's numbers do not depend on its group.
  std::stable_sort(segs.begin() + first_short, segs.end(), [&](const Segment& a, const Segment& b) {
    return pr.tables[a.s * pr.MB] < pr.tables[b.s * pr.MB];
  });
  const int64_t num_short = static_cast<int64_t>(segs.size()) - first_short;
  const int64_t num_groups = (num_short + kSeqGroup - 1) / kSeqGroup;
  for (int64_t g = 0, i = first_short; g < num_groups; ++g) {
    const int64_t size = (num_short - (i - first_short) + (num_groups - g) - 1) / (num_groups - g);
    items.emplace_back(i, size);
    i += size;
  }
  const int64_t max_rows = std::min(max_q_len, kQueryBlock) * pr.G;
  const int64_t num_items = static_cast<int64_t>(items.size());
  jaxserve_native::parallel_for(pool, num_items * pr.KVH, std::max<int64_t>(1, pool.num_threads()), [&](int64_t work) {
    thread_local std::unique_ptr<Scratch> scratch;
    if (!scratch || !scratch->fits(pr, max_rows)) scratch = std::make_unique<Scratch>(pr, max_rows);
    const auto [first, count] = items[work / pr.KVH];
#ifdef __AVX512F__
    if (rope) {   // this item's rows of q: its segments' queries, the query heads of KV head h
      const int64_t h = work % pr.KVH, D = pr.D;
      const auto* x = static_cast<const uint16_t*>(q.untyped_data());
      const auto* c = static_cast<const uint16_t*>(cos.untyped_data());
      const auto* s = static_cast<const uint16_t*>(sin.untyped_data());
      const __m512 scale = _mm512_set1_ps(q_scale);
      for (int64_t i = first; i < first + count; ++i)
        for (int64_t t = pr.qsl[segs[i].s] + segs[i].j0, end = t + segs[i].nq; t < end; ++t)
          for (int64_t g = h * pr.G; g < (h + 1) * pr.G; ++g) {
            float* row = rotated + (t * pr.QH + g) * D;
            jaxserve_native::rope_row_bf16(x + (t * pr.QH + g) * D, c + t * D, s + t * D, D,
                                           [row, scale](int64_t d, __m512 sum) {
              _mm512_storeu_ps(row + d, _mm512_mul_ps(sum, scale));   // XLA's (a + b) * sm_scale
            });
          }
    }
#endif
    fn(pr, *scratch, segs.data() + first, count, work % pr.KVH, max_rows);
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int64_t JaxserveLaneBlockPages() { return lane_block_pages.load(std::memory_order_relaxed); }
extern "C" int64_t JaxserveAmxAttentionFolds() { return amx_folds.load(std::memory_order_relaxed); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedContext, PagedContextImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()          // q: float32, or bfloat16 before RoPE (rope)
                                  .Arg<ffi::AnyBuffer>()          // kv
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // context_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Arg<ffi::AnyBuffer>()          // cos [T, D] bfloat16 (rope) or anything
                                  .Arg<ffi::AnyBuffer>()          // sin [T, D]
                                  .Ret<ffi::AnyBuffer>()          // out, float32 or bfloat16
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Attr<int64_t>("rope")          // 1: q comes before its RoPE: rotated here
                                  .Attr<float>("q_scale")         // rope: the rotated q times this
                                  .Attr<int64_t>("bits_dtype")
                                  .Attr<int64_t>("max_q_len")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("q_bf16")       // 1: q's values are bfloat16 exactly
                                  .Attr<int64_t>("min_lane_fill")   // rows per 16-lane block to fold shared pages so
                                  .Attr<int64_t>("amx")             // 1: on AMX tiles where they apply
                                  .Attr<float>("score_scale"));     // the tiles' scores times this
