// A step's keys and values into their slots of the paged KV pool, in place, for CPUs.
//
// An XLA FFI custom call built with paged_context.cc (kernels_pallas/native_cpu.py). The jnp
// `write_kv_cache` is a scatter whose updates XLA lays out token-major ([T, 2, KVH, 1, D]), so
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
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteKvImpl(ffi::ThreadPool pool_threads, ffi::AnyBuffer kv, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::Result<ffi::AnyBuffer> out) {
  const auto kd = kv.dimensions(), td = k.dimensions();
  if (kd.size() != 5 || kd[0] != 2) return ffi::Error::InvalidArgument("write_kv: kv must be [2, KVH, NB, BS, D]");
  const int64_t KVH = kd[1], NB = kd[2], BS = kd[3], D = kd[4];
  if (td.size() != 3 || td[1] != KVH || td[2] != D || v.dimensions().size() != 3 || v.element_count() != k.element_count())
    return ffi::Error::InvalidArgument("write_kv: k and v must be [T, KVH, D] of the pool's heads and head dim");
  if (k.element_type() != kv.element_type() || v.element_type() != kv.element_type() ||
      out->element_type() != kv.element_type())
    return ffi::Error::InvalidArgument("write_kv: k, v and the pool must share one element type");
  const int64_t T = td[0], slots = NB * BS;
  if (static_cast<int64_t>(slot_mapping.element_count()) != T)
    return ffi::Error::InvalidArgument("write_kv: slot_mapping must have one slot per token");
  const size_t elem = ffi::ByteWidth(kv.element_type());
  char* pool = static_cast<char*>(out->untyped_data());
  if (pool != kv.untyped_data())   // not aliased (XLA gave the output its own buffer): start from kv
    std::memcpy(pool, kv.untyped_data(), kv.size_bytes());
  const size_t row = static_cast<size_t>(D) * elem;
  const char* src[2] = {static_cast<const char*>(k.untyped_data()), static_cast<const char*>(v.untyped_data())};
  const int32_t* slot = slot_mapping.typed_data();
  // One item per (K or V, head): each writes its own rows of the pool (stores that miss the cache,
  // one row per token, so two threads take them about twice as fast).
  jaxserve_native::parallel_for(pool_threads, 2 * KVH, std::max<int64_t>(1, pool_threads.num_threads()), [&](int64_t item) {
    const int64_t half = item / KVH, h = item % KVH;
    char* dst = pool + item * slots * row;
    for (int64_t t = 0; t < T; ++t) {
      int64_t s = slot[t];
      if (s < 0) s += slots;
      if (s >= 0 && s < slots) std::memcpy(dst + s * row, src[half] + (t * KVH + h) * row, row);
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
                                  .Ret<ffi::AnyBuffer>());        // kv pool, updated (aliased)
