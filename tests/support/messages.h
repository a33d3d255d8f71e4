// Message helpers shared by the tests (header-only).
#pragma once

#include "transport/message.h"

namespace sparseps::testing {

// Copies a message frame by frame, as if it had crossed the wire. A decoded payload views the
// copy's frames: keep the copy alive while using it.
inline Message CopyOf(const Message& m) {
  Message c;
  c.header = m.header;
  for (const auto& f : m.frames) c.frames.emplace_back(f.data(), f.size());
  return c;
}

}  // namespace sparseps::testing
