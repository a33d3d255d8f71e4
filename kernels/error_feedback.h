// Error feedback (residual accumulation) and sparse scatter/gather kernels.
//
// Thread-safety: reentrant; callers own all buffers. Index arrays must be in bounds (callers
// validate untrusted indices before calling).
#pragma once

#include <cstddef>
#include <cstdint>

namespace sparseps::kernels {

// DGC momentum correction (Lin et al., ICLR 2018, §3.2): u = m*u + g; v = v + u, elementwise over
// n elements. With m = 0 this is plain residual accumulation v += g.
void MomentumCorrection(float* u, float* v, const float* g, float m, size_t n);

// Gathers out[j] = v[idx[j]] and then zeroes v[idx[j]] (the residual keeps what was not sent),
// and zeroes u[idx[j]] when u is not null (DGC momentum factor masking). k entries.
void GatherAndZero(float* v, float* u, const uint32_t* idx, size_t k, float* out);

// dst[idx[j]] += vals[j] for j in [0, k). Duplicate indices accumulate.
void ScatterAdd(float* dst, const uint32_t* idx, const float* vals, size_t k);

// y += a * x over n elements.
void Axpy(float a, const float* x, float* y, size_t n);

// x *= a over n elements.
void Scale(float a, float* x, size_t n);

// Returns true when every one of the n values is finite (no NaN, no Inf). One streaming read:
// each value's exponent bits are compared with all ones, 16 values at a time with SSE2 (where the
// compiler has it), with no early exit. Thread-safe (reads only).
bool AllFinite(const float* x, size_t n);

}  // namespace sparseps::kernels
