// SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA
// 2014): a small seeded generator whose sequence is the same on every machine, for what workers
// must agree on without talking (hash coefficients, a first matrix).
//
// Thread-safety: reentrant (the state is the caller's).
#pragma once

#include <cstdint>

namespace sparseps::kernels {

// The next 64-bit value of the sequence whose state is *state (advanced).
inline uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace sparseps::kernels
