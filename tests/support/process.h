// Test support: child processes (the real daemons) started, waited for with a deadline, and
// always stopped by pid when a test ends, plus temporary run directories.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sparseps::testing {

// A child process with stdout and stderr in a log file. The destructor kills it (SIGKILL) and
// reaps it if it is still running, so a failing test leaves nothing behind.
class ChildProcess {
 public:
  // Starts argv[0] (a path) with the arguments and extra environment entries ("K=V").
  // The test fails (ADD_FAILURE) when the program cannot be started. With `own_group` the child
  // leads a process group of its own, and every kill (the destructor's, Wait's at the deadline)
  // goes to the whole group: for a shell that starts processes in the background.
  ChildProcess(std::vector<std::string> argv, const std::string& log_path,
               const std::vector<std::string>& env = {}, bool own_group = false);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Waits up to timeout_s seconds for the process to exit. Returns its exit code, 128 + signal if
  // a signal ended it, or -1 after killing it when the deadline passed.
  int Wait(double timeout_s);
  // True while the process has not exited.
  bool Running();
  void Signal(int sig);
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  // The log file's content (for failure messages).
  std::string Log() const;

 private:
  // Sends sig to the child, or to its process group with own_group.
  void Kill(int sig);

  pid_t pid_ = -1;
  bool own_group_ = false;
  int status_ = -1;  // exit code once reaped
  std::string log_path_;
};

// A fresh directory under the test temp dir, removed with its content by the destructor.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix);
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Reads a whole file; empty when missing.
std::string ReadFile(const std::string& path);
// Waits up to timeout_s for path to exist with non-empty content and returns it (empty on timeout).
std::string WaitForFile(const std::string& path, double timeout_s);
// The rows of a CSV file written so far: whole lines after the header (0 when missing).
int64_t CsvRows(const std::string& path);
// Waits up to timeout_s until the CSV at path has at least `rows` rows; false on timeout.
bool WaitForCsvRows(const std::string& path, int64_t rows, double timeout_s);
// Column `name` of a CSV file (header row first) as doubles into *values. A missing file, a
// missing column or a row without that cell fails the test fatally: call it through
// ASSERT_NO_FATAL_FAILURE.
void CsvColumn(const std::string& path, const std::string& name, std::vector<double>* values);
// The build's folder, or $SPARSEPS_TEST_BINARY_DIR where set (a build unpacked on another
// machine, as bench/gpu_checks.sh runs it).
std::string BinaryDir();
// Path of a built daemon, e.g. BinaryPath("server/sparseps-server"): under BinaryDir().
std::string BinaryPath(const std::string& relative);
// Why no CUDA device can run a test here ("" when one answers), asked in a child process: a
// test that forks daemons or workers must not touch CUDA itself first.
std::string NoGpuInAChild();

}  // namespace sparseps::testing
