#include "kernels/error_feedback.h"

#include <cmath>

namespace sparseps::kernels {

void MomentumCorrection(float* u, float* v, const float* g, float m, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float ui = m * u[i] + g[i];
    u[i] = ui;
    v[i] += ui;
  }
}

void GatherAndZero(float* v, float* u, const uint32_t* idx, size_t k, float* out) {
  for (size_t j = 0; j < k; ++j) {
    out[j] = v[idx[j]];
    v[idx[j]] = 0.0f;
  }
  if (u != nullptr) {
    for (size_t j = 0; j < k; ++j) u[idx[j]] = 0.0f;
  }
}

void ScatterAdd(float* dst, const uint32_t* idx, const float* vals, size_t k) {
  for (size_t j = 0; j < k; ++j) dst[idx[j]] += vals[j];
}

void Axpy(float a, const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void Scale(float a, float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] *= a;
}

bool AllFinite(const float* x, size_t n) {
  // Accumulate x*0: finite values give 0, NaN or Inf give NaN. Branch-free and vectorisable.
  float acc = 0.0f;
  for (size_t i = 0; i < n; ++i) acc += x[i] * 0.0f;
  return acc == 0.0f;
}

}  // namespace sparseps::kernels
