// Compact value and index formats for the topk encoding: IEEE half floats and LEB128 varints of
// index gaps. Thread-safety: reentrant.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sparseps::kernels {

// float -> IEEE 754 binary16 bits, round to nearest even; magnitudes above the largest half
// (65504) saturate to +-65504 (never Inf); NaN stays NaN.
uint16_t FloatToHalf(float f);
// binary16 bits -> float (exact).
float HalfToFloat(uint16_t h);

// The float nearest to f that a half represents: HalfToFloat(FloatToHalf(f)).
inline float RoundToHalf(float f) { return HalfToFloat(FloatToHalf(f)); }

// The largest |x[j]|, j < n (0 when n is 0). REQUIRES: no NaN.
float MaxAbs(const float* x, size_t n);

// out[j] = FloatToHalf(x[j] * 2^e) for j < n (the product exact, rounded once to a half), for
// tables whose scaled magnitudes stay below 65504 (the sketch's push scales its largest cell to
// under 2^15): branch-free, 8 at a time with SSE2. REQUIRES: finite x, |x[j] * 2^e| < 65504.
void ScaledFloatsToHalves(const float* x, size_t n, int e, uint16_t* out);

// out[j] = HalfToFloat(h[j]) * 2^e rounded once to a float, for j < n. Returns false (out then
// unspecified) when an h[j] is Inf or NaN.
bool ScaledHalvesToFloats(const uint16_t* h, size_t n, int e, float* out);

// Appends the LEB128 varints of gap_j = idx[j] - idx[j-1] - 1 (idx[-1] = -1) to *out.
// REQUIRES: idx strictly increasing.
void EncodeVarintGaps(const uint32_t* idx, size_t k, std::vector<uint8_t>* out);

// Decodes exactly k positions from data[0, bytes) into idx_out, each below `limit`. Returns
// nullptr on success or a static message: the stream ends early, a varint longer than 5 bytes,
// a position >= limit, or bytes left over.
const char* DecodeVarintGaps(const uint8_t* data, size_t bytes, size_t k, uint64_t limit,
                             uint32_t* idx_out);

}  // namespace sparseps::kernels
