// For tests of config loading: a fixture that writes a YAML file per test (removed after it) and
// reads no environment, and the split of "a=b,c=d" into two overrides.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace sparseps {

class ConfigFileTest : public ::testing::Test {
 protected:
  // Writes `text` to a file named after the test and returns its path.
  std::string Write(const std::string& text) {
    path_ = ::testing::TempDir() + "sparseps_config_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".yaml";
    std::ofstream(path_) << text;
    return path_;
  }
  void TearDown() override {
    if (!path_.empty()) std::remove(path_.c_str());
  }
  // An environment with no variables set (LoadConfig's EnvLookup).
  static const char* NoEnv(const char*) { return nullptr; }
  std::string path_;
};

// "a=b,c=d" as the overrides {"a=b", "c=d"}.
inline std::vector<std::string> SplitOverrides(const std::string& list) {
  std::vector<std::string> overrides;
  std::stringstream in(list);
  for (std::string kv; std::getline(in, kv, ',');) overrides.push_back(kv);
  return overrides;
}

}  // namespace sparseps
