// Weight shapes shared by the native matmul kernels (built together by kernels_pallas/native_cpu.py).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxserve_native {

// N of an output-major weight (each output's K values together in memory): a [N..., K...] matrix
// (the lm head's [vocab, hidden]) or a [K..., N...] projection kernel stored with its K axes minor
// (the caller names that layout to XLA, which hands the buffer over as it lies). -1 when no
// leading or trailing axes multiply to K.
inline int64_t output_major_columns(xla::ffi::Span<const int64_t> dims, int64_t count, int64_t K) {
  if (K <= 0 || count % K != 0) return -1;
  int64_t lead = 1, trail = 1;
  for (size_t j = 0; j < dims.size(); ++j)
    if ((lead *= dims[j]) == K) return count / K;
  for (size_t j = dims.size(); j > 0; --j)
    if ((trail *= dims[j - 1]) == K) return count / K;
  return -1;
}

// N of a weight of the matmul kernels: [K, N] row-major, or output-major; -1 when it does not fit K.
inline int64_t weight_columns(xla::ffi::Span<const int64_t> dims, int64_t count, int64_t K, bool output_major) {
  if (output_major) return output_major_columns(dims, count, K);
  return dims.size() == 2 && dims[0] == K ? dims[1] : -1;
}

}  // namespace jaxserve_native
