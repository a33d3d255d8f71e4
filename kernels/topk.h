// Top-k selection by magnitude over a flat fp32 vector.
//
// Thread-safety: the functions are reentrant; callers own all buffers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sparseps::kernels {

// Selects the k entries of x[0, n) with the largest |x[i]| and writes their indices to
// idx_out[0, min(k, n)) in strictly increasing order. Ties at the threshold magnitude are broken
// towards lower indices, so the result is deterministic. Returns min(k, n).
//
// Method: radix select on the IEEE-754 bit pattern of |x| (monotone in the magnitude for
// non-NaN values): one histogram pass over the top 11 bits, one pass collecting the candidates
// of the bucket that holds the k-th largest, an exact select among those, and one output pass.
// NaN compares above +Inf (its bit pattern is larger); callers reject non-finite gradients.
//
// REQUIRES: n < 2^32; idx_out has room for min(k, n) elements.
size_t TopKAbs(const float* x, size_t n, size_t k, uint32_t* idx_out);

}  // namespace sparseps::kernels
