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
// Method (n >= 65536 and k <= n/16): a strided sample gives a magnitude that about 1.25 k entries
// exceed; one streaming pass collects them (kernels/select.h) and an exact select among those
// finishes, so the cost is close to one read of x. If the sample misleads (fewer than k
// candidates), or for small n or large k, TopKAbsRadix below runs instead; the result is the same.
size_t TopKAbs(const float* x, size_t n, size_t k, uint32_t* idx_out);

// The same result by radix select on the IEEE-754 bit pattern of |x| (monotone in the magnitude for
// non-NaN values): one histogram pass over the top 11 bits, one pass collecting the candidates
// of the bucket that holds the k-th largest, an exact select among those, and one output pass.
// NaN compares above +Inf (its bit pattern is larger); callers reject non-finite gradients.
//
// REQUIRES: n < 2^32; idx_out has room for min(k, n) elements.
size_t TopKAbsRadix(const float* x, size_t n, size_t k, uint32_t* idx_out);

}  // namespace sparseps::kernels
