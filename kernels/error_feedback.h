// Error feedback (residual accumulation) and sparse scatter/gather kernels.
//
// Thread-safety: reentrant; callers own all buffers. Index arrays must be in bounds (callers
// validate untrusted indices before calling).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define SPARSEPS_HOST_DEVICE __host__ __device__
#else
#define SPARSEPS_HOST_DEVICE
#endif

namespace sparseps::kernels {

// The sketch's partial reset of one residual entry v (compression.sketch.partial_reset): takes
// this worker's share s of the value the servers applied, clipped to what v holds. Returns v - s
// when s and v have the same sign and |s| < |v|, 0 when they have the same sign and |s| >= |v|,
// and v unchanged when the signs differ or either is zero. |result| <= |v| always. The CPU and
// GPU sketch compressors share it, so both give the same bits.
SPARSEPS_HOST_DEVICE inline float PartialReset(float v, float s) {
  if (v > 0.0f && s > 0.0f) return s < v ? v - s : 0.0f;
  if (v < 0.0f && s < 0.0f) return s > v ? v - s : 0.0f;
  return v;
}

// DGC momentum correction (Lin et al., ICLR 2018, §3.2): u = m*u + g; v = v + u, elementwise over
// n elements. With m = 0 this is plain residual accumulation v += g.
void MomentumCorrection(float* u, float* v, const float* g, float m, size_t n);

// Gathers out[j] = v[idx[j]] and then zeroes v[idx[j]] (the residual keeps what was not sent),
// and zeroes u[idx[j]] when u is not null (DGC momentum factor masking). k entries.
void GatherAndZero(float* v, float* u, const uint32_t* idx, size_t k, float* out);

// dst[idx[j]] += vals[j] for j in [0, k). Duplicate indices accumulate.
void ScatterAdd(float* dst, const uint32_t* idx, const float* vals, size_t k);

// y += a * x over n elements (x may be y). Each element as the scalar loop computes it.
void Axpy(float a, const float* x, float* y, size_t n);

// x *= a over n elements.
void Scale(float a, float* x, size_t n);

// Returns true when every one of the n values is finite (no NaN, no Inf). One streaming read:
// each value's exponent bits are compared with all ones, 16 values at a time with SSE2 (where the
// compiler has it), with no early exit. Thread-safe (reads only).
bool AllFinite(const float* x, size_t n);

}  // namespace sparseps::kernels
