#include "common/log_limit.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>

namespace sparseps {

std::string PrintablePeer(const std::string& routing_id) { return Printable(routing_id, 64); }

std::string Printable(const std::string& text, size_t max_chars) {
  std::string out;
  for (unsigned char c : text) {
    if (out.size() >= max_chars) {
      out += "...";
      break;
    }
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char hex[5];
      std::snprintf(hex, sizeof(hex), "\\x%02x", c);
      out += hex;
    }
  }
  return out;
}

bool RateLimitedLog::Warn(const std::string& peer, const std::string& what,
                          const std::string& prefix) {
  const auto now = Clock::now();
  auto it = peers_.find(peer);
  if (it != peers_.end() &&
      std::chrono::duration<double>(now - it->second.last).count() < interval_s_) {
    ++it->second.held;
    ++suppressed_;
    return false;
  }
  if (it == peers_.end()) {
    if (peers_.size() >= kMaxPeers) {
      peers_.erase(std::min_element(peers_.begin(), peers_.end(), [](const auto& a, const auto& b) {
        return a.second.last < b.second.last;
      }));
    }
    it = peers_.emplace(peer, Entry{}).first;
  }
  if (it->second.held > 0) {
    spdlog::warn("{}from {}: {} ({} more like it in the last {:.0f} s)", prefix,
                 PrintablePeer(peer), Printable(what, 4096), it->second.held, interval_s_);
  } else {
    spdlog::warn("{}from {}: {}", prefix, PrintablePeer(peer), Printable(what, 4096));
  }
  it->second.last = now;
  it->second.held = 0;
  return true;
}

}  // namespace sparseps
