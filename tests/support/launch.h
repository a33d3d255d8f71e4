// Test support: the command line of deploy/launch.sh, the launcher users start jobs with, for
// this build (testing::BinaryDir()). Needs SPARSEPS_SOURCE_DIR (the test target's definition).
#pragma once

#include <string>
#include <vector>

#include "tests/support/process.h"

namespace sparseps::testing {

// argv of `bash deploy/launch.sh --build-dir <BinaryDir()> [--run-dir RUN_DIR] ARGS...` (no
// --run-dir when run_dir is empty, as with --resume, which names the run directory itself).
inline std::vector<std::string> LaunchCommand(const std::string& run_dir,
                                              const std::vector<std::string>& args) {
  std::vector<std::string> a = {"/bin/bash", std::string(SPARSEPS_SOURCE_DIR) + "/deploy/launch.sh",
                                "--build-dir", BinaryDir()};
  if (!run_dir.empty()) {
    a.push_back("--run-dir");
    a.push_back(run_dir);
  }
  a.insert(a.end(), args.begin(), args.end());
  return a;
}

}  // namespace sparseps::testing
