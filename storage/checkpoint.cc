#include "storage/checkpoint.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "transport/control_client.h"
#include "transport/message.h"

namespace sparseps {
namespace {

constexpr const char* kFormat = "sparseps-checkpoint";
constexpr const char* kManifest = "MANIFEST.json";

std::string RoleText(proto::Role role) { return RoleName(role); }

Result<proto::Role> ParseRole(const std::string& s) {
  for (proto::Role r : {proto::SCHEDULER, proto::SERVER, proto::WORKER}) {
    if (RoleName(r) == s) return r;
  }
  return Status::InvalidArgument("unknown role '" + s + "'");
}

}  // namespace

// ---- StateArchive ----

std::string StateArchive::Full(std::string_view name) const { return prefix_ + std::string(name); }

void StateArchive::Fail(const std::string& why) {
  if (status_.ok()) status_ = Status::FailedPrecondition(why);
}

template <typename T>
void StateArchive::ArrayImpl(std::string_view name, DType dtype, std::vector<T>* v) {
  const std::string key = Full(name);
  if (saving()) {
    writer_->Add(key, dtype, {v->size()}, v->data(), v->size() * sizeof(T));
    return;
  }
  const SafetensorsFile::Tensor* t = file_->Find(key);
  if (t == nullptr) return Fail(file_->path() + " lacks the array '" + key + "'");
  if (t->dtype != dtype) {
    return Fail(file_->path() + ": array '" + key + "' is " + DTypeName(t->dtype) + ", not " +
                DTypeName(dtype));
  }
  const size_t n = t->size / sizeof(T);
  if (!v->empty() && n != v->size()) {
    return Fail(file_->path() + ": array '" + key + "' has " + std::to_string(n) +
                " elements; this job's has " + std::to_string(v->size()) +
                " (another model or cluster?)");
  }
  v->resize(n);
  const auto data = file_->Data(*t);
  if (n > 0) std::memcpy(v->data(), data.data(), n * sizeof(T));
}

template <typename T>
void StateArchive::ScalarImpl(std::string_view name, DType dtype, T* v) {
  const std::string key = Full(name);
  if (saving()) {
    writer_->Add(key, dtype, {}, v, sizeof(T));
    return;
  }
  const SafetensorsFile::Tensor* t = file_->Find(key);
  if (t == nullptr) return Fail(file_->path() + " lacks the value '" + key + "'");
  if (t->dtype != dtype || t->size != sizeof(T)) {
    return Fail(file_->path() + ": value '" + key + "' is not a " + DTypeName(dtype) + " scalar");
  }
  std::memcpy(v, file_->Data(*t).data(), sizeof(T));
}

void StateArchive::Array(std::string_view name, std::vector<float>* v) {
  ArrayImpl(name, DType::kF32, v);
}
bool StateArchive::Has(std::string_view name) const {
  return !saving() && file_->Find(Full(name)) != nullptr;
}

void StateArchive::Array(std::string_view name, std::vector<uint8_t>* v) {
  ArrayImpl(name, DType::kU8, v);
}
void StateArchive::Array(std::string_view name, std::vector<uint32_t>* v) {
  ArrayImpl(name, DType::kU32, v);
}
void StateArchive::Array(std::string_view name, std::vector<uint64_t>* v) {
  ArrayImpl(name, DType::kU64, v);
}
void StateArchive::Value(std::string_view name, uint64_t* v) { ScalarImpl(name, DType::kU64, v); }
void StateArchive::Value(std::string_view name, int64_t* v) { ScalarImpl(name, DType::kI64, v); }
void StateArchive::Value(std::string_view name, double* v) { ScalarImpl(name, DType::kF64, v); }
void StateArchive::Value(std::string_view name, float* v) { ScalarImpl(name, DType::kF32, v); }
void StateArchive::Value(std::string_view name, uint32_t* v) { ScalarImpl(name, DType::kU32, v); }
void StateArchive::Size(std::string_view name, size_t* v) {
  uint64_t x = *v;
  ScalarImpl(name, DType::kU64, &x);
  *v = static_cast<size_t>(x);
}

StateArchive::ScopeGuard::ScopeGuard(StateArchive* a, std::string_view scope)
    : a_(a), old_size_(a->prefix_.size()) {
  a_->prefix_ += std::string(scope) + ".";
}
StateArchive::ScopeGuard::~ScopeGuard() { a_->prefix_.resize(old_size_); }

proto::CheckpointFile ToProto(const CheckpointFileInfo& info, uint64_t iteration) {
  proto::CheckpointFile f;
  f.set_role(info.role);
  f.set_rank(info.rank);
  f.set_iteration(iteration);
  f.set_file(info.file);
  f.set_bytes(info.bytes);
  f.set_xxh3(info.xxh3);
  return f;
}

CheckpointFileInfo FromProto(const proto::CheckpointFile& f) {
  return {f.role(), f.rank(), f.file(), f.bytes(), f.xxh3()};
}

// ---- names, fingerprints, checksums ----

std::string CheckpointIterationDir(const std::string& dir, uint64_t iteration) {
  char name[32];
  std::snprintf(name, sizeof(name), "iter-%010" PRIu64, iteration);
  return dir + "/" + name;
}

std::string CheckpointDir(const proto::JobConfig& config) {
  if (!config.checkpoint().dir().empty()) return config.checkpoint().dir();
  if (!config.run().dir().empty()) return config.run().dir() + "/checkpoints";
  return "";
}

std::string CheckpointFileName(proto::Role role, int rank) {
  return RoleText(role) + "-" + std::to_string(rank) + ".safetensors";
}

std::string ConfigFingerprint(const proto::JobConfig& config) {
  proto::JobConfig c;
  *c.mutable_model() = config.model();
  *c.mutable_data() = config.data();
  *c.mutable_train() = config.train();
  c.mutable_train()->clear_epochs();
  c.mutable_train()->clear_max_steps();
  c.mutable_train()->clear_eval_every_epochs();
  c.mutable_train()->clear_eval_every_steps();
  c.mutable_train()->clear_device();
  c.mutable_train()->clear_cuda_device();
  *c.mutable_compression() = config.compression();
  c.mutable_compression()->mutable_sketch()->clear_server_threads();  // the same result for any
  c.set_aggregation(config.aggregation());
  *c.mutable_collective() = config.collective();
  c.mutable_collective()->clear_port();
  c.mutable_cluster()->set_num_servers(config.cluster().num_servers());
  c.mutable_cluster()->set_num_workers(config.cluster().num_workers());
  std::string bytes;
  google::protobuf::io::StringOutputStream stream(&bytes);
  {
    google::protobuf::io::CodedOutputStream out(&stream);
    out.SetSerializationDeterministic(true);
    c.SerializeToCodedStream(&out);
  }
  return Xxh3Hex(bytes.data(), bytes.size());
}

// ---- node files ----

Status WriteCheckpointFile(const std::string& dir, const std::string& file,
                           const CheckpointIdentity& id, StateArchive& archive,
                           CheckpointFileInfo* info) {
  return WriteCheckpointFile(dir, file, id, archive.writer(), info);
}

Status WriteCheckpointFile(const std::string& dir, const std::string& file,
                           const CheckpointIdentity& id, SafetensorsWriter& w,
                           CheckpointFileInfo* info) {
  w.SetMetadata("format", kFormat);
  w.SetMetadata("format_version", std::to_string(kCheckpointFormatVersion));
  w.SetMetadata("role", RoleText(id.role));
  w.SetMetadata("rank", std::to_string(id.rank));
  w.SetMetadata("iteration", std::to_string(id.iteration));
  w.SetMetadata("membership_epoch", std::to_string(id.membership_epoch));
  w.SetMetadata("config_fingerprint", id.config_fingerprint);
  // Checksums per array: a file read outside a manifest (sparseps-eval) is still checked.
  w.AddChecksums();
  const std::string bytes = w.Serialize();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("cannot create directory " + dir + ": " + ec.message());
  SPARSEPS_RETURN_IF_ERROR(WriteFileAtomically(dir + "/" + file, bytes));
  info->role = id.role;
  info->rank = id.rank;
  info->file = file;
  info->bytes = bytes.size();
  info->xxh3 = Xxh3Hex(bytes.data(), bytes.size());
  return Status::OK();
}

BackgroundCheckpointWriter::~BackgroundCheckpointWriter() {
  if (running_.valid()) running_.wait();
}

void BackgroundCheckpointWriter::Collect() {
  if (!running_.valid()) return;
  auto r = running_.get();
  if (!r.ok()) {
    if (error_.ok()) error_ = r.status();
    return;
  }
  for (auto& f : *r) finished_.push_back(std::move(f));
}

void BackgroundCheckpointWriter::Submit(Task task) {
  Collect();  // one batch at a time: the previous one first
  running_ = std::async(std::launch::async, std::move(task));
}

Result<std::vector<proto::CheckpointFile>> BackgroundCheckpointWriter::TakeFinished(bool wait) {
  if (running_.valid() &&
      (wait || running_.wait_for(std::chrono::seconds(0)) == std::future_status::ready)) {
    Collect();
  }
  if (!error_.ok()) return error_;
  return std::exchange(finished_, {});
}

Result<SafetensorsFile> ReadCheckpointFile(const std::string& path, const CheckpointIdentity& want,
                                           const CheckpointFileInfo& expected) {
  auto bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  auto refuse = [&](const std::string& why) {
    return Status::FailedPrecondition("checkpoint file " + path + " refused: " + why);
  };
  if (!expected.xxh3.empty()) {
    if (bytes->size() != expected.bytes) {
      return refuse("it has " + std::to_string(bytes->size()) + " bytes, the manifest says " +
                    std::to_string(expected.bytes) + " (truncated or replaced?)");
    }
    const std::string h = Xxh3Hex(bytes->data(), bytes->size());
    if (h != expected.xxh3) {
      return refuse("its XXH3 is " + h + ", the manifest says " + expected.xxh3 + " (corrupt)");
    }
  }
  auto file = SafetensorsFile::Parse(std::move(*bytes), path);
  if (!file.ok()) return refuse(file.status().message());
  if (file->Meta("format") != kFormat) return refuse("it is not a sparseps checkpoint");
  if (file->Meta("format_version") != std::to_string(kCheckpointFormatVersion)) {
    return refuse("format version " + file->Meta("format_version") + "; this build reads " +
                  std::to_string(kCheckpointFormatVersion));
  }
  for (const auto& name : file->names()) {
    const std::string want_sum = file->Meta("xxh3." + name);
    const auto data = file->Data(*file->Find(name));
    if (want_sum.empty()) return refuse("array '" + name + "' has no checksum");
    if (Xxh3Hex(data.data(), data.size()) != want_sum) {
      return refuse("array '" + name + "' does not match its checksum (corrupt)");
    }
  }
  auto role = ParseRole(file->Meta("role"));
  if (!role.ok() || *role != want.role || file->Meta("rank") != std::to_string(want.rank)) {
    return refuse("it belongs to " + file->Meta("role") + " " + file->Meta("rank") + ", not " +
                  RoleText(want.role) + " " + std::to_string(want.rank));
  }
  if (file->Meta("iteration") != std::to_string(want.iteration)) {
    return refuse("it is of iteration " + file->Meta("iteration") + ", not " +
                  std::to_string(want.iteration));
  }
  if (file->Meta("config_fingerprint") != want.config_fingerprint) {
    return refuse("it was written by a job with another config (fingerprint " +
                  file->Meta("config_fingerprint") + ", this job's is " + want.config_fingerprint +
                  "): model, data, train, compression, aggregation and the cluster's sizes must "
                  "be the same to resume");
  }
  return file;
}

const proto::CheckpointFile* FindResumeFile(const proto::Membership& membership, proto::Role role,
                                            int rank, const std::string& file) {
  for (const auto& f : membership.resume_files()) {
    if (f.role() == role && f.rank() == rank && f.file() == file) return &f;
  }
  return nullptr;
}

Result<SafetensorsFile> ReadResumeFile(const std::string& dir, const proto::Membership& membership,
                                       proto::Role role, int rank,
                                       const std::string& config_fingerprint) {
  const std::string name = CheckpointFileName(role, rank);
  const std::string path = CheckpointIterationDir(dir, membership.resume_iteration()) + "/" + name;
  const proto::CheckpointFile* f = FindResumeFile(membership, role, rank, name);
  if (f == nullptr) {
    return Status::FailedPrecondition(
        "the manifest of checkpoint " + std::to_string(membership.resume_iteration()) +
        " lists no file for " + RoleText(role) + " " + std::to_string(rank));
  }
  CheckpointIdentity want{role, rank, membership.resume_iteration(), 0, config_fingerprint};
  return ReadCheckpointFile(path, want, FromProto(*f));
}

// ---- manifests ----

Status WriteCheckpointManifest(const std::string& dir, const CheckpointManifest& m) {
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["format_version"] = kCheckpointFormatVersion;
  j["iteration"] = m.iteration;
  j["membership_epoch"] = m.membership_epoch;
  j["config_fingerprint"] = m.config_fingerprint;
  j["files"] = nlohmann::ordered_json::array();
  for (const auto& f : m.files) {
    j["files"].push_back({{"role", RoleText(f.role)},
                          {"rank", f.rank},
                          {"file", f.file},
                          {"bytes", f.bytes},
                          {"xxh3", f.xxh3}});
  }
  if (!m.splits.empty()) {
    j["splits"] = nlohmann::ordered_json::array();
    for (const auto& s : m.splits) {
      j["splits"].push_back({{"from_iteration", s.from_iteration}, {"ranks", s.ranks}});
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("cannot create directory " + dir + ": " + ec.message());
  return WriteFileAtomically(dir + "/" + kManifest, j.dump(2) + "\n");
}

Result<CheckpointManifest> ReadCheckpointManifest(const std::string& iteration_dir) {
  const std::string path = iteration_dir + "/" + kManifest;
  auto text = ReadWholeFile(path);
  if (!text.ok()) return text.status();
  auto bad = [&](const std::string& why) {
    return Status::FailedPrecondition("checkpoint manifest " + path + " refused: " + why);
  };
  CheckpointManifest m;
  try {
    const auto j = nlohmann::json::parse(*text);
    if (j.at("format").get<std::string>() != kFormat) return bad("not a sparseps manifest");
    if (j.at("format_version").get<int>() != kCheckpointFormatVersion) {
      return bad("format version " + std::to_string(j.at("format_version").get<int>()));
    }
    m.iteration = j.at("iteration").get<uint64_t>();
    m.membership_epoch = j.at("membership_epoch").get<uint64_t>();
    m.config_fingerprint = j.at("config_fingerprint").get<std::string>();
    for (const auto& f : j.at("files")) {
      CheckpointFileInfo info;
      auto role = ParseRole(f.at("role").get<std::string>());
      if (!role.ok()) return bad(role.status().message());
      info.role = *role;
      info.rank = f.at("rank").get<int>();
      info.file = f.at("file").get<std::string>();
      info.bytes = f.at("bytes").get<uint64_t>();
      info.xxh3 = f.at("xxh3").get<std::string>();
      if (info.file.find('/') != std::string::npos) return bad("file name " + info.file);
      m.files.push_back(std::move(info));
    }
    for (const auto& s : j.value("splits", nlohmann::json::array())) {
      WorkerSplit split{s.at("from_iteration").get<int64_t>(),
                        s.at("ranks").get<std::vector<int>>()};
      if (!std::is_sorted(split.ranks.begin(), split.ranks.end())) return bad("unsorted ranks");
      m.splits.push_back(std::move(split));
    }
  } catch (const nlohmann::json::exception& e) {
    return bad(e.what());
  }
  return m;
}

namespace {

// Iteration folders of dir, newest first.
std::vector<std::pair<uint64_t, std::string>> IterationDirs(const std::string& dir) {
  std::vector<std::pair<uint64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("iter-", 0) != 0 || name.size() != 15) continue;
    if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    out.emplace_back(std::stoull(name.substr(5)), e.path().string());
  }
  std::sort(out.rbegin(), out.rend());
  return out;
}

}  // namespace

std::optional<CheckpointManifest> LatestCheckpoint(const std::string& dir) {
  for (const auto& [iteration, path] : IterationDirs(dir)) {
    auto m = ReadCheckpointManifest(path);
    if (m.ok() && m->iteration == iteration) return *m;
    spdlog::warn("skipping checkpoint {}: {}", path,
                 m.ok() ? "its manifest names another iteration" : m.status().message());
  }
  return std::nullopt;
}

namespace {

// Deletes an old iteration folder; one that another process deleted meanwhile is no error.
void RemoveCheckpointFolder(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec && std::filesystem::exists(path)) {
    spdlog::warn("could not delete old checkpoint {}: {}", path, ec.message());
  }
}

}  // namespace

std::vector<uint64_t> PruneCheckpoints(const std::string& dir, uint32_t keep) {
  std::vector<uint64_t> kept;
  for (const auto& [iteration, path] : IterationDirs(dir)) {
    const bool is_complete = ReadCheckpointManifest(path).ok();
    // Keep: the newest `keep` complete ones, and anything newer than the newest complete one (it
    // may still be being written).
    if (is_complete && (keep == 0 || kept.size() < keep)) {
      kept.push_back(iteration);
      continue;
    }
    if (kept.empty()) continue;
    RemoveCheckpointFolder(path);
  }
  return kept;
}

void PruneCheckpointsTo(const std::string& dir, const std::vector<uint64_t>& kept) {
  for (const auto& [iteration, path] : IterationDirs(dir)) {
    if (iteration >= kept.front() || std::find(kept.begin(), kept.end(), iteration) != kept.end())
      continue;
    RemoveCheckpointFolder(path);
  }
}

void KeepCheckpointsAsTheScheduler(ControlClient& control, const proto::JobConfig& config) {
  const std::string dir = CheckpointDir(config);
  if (dir.empty()) return;
  control.OnCheckpointsKept(
      [dir](const std::vector<uint64_t>& kept) { PruneCheckpointsTo(dir, kept); });
}

}  // namespace sparseps
