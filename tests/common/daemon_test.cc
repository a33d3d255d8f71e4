#include "daemon/daemon.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdlib>
#include <cstring>

#include "common/sanitizers.h"

namespace sparseps {
namespace {

// A message-sized block comes from the heap, not an mmap of its own, and stays with the process
// when freed (glibc's defaults: its own mmap above 128 KiB, returned to the kernel on free).
TEST(KeepFreedMessageBuffers, MessageSizedBlocksStayOnTheHeap) {
#if SPARSEPS_ADDRESS_SANITIZER
  GTEST_SKIP() << "AddressSanitizer replaces glibc's malloc";
#else
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
    GTEST_SKIP() << "the environment sets glibc's thresholds";
  }
  KeepFreedMessageBuffers();
  constexpr size_t kBytes = size_t{24} << 20;  // a 6M-float segment: below kMessageMmapThreshold
  const struct mallinfo2 before = mallinfo2();
  auto* p = static_cast<char*>(std::malloc(kBytes));
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, kBytes);
  const struct mallinfo2 during = mallinfo2();
  EXPECT_EQ(during.hblks, before.hblks) << "the block got an mmap of its own";
  EXPECT_EQ(during.hblkhd, before.hblkhd) << "the block got an mmap of its own";
  // In use on the heap (whatever free heap it may have reused).
  EXPECT_GE(during.uordblks, before.uordblks + kBytes) << "the block is not on the heap";
  std::free(p);
  const struct mallinfo2 after = mallinfo2();
  EXPECT_EQ(after.arena, during.arena) << "the freed block went back to the kernel";
  EXPECT_GE(after.fordblks, kBytes);
#endif
}

}  // namespace
}  // namespace sparseps
