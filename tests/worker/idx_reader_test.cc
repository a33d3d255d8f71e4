// The IDX reader on the real Fashion-MNIST files and on broken files.
#include "worker/idx_reader.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace sparseps {
namespace {

const char* kDir = "/usr/share/datasets/fashion-mnist";

TEST(IdxReader, ReadsFashionMnist) {
  if (!std::filesystem::exists(std::string(kDir) + "/t10k-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "Fashion-MNIST not installed (deploy/install-deps.sh installs it)";
  }
  auto test = LoadIdxSplit(kDir, "t10k", 0);
  ASSERT_TRUE(test.ok()) << test.status().ToString();
  EXPECT_EQ(test->num_samples, 10000u);
  EXPECT_EQ(test->num_features, 784u);
  ASSERT_EQ(test->images.size(), 10000u * 784);
  std::vector<int> counts(10, 0);
  for (uint8_t l : test->labels) {
    ASSERT_LT(l, 10);
    ++counts[l];
  }
  for (int c : counts) EXPECT_EQ(c, 1000);  // the test set is balanced
  double mean = 0;
  for (float v : test->images) mean += v;
  mean /= static_cast<double>(test->images.size());
  EXPECT_NEAR(mean, 0.0, 0.05);  // normalised with the dataset's mean and std

  auto few = LoadIdxSplit(kDir, "train", 123);
  ASSERT_TRUE(few.ok());
  EXPECT_EQ(few->num_samples, 123u);
  EXPECT_EQ(few->images.size(), 123u * 784);
}

class BrokenIdx : public ::testing::Test {
 protected:
  void WriteGz(const std::string& path, const std::string& bytes) {
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
  }
  static std::string Be32(uint32_t v) {
    return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
            static_cast<char>(v)};
  }
  std::string dir_ = ::testing::TempDir();
};

TEST_F(BrokenIdx, TruncatedImagesAreRejected) {
  const std::string images = dir_ + "broken-images.gz", labels = dir_ + "broken-labels.gz";
  WriteGz(images, Be32(0x803) + Be32(3) + Be32(2) + Be32(2) + std::string(7, '\x10'));  // 12 needed
  WriteGz(labels, Be32(0x801) + Be32(3) + std::string("\x01\x02\x03", 3));
  auto r = LoadIdx(images, labels, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(images), std::string::npos) << r.status().message();
  std::remove(images.c_str());
  std::remove(labels.c_str());
}

TEST_F(BrokenIdx, WrongMagicAndBadLabelsAreRejected) {
  const std::string images = dir_ + "magic-images.gz", labels = dir_ + "magic-labels.gz";
  WriteGz(images, Be32(0x999) + Be32(1) + Be32(1) + Be32(1) + "x");
  WriteGz(labels, Be32(0x801) + Be32(1) + "\x01");
  EXPECT_FALSE(LoadIdx(images, labels, 0).ok());
  WriteGz(images, Be32(0x803) + Be32(1) + Be32(1) + Be32(1) + "x");
  WriteGz(labels, Be32(0x801) + Be32(1) + "\x2a");  // label 42 >= 10 classes
  EXPECT_FALSE(LoadIdx(images, labels, 0).ok());
  WriteGz(labels, Be32(0x801) + Be32(2) + "\x01\x01");  // 2 labels for 1 image
  EXPECT_FALSE(LoadIdx(images, labels, 0).ok());
  WriteGz(labels, Be32(0x801) + Be32(1) + "\x01");
  EXPECT_TRUE(LoadIdx(images, labels, 0).ok());
  EXPECT_FALSE(LoadIdx(dir_ + "does-not-exist.gz", labels, 0).ok());
  std::remove(images.c_str());
  std::remove(labels.c_str());
}

}  // namespace
}  // namespace sparseps
