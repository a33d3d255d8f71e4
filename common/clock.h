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

// How late a loop that heartbeats every `heartbeat_interval_s` must come round for its process to
// have been stopped (SIGSTOP, Ctrl-Z) rather than delayed by a busy machine: an interval plus the
// larger of an interval and 1 s. A node's heartbeat thread and the scheduler's loop judge by it.
inline double StopGapSeconds(double heartbeat_interval_s) {
  return heartbeat_interval_s + (heartbeat_interval_s > 1.0 ? heartbeat_interval_s : 1.0);
}

// A duration for a message: "8 s", "0.25 s", "1.23e+03 s" (three significant digits).
inline std::string FormatSeconds(double s) {
  std::ostringstream os;
  os.precision(3);
  os << s << " s";
  return os.str();
}

}  // namespace sparseps
