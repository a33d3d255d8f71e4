// Top-k selection by magnitude over a flat fp32 vector.
//
// Thread-safety: the functions are reentrant; callers own all buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

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

// DGC's momentum correction followed by the top-k of the result, in one streaming pass instead of
// two: u = m u + g; v += u over [0, n) (as kernels::MomentumCorrection, the same float operations),
// then the indices of the k largest |v[i]| into idx_out, exactly as TopKAbs(v, n, k, idx_out)
// returns them. Returns min(k, n). (Lin et al., Deep Gradient Compression, ICLR 2018, Sec. 3.2:
// the residual v accumulates the corrected velocity u before each selection.)
//
// Method (n >= 65536 and k <= n/16): TopKAbs's sample is taken of the updated values computed
// ahead at the sampled positions; the update pass then also collects the candidates at or above
// the sample's bound (SSE2 where available), so v is read once, not twice. Otherwise, and when the
// sample misleads, the update runs first and TopKAbs's fallback after it.
// REQUIRES: n < 2^32; u, v, g do not overlap; idx_out has room for min(k, n) elements.
size_t MomentumCorrectionTopK(float* u, float* v, const float* g, float m, size_t n, size_t k,
                              uint32_t* idx_out);

// The same result by radix select on the IEEE-754 bit pattern of |x| (monotone in the magnitude for
// non-NaN values): one histogram pass over the top 11 bits, one pass collecting the candidates
// of the bucket that holds the k-th largest, an exact select among those, and one output pass.
// NaN compares above +Inf (its bit pattern is larger); callers reject non-finite gradients.
//
// REQUIRES: n < 2^32; idx_out has room for min(k, n) elements.
size_t TopKAbsRadix(const float* x, size_t n, size_t k, uint32_t* idx_out);

// Top-k of each sign (SBC's selection, Sattler et al., arXiv 1805.08768, Algorithm 1): writes to
// *pos the indices of the k largest positive entries of x[0, n) and to *neg those of the k most
// negative, each strictly increasing; a sign with at most k entries gives all of them; zeros
// belong to neither. Ties at the k-th magnitude go to lower indices, as in TopKAbs, so each side
// is TopKAbs of x with the other sign zeroed, minus the zeros it would pad with. When given,
// *pos_values and *neg_values receive x at those indices (mostly from the candidates, without a
// gather).
//
// Method (n >= 65536 and k <= n/16): one strided sample gives each sign's lower bound (as in
// TopKAbs), one streaming pass collects both sides' candidates, and an exact select among each
// finishes: about one read of x for both signs. A side whose sample misleads, and small n or large
// k, use a radix select of that sign instead; the result is the same.
// REQUIRES: n < 2^32; x finite.
void TopKBySign(const float* x, size_t n, size_t k, std::vector<uint32_t>* pos,
                std::vector<uint32_t>* neg, std::vector<float>* pos_values = nullptr,
                std::vector<float>* neg_values = nullptr);

// SBC's push step followed by the top-k of each sign of the new residual, in one streaming pass
// instead of two (Sattler et al., arXiv 1805.08768, Algorithm 1: the local SGD step with momentum,
// then A = a + R and its top-k per sign). Over [0, n): u = m u + g; params -= lr u (unless params
// is null: the caller replaces them after the push); A = a + u and a = 0 (or A = u when a is
// null, one local iteration); r += A. Then, when every A[i] is finite,
// *pos, *neg (and the values, when given) are TopKBySign(r, n, k, ...) exactly, and it returns
// true; otherwise it returns false with them empty (r has been updated; the caller refuses the
// push).
//
// Method (n >= 65536 and k <= n/16): TopKBySign's sample is taken of the new r computed ahead at
// the sampled positions (the same float operations, no FMA), and the step's pass also collects
// each sign's candidates (SSE2 where available); the finish is TopKBySign's. Otherwise the step
// runs first and TopKBySign's radix select after it.
// REQUIRES: n < 2^32; u, params, a, r, g do not overlap; r finite before the step.
bool SbcPushStepTopKBySign(float* u, float* params, float* a, float* r, const float* g, float m,
                           float lr, size_t n, size_t k, std::vector<uint32_t>* pos,
                           std::vector<uint32_t>* neg, std::vector<float>* pos_values = nullptr,
                           std::vector<float>* neg_values = nullptr);

}  // namespace sparseps::kernels
