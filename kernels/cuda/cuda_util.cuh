// Helpers shared by the CUDA sources of kernels/cuda and worker/cuda (not a public API).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>

namespace sparseps::kernels::gpu {

// Threads per block and the largest grid of the grid-stride loops.
constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 4096;

// Blocks for a grid-stride loop over n elements with kThreads per block.
inline unsigned Blocks(size_t n) {
  return static_cast<unsigned>(std::clamp<size_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

// Makes *p hold at least `want` elements (reallocating, contents lost, when it holds fewer);
// *cap is its capacity in elements.
template <typename T>
cudaError_t Grow(T** p, size_t* cap, size_t want) {
  if (*cap >= want && *p != nullptr) return cudaSuccess;
  if (*p != nullptr) cudaFree(*p);
  *p = nullptr;
  *cap = 0;
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(p), std::max<size_t>(want, 1) * sizeof(T));
  if (e == cudaSuccess) *cap = want;
  return e;
}

}  // namespace sparseps::kernels::gpu

// Returns the cudaError_t of expr from the enclosing function when it is not cudaSuccess.
#define SPARSEPS_CUDA_TRY(expr)       \
  do {                                \
    const cudaError_t e_ = (expr);    \
    if (e_ != cudaSuccess) return e_; \
  } while (0)
