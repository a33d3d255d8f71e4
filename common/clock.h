// The clock every deadline and duration of ours is measured with.
#pragma once

#include <chrono>

namespace sparseps {

// Monotonic: deadlines and durations do not jump with the wall clock.
using Clock = std::chrono::steady_clock;

// Seconds from `from` to `to` (negative when `to` is earlier).
inline double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// Seconds since `start`.
inline double SecondsSince(Clock::time_point start) { return SecondsBetween(start, Clock::now()); }

}  // namespace sparseps
