// Rate-limited warnings: a flood of bad messages from one peer must not flood the log (or the
// disk) as well.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "common/clock.h"

namespace sparseps {

// A peer's routing id as it may be logged: printable ASCII kept, other bytes as \xNN, at most 64
// characters then "...". Routing ids come off the wire and may hold anything.
std::string PrintablePeer(const std::string& routing_id);
// The same for any text that came off the wire, cut at max_chars.
std::string Printable(const std::string& text, size_t max_chars);

// Logs at most one warning line per peer per interval; the next line that gets through says how
// many were held back meanwhile. Keeps at most kMaxPeers peers (the oldest are forgotten first,
// which only means their next line is logged at once).
//
// Thread-safety: one thread (each daemon loop has its own).
class RateLimitedLog {
 public:
  static constexpr size_t kMaxPeers = 4096;
  explicit RateLimitedLog(double interval_s) : interval_s_(interval_s) {}

  // Logs "<prefix>from <peer>: <what>" (with the count held back) unless `peer` had a line within
  // the interval; returns whether it did.
  bool Warn(const std::string& peer, const std::string& what, const std::string& prefix = "");

  // Lines held back so far, over all peers.
  uint64_t suppressed() const { return suppressed_; }

 private:
  struct Entry {
    Clock::time_point last;
    uint64_t held = 0;
  };
  const double interval_s_;
  std::map<std::string, Entry> peers_;
  uint64_t suppressed_ = 0;
};

}  // namespace sparseps
