// Golomb-Rice coding of sorted positions (the gaps between kept indices), as SBC uses for its
// sparse positions (Sattler et al., arXiv 1805.08768, §III-C).
//
// Format: for each position, gap = idx[j] - idx[j-1] - 1 (idx[-1] = -1), written LSB-first as
// q = gap >> b one-bits, a zero bit, then the b low bits of gap. The stream is padded with zero
// bits to a whole byte. Thread-safety: reentrant.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sparseps::kernels {

// The optimal Rice parameter for positions kept independently with probability p (0 < p < 1):
// b* = 1 + floor(log2(ln(phi - 1) / ln(1 - p))), phi the golden ratio; clamped to [0, 30].
uint32_t GolombParameter(double p);

// Expected bits per position at density p with parameter b: b + 1 / (1 - (1 - p)^(2^b)).
double GolombExpectedBits(double p, uint32_t b);

// Appends the code of the k strictly increasing positions idx[0, k) to *out; returns the number
// of bits written (before padding). REQUIRES: b <= 30, idx strictly increasing.
uint64_t GolombEncode(const uint32_t* idx, size_t k, uint32_t b, std::vector<uint8_t>* out);

// Decodes exactly k positions from data[0, bytes) into idx_out[0, k). Every position must be
// below `limit`. Never reads outside data. Returns nullptr on success, or a static message naming
// the violated rule: b out of range, the stream ends early, a position >= limit, or bytes left
// over (more than the padding).
const char* GolombDecode(const uint8_t* data, size_t bytes, uint32_t b, size_t k, uint64_t limit,
                         uint32_t* idx_out);

}  // namespace sparseps::kernels
