// The clock every deadline and duration of ours is measured with.
#pragma once

#include <chrono>

namespace sparseps {

// Monotonic: deadlines and durations do not jump with the wall clock.
using Clock = std::chrono::steady_clock;

// Seconds since `start`.
inline double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace sparseps
