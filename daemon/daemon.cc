#include "daemon/daemon.h"

#include <google/protobuf/stubs/logging.h>
#include <malloc.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/command_line.h"
#include "common/sanitizers.h"
#include "config/config.h"
#include "observability/metrics.h"
#include "transport/van.h"

namespace sparseps {

namespace {

// Passes on the lines below `below` only: with a stderr sink at `below` and up, the info lines go
// to stdout and the warnings and errors to stderr, so that `2>/dev/null` hides the problems and
// `>/dev/null` leaves only them.
class BelowLevelSink final : public spdlog::sinks::sink {
 public:
  BelowLevelSink(std::shared_ptr<spdlog::sinks::sink> target, spdlog::level::level_enum below)
      : target_(std::move(target)), below_(below) {}
  void log(const spdlog::details::log_msg& msg) override {
    if (msg.level < below_) target_->log(msg);
  }
  void flush() override { target_->flush(); }
  void set_pattern(const std::string& pattern) override { target_->set_pattern(pattern); }
  void set_formatter(std::unique_ptr<spdlog::formatter> formatter) override {
    target_->set_formatter(std::move(formatter));
  }

 private:
  std::shared_ptr<spdlog::sinks::sink> target_;
  spdlog::level::level_enum below_;
};

// --resume DIR: the overrides that resume from DIR (a run directory or a checkpoint folder), put
// before the --set overrides, which win. False (logged) when DIR cannot be read.
bool AddResumeOverrides(const std::string& resume_dir, std::vector<std::string>* overrides) {
  bool holds_checkpoints = false;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(resume_dir, ec)) {
    if (e.path().filename().string().rfind("iter-", 0) == 0) holds_checkpoints = true;
  }
  if (ec) {
    spdlog::error("--resume {}: {}", resume_dir, ec.message());
    return false;
  }
  overrides->insert(overrides->begin(),
                    {"checkpoint.resume=true",
                     (holds_checkpoints ? "checkpoint.dir=" : "run.dir=") + resume_dir});
  return true;
}

// --get KEY ...: each key's resolved value on a line of its own; the exit code (2: an unknown
// key).
int PrintKeys(const proto::JobConfig& config, const std::vector<std::string>& keys) {
  const auto lines = DescribeConfig(config);
  for (const auto& key : keys) {
    bool found = false;
    for (const auto& line : lines) {
      if (line.rfind(key + " = ", 0) == 0) {
        std::string value = line.substr(key.size() + 3);
        if (value.size() >= 2 && value.front() == '"') value = value.substr(1, value.size() - 2);
        std::printf("%s\n", value.c_str());
        found = true;
      }
    }
    if (!found) {
      spdlog::error("--get {}: unknown key", key);
      return 2;
    }
  }
  return 0;
}

// protobuf logs each header it cannot parse (e.g. a string field with invalid UTF-8) to stderr
// itself; the receiver already rejects and counts such a message with a rate-limited line, so
// that a flood of them cannot flood the log as well. protobuf's fatal errors still show.
void QuietProtobufLog() {
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel level, const char* file, int line, const std::string& msg) {
        if (level >= google::protobuf::LOGLEVEL_FATAL) {
          spdlog::critical("protobuf {}:{}: {}", file, line, msg);
        } else {
          spdlog::debug("protobuf {}:{}: {}", file, line, msg);
        }
      });
}

}  // namespace

void SetLogName(const std::string& name) {
  auto err = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  err->set_level(spdlog::level::warn);
  auto out = std::make_shared<BelowLevelSink>(std::make_shared<spdlog::sinks::stdout_sink_mt>(),
                                              spdlog::level::warn);
  auto logger = std::make_shared<spdlog::logger>(name, spdlog::sinks_init_list{out, err});
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%l] %v");
  logger->set_level(spdlog::default_logger()->level());
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

void KeepFreedMessageBuffers() {
#if SPARSEPS_ADDRESS_SANITIZER
  return;  // AddressSanitizer's allocator replaces glibc's and ignores mallopt.
#else
  // Respect a user's own tuning (glibc reads these at the first allocation).
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
    return;
  }
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMessageMmapThreshold)) != 1 ||
      mallopt(M_TRIM_THRESHOLD, static_cast<int>(kMessageTrimThreshold)) != 1) {
    spdlog::warn("mallopt refused the message-buffer thresholds; running with glibc's defaults");
  }
#endif
}

int ExitCodeFor(const Status& status) {
  if (status.ok()) return 0;
  if (status.code() == StatusCode::kInvalidArgument) return 2;
  return status.code() == StatusCode::kDisconnected ? 3 : 1;
}

int DaemonMain(int argc, char** argv, const std::string& name, const std::string& description,
               const std::function<Status(const proto::JobConfig&)>& body) {
  CommandLine cli(description, name);
  const RankEnv rank_env =
      name == "sparseps-worker" ? RankEnv::kSparsepsRankOrRank : RankEnv::kSparsepsRank;
  std::string footer = "\nEnvironment:";
  for (const auto& line : EnvironmentHelp(rank_env)) footer += "\n  " + line;
  footer +=
      "\n\nExit codes:\n"
      "  0  the job finished\n"
      "  1  this process or the job failed\n"
      "  2  a bad config or argument (the message names the file, line and key)\n"
      "  3  out of the job: cut off from the scheduler, or removed by it after being silent for\n"
      "     cluster.heartbeat_timeout_s (a stopped process); the job may go on without it, and\n"
      "     deploy/launch.sh lets it go (or starts a replacement under --max-restarts)";
  cli.Footer(footer);
  cli.Version(name + " " + SPARSEPS_VERSION);
  std::string config_path;
  std::vector<std::string> overrides;
  cli.Option("-c,--config", &config_path, "YAML job config (schema: proto/config.proto)",
             CommandLine::kExistingFile);
  std::vector<std::string> gets;
  cli.Option("--set", &overrides, "Override one config key, e.g. --set train.lr=0.05");
  cli.Option("--get", &gets,
             "Print the resolved value of a config key (e.g. cluster.num_workers), one line "
             "per key, and exit without starting; for scripts");
  std::string resume_dir;
  cli.Option("--resume", &resume_dir,
             "Resume the job from the newest complete checkpoint in DIR: a run directory (its "
             "checkpoints/ folder, unless checkpoint.dir is set; the run writes on into it) or "
             "a checkpoint folder (the iter-* folders); every daemon of the job gets it");
  bool rejoin = false;
  cli.Flag("--rejoin", &rejoin,
           "Join the running job as the replacement of a lost worker (node.rank, or the lowest "
           "lost rank): it gets the current parameters and pushes from the next iteration on");
  if (const int rc = cli.Parse(argc, argv); rc >= 0) return rc;
  if (!resume_dir.empty() && !AddResumeOverrides(resume_dir, &overrides)) return 2;
  if (rejoin) overrides.insert(overrides.begin(), "node.rejoin=true");
  SetLogName(name);
  ConfigSources sources;
  auto config = LoadConfig(config_path, overrides, nullptr, &sources, rank_env);
  if (!config.ok()) {
    spdlog::error("bad configuration: {}", config.status().message());
    return 2;
  }
  if (!gets.empty()) return PrintKeys(*config, gets);
  spdlog::default_logger()->set_level(spdlog::level::from_str(config->run().log_level()));
  spdlog::info("{} starting (pid {}), config {}", name, getpid(),
               config_path.empty() ? "(defaults)" : config_path);
  for (const auto& line : DescribeConfig(*config)) spdlog::info("  {}", line);

  // Each host's processes write into run.dir on that host: make it there, whoever starts first.
  if (const std::string& dir = config->run().dir(); !dir.empty()) {
    if (Status d = EnsureDirectory(dir); !d.ok()) {
      spdlog::error("{} failed: run.dir: {}", name, d.message());
      return ExitCodeFor(Status::InvalidArgument(d.message()));
    }
  }
  InstallStopHandlers();
  QuietProtobufLog();
  // Before the body starts any thread (ZeroMQ's, OpenBLAS's); after --get, whose output scripts
  // read, so that a warning never lands in it.
  KeepFreedMessageBuffers();
  Status s;
  try {
    s = body(*config);
  } catch (const std::exception& e) {
    s = Status::Internal(std::string("uncaught exception: ") + e.what());
  }
  if (!s.ok()) {
    spdlog::error("{} failed: {}", name, s.ToString());
  } else {
    spdlog::info("{} finished", name);
  }
  spdlog::default_logger()->flush();
  return ExitCodeFor(s);
}

}  // namespace sparseps
