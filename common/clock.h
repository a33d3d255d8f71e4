// The clock every deadline and duration of ours is measured with.
#pragma once

#include <chrono>
#include <sstream>
#include <string>

namespace sparseps {

// Monotonic: deadlines and durations do not jump with the wall clock.
using Clock = std::chrono::steady_clock;

// Seconds from `from` to `to` (negative when `to` is earlier).
inline double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// Seconds since `start`.
inline double SecondsSince(Clock::time_point start) { return SecondsBetween(start, Clock::now()); }

// A duration for a message: "8 s", "0.25 s", "1.23e+03 s" (three significant digits).
inline std::string FormatSeconds(double s) {
  std::ostringstream os;
  os.precision(3);
  os << s << " s";
  return os.str();
}

}  // namespace sparseps
