#include "tests/support/process.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "kernels/device.h"

extern char** environ;

namespace sparseps::testing {

ChildProcess::ChildProcess(std::vector<std::string> argv, const std::string& log_path,
                           const std::vector<std::string>& env, bool own_group)
    : own_group_(own_group), log_path_(log_path) {
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  for (const auto& e : env) env_strings.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  posix_spawn_file_actions_addclose(&actions, STDIN_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  if (own_group) {
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
  }
  int rc = posix_spawn(&pid_, args[0], &actions, &attr, args.data(), envp.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    pid_ = -1;
    ADD_FAILURE() << "could not start " << argv[0] << ": " << std::strerror(rc);
  }
}

void ChildProcess::Kill(int sig) {
  if (pid_ > 0) ::kill(own_group_ ? -pid_ : pid_, sig);
}

ChildProcess::~ChildProcess() {
  if (Running()) {
    Kill(SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
  } else if (own_group_) {
    Kill(SIGKILL);  // what the shell left running in the background
  }
}

bool ChildProcess::Running() {
  if (pid_ <= 0 || status_ >= 0) return false;
  int st = 0;
  pid_t r = ::waitpid(pid_, &st, WNOHANG);
  if (r == 0) return true;
  if (r == pid_) status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  if (r < 0) status_ = 255;
  return false;
}

int ChildProcess::Wait(double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (Running()) {
    if (std::chrono::steady_clock::now() > deadline) {
      Kill(SIGKILL);
      int st = 0;
      ::waitpid(pid_, &st, 0);
      status_ = 255;
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return status_;
}

void ChildProcess::Signal(int sig) {
  if (Running()) ::kill(pid_, sig);
}

std::string ChildProcess::Log() const { return ReadFile(log_path_); }

TempDir::TempDir(const std::string& prefix) {
  std::string tmpl = ::testing::TempDir() + prefix + "-XXXXXX";
  char* made = ::mkdtemp(tmpl.data());
  if (made == nullptr) {
    ADD_FAILURE() << "mkdtemp " << tmpl << ": " << std::strerror(errno);
  }
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  if (std::getenv("SPARSEPS_KEEP_TEST_DIRS") == nullptr) std::filesystem::remove_all(path_, ec);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string WaitForFile(const std::string& path, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    std::string s = ReadFile(path);
    if (!s.empty()) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "";
}

int64_t CsvRows(const std::string& path) {
  const std::string text = ReadFile(path);
  const int64_t lines = std::count(text.begin(), text.end(), '\n');
  return lines > 0 ? lines - 1 : 0;
}

bool WaitForCsvRows(const std::string& path, int64_t rows, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (CsvRows(path) < rows) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    // Often enough to kill a process within a few steps of `rows`; the whole file is read each
    // time, so not so often that the reads compete with the job for CI's two cores.
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

std::string BinaryDir() {
  const char* moved = std::getenv("SPARSEPS_TEST_BINARY_DIR");  // a build unpacked elsewhere
  return moved != nullptr && *moved != '\0' ? moved : SPARSEPS_BINARY_DIR;
}

std::string BinaryPath(const std::string& relative) { return BinaryDir() + "/" + relative; }

void CsvColumn(const std::string& path, const std::string& name, std::vector<double>* values) {
  std::ifstream in(path);
  ASSERT_TRUE(in) << path << " is missing";
  std::string line;
  ASSERT_TRUE(std::getline(in, line)) << path << " is empty";
  std::vector<std::string> header;
  std::stringstream hs(line);
  for (std::string cell; std::getline(hs, cell, ',');) header.push_back(cell);
  const auto it = std::find(header.begin(), header.end(), name);
  ASSERT_NE(it, header.end()) << path << " has no column '" << name << "'; header: " << line;
  const size_t col = static_cast<size_t>(it - header.begin());
  values->clear();
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream ls(line);
    for (std::string cell; std::getline(ls, cell, ',');) cells.push_back(cell);
    ASSERT_GT(cells.size(), col) << path << ": a row without column '" << name << "': " << line;
    values->push_back(std::stod(cells[col]));
  }
}

std::string NoGpuInAChild() {
  const pid_t pid = fork();
  if (pid == 0) {
    std::string why;
    _exit(kernels::CudaDeviceAvailable(&why) ? 0 : 1);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return "fork failed";
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "" : "no CUDA device answers";
}

}  // namespace sparseps::testing
