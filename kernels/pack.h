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

// Appends the LEB128 varints of gap_j = idx[j] - idx[j-1] - 1 (idx[-1] = -1) to *out.
// REQUIRES: idx strictly increasing.
void EncodeVarintGaps(const uint32_t* idx, size_t k, std::vector<uint8_t>* out);

// Decodes exactly k positions from data[0, bytes) into idx_out, each below `limit`. Returns
// nullptr on success or a static message: the stream ends early, a varint longer than 5 bytes,
// a position >= limit, or bytes left over.
const char* DecodeVarintGaps(const uint8_t* data, size_t bytes, size_t k, uint64_t limit,
                             uint32_t* idx_out);

}  // namespace sparseps::kernels
