#include "storage/safetensors.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace sparseps {
namespace {

// Refuse headers beyond this (safetensors' own readers refuse above 100 MB).
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {{DType::kF32, "F32", 4}, {DType::kF64, "F64", 8},
                                 {DType::kU8, "U8", 1},   {DType::kU32, "U32", 4},
                                 {DType::kI64, "I64", 8}, {DType::kU64, "U64", 8}};

std::string ErrnoText() { return std::strerror(errno); }

}  // namespace

size_t DTypeSize(DType dtype) {
  for (const auto& d : kDTypes)
    if (d.dtype == dtype) return d.size;
  return 0;
}

const char* DTypeName(DType dtype) {
  for (const auto& d : kDTypes)
    if (d.dtype == dtype) return d.name;
  return "?";
}

void SafetensorsWriter::Add(const std::string& name, DType dtype, std::vector<uint64_t> shape,
                            const void* data, size_t bytes) {
  Tensor t{dtype, std::move(shape), std::string(static_cast<const char*>(data), bytes)};
  tensors_[name] = std::move(t);
}

std::string Xxh3Hex(const void* data, size_t bytes) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(data, bytes)));
  return hex;
}

void SafetensorsWriter::AddChecksums() {
  for (const auto& [name, t] : tensors_) {
    metadata_["xxh3." + name] = Xxh3Hex(t.data.data(), t.data.size());
  }
}

std::string SafetensorsWriter::Serialize() const {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) meta[k] = v;
    header["__metadata__"] = meta;
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors_) {
    header[name] = {{"dtype", DTypeName(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  // Pad with spaces so that the data starts 8-byte aligned (as the format recommends).
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  out.reserve(out.size() + offset);
  for (const auto& [name, t] : tensors_) out += t.data;
  return out;
}

Status SafetensorsWriter::Write(const std::string& path) const {
  return WriteFileAtomically(path, Serialize());
}

Status WriteFileAtomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IoError("cannot create " + tmp + ": " + ErrnoText());
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const std::string why = ErrnoText();
      ::close(fd);
      ::unlink(tmp.c_str());
      return Status::IoError("cannot write " + tmp + ": " + why);
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string why = ErrnoText();
    ::unlink(tmp.c_str());
    return Status::IoError("cannot flush " + tmp + ": " + why);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = ErrnoText();
    ::unlink(tmp.c_str());
    return Status::IoError("cannot rename " + tmp + " to " + path + ": " + why);
  }
  // The rename itself is durable once the directory is flushed.
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::OK();
}

Result<std::string> ReadWholeFile(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::NotFound(path + " does not exist");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError("cannot open " + path);
  std::ostringstream os;
  os << in.rdbuf();
  if (!in && !in.eof()) return Status::IoError("cannot read " + path);
  return os.str();
}

Result<SafetensorsFile> SafetensorsFile::Read(const std::string& path) {
  auto bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  return Parse(std::move(*bytes), path);
}

Result<SafetensorsFile> SafetensorsFile::Parse(std::string bytes, const std::string& name) {
  auto bad = [&](const std::string& why) {
    return Status::ProtocolError(name + " is not a valid safetensors file: " + why);
  };
  if (bytes.size() < 8) return bad("shorter than its 8-byte header length (truncated?)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  if (n > kMaxSafetensorsHeaderBytes || n > bytes.size() - 8) {
    return bad("header length " + std::to_string(n) + " runs past the end of the file (" +
               std::to_string(bytes.size()) + " bytes; truncated?)");
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(n));
  } catch (const nlohmann::json::exception& e) {
    return bad(std::string("header is not JSON: ") + e.what());
  }
  if (!header.is_object()) return bad("header is not a JSON object");
  SafetensorsFile f;
  f.path_ = name;
  const uint64_t data_begin = 8 + n;
  const uint64_t data_size = bytes.size() - data_begin;
  std::vector<std::pair<uint64_t, std::string>> order;
  struct Raw {
    DType dtype;
    std::vector<uint64_t> shape;
    uint64_t begin, end;
  };
  std::map<std::string, Raw> raw;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const auto& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) return bad("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return bad("__metadata__." + m.key() + " is not a string");
        f.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets") || !v["dtype"].is_string() || !v["shape"].is_array() ||
        !v["data_offsets"].is_array() || v["data_offsets"].size() != 2) {
      return bad("tensor '" + key + "' lacks dtype, shape or data_offsets");
    }
    Raw r{};
    const std::string dtype = v["dtype"].get<std::string>();
    const DTypeInfo* info = nullptr;
    for (const auto& d : kDTypes)
      if (dtype == d.name) info = &d;
    if (info == nullptr) return bad("tensor '" + key + "' has unsupported dtype " + dtype);
    r.dtype = info->dtype;
    unsigned __int128 elements = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) return bad("tensor '" + key + "' has a bad shape");
      r.shape.push_back(d.get<uint64_t>());
      elements *= r.shape.back();
      if (elements > data_size) elements = data_size + 1;  // too big either way; no overflow
    }
    const auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      return bad("tensor '" + key + "' has bad data_offsets");
    r.begin = off[0].get<uint64_t>();
    r.end = off[1].get<uint64_t>();
    if (r.begin > r.end || r.end > data_size) {
      return bad("tensor '" + key + "' lies at [" + std::to_string(r.begin) + ", " +
                 std::to_string(r.end) + ") beyond the " + std::to_string(data_size) +
                 " data bytes (truncated?)");
    }
    if (elements * info->size != r.end - r.begin) {
      return bad("tensor '" + key + "' holds " + std::to_string(r.end - r.begin) +
                 " bytes, not what its shape and dtype need");
    }
    order.emplace_back(r.begin, key);
    raw[key] = std::move(r);
  }
  std::sort(order.begin(), order.end());
  uint64_t expect = 0;
  for (const auto& [begin, key] : order) {
    const Raw& r = raw[key];
    if (r.begin != expect) return bad("tensor '" + key + "' does not follow the previous one");
    expect = r.end;
  }
  if (expect != data_size) {
    return bad(std::to_string(data_size - expect) + " bytes after the last tensor");
  }
  f.bytes_ = std::move(bytes);
  for (const auto& [begin, key] : order) {
    const Raw& r = raw[key];
    f.tensors_[key] = Tensor{r.dtype, r.shape, data_begin + r.begin, r.end - r.begin};
    f.names_.push_back(key);
  }
  return f;
}

namespace {

// Elements of a tensor of `l`'s shape.
uint64_t Elements(const TensorLayout& l) {
  uint64_t n = 1;
  for (uint64_t d : l.shape) n *= d;
  return n;
}

// Checks that `layers` lie within `values` and cover them exactly, and that no name is in
// `names` already (adding each). Errors: InvalidArgument (`what` naming the vector).
Status CheckLayers(std::span<const float> values, const std::vector<TensorLayout>& layers,
                   const char* what, std::set<std::string>* names) {
  uint64_t covered = 0;
  for (const auto& l : layers) {
    const uint64_t n = Elements(l);
    if (l.offset + n > values.size()) {
      return Status::InvalidArgument("layer " + l.name + " runs past the " + what);
    }
    if (!names->insert(l.name).second) {
      return Status::InvalidArgument("the model file would hold two tensors named " + l.name);
    }
    covered += n;
  }
  if (covered != values.size()) {
    return Status::InvalidArgument("the layers cover " + std::to_string(covered) + " of " +
                                   std::to_string(values.size()) + " " + what);
  }
  return Status::OK();
}

// Adds each layer of `layers` over `values` to `w` (CheckLayers passed).
void AddLayers(std::span<const float> values, const std::vector<TensorLayout>& layers,
               SafetensorsWriter* w) {
  for (const auto& l : layers) w->AddF32(l.name, l.shape, values.subspan(l.offset, Elements(l)));
}

}  // namespace

Status BuildModelFile(std::span<const float> params, const std::vector<TensorLayout>& layers,
                      const std::map<std::string, std::string>& metadata, SafetensorsWriter* w,
                      const ExtraTensors* extra) {
  std::set<std::string> names;
  SPARSEPS_RETURN_IF_ERROR(CheckLayers(params, layers, "parameters", &names));
  if (extra != nullptr) {
    SPARSEPS_RETURN_IF_ERROR(CheckLayers(extra->values, extra->layers, "buffers", &names));
  }
  AddLayers(params, layers, w);
  if (extra != nullptr) AddLayers(extra->values, extra->layers, w);
  for (const auto& [k, v] : metadata) w->SetMetadata(k, v);
  return Status::OK();
}

Status AddModelBuffers(const ExtraTensors& extra, const std::vector<TensorLayout>& layers,
                       SafetensorsWriter* w) {
  std::set<std::string> names;
  for (const auto& l : layers) names.insert(l.name);
  SPARSEPS_RETURN_IF_ERROR(CheckLayers(extra.values, extra.layers, "buffers", &names));
  AddLayers(extra.values, extra.layers, w);
  return Status::OK();
}

Status WriteModelFile(const std::string& path, std::span<const float> params,
                      const std::vector<TensorLayout>& layers,
                      const std::map<std::string, std::string>& metadata,
                      const ExtraTensors* extra) {
  SafetensorsWriter w;
  SPARSEPS_RETURN_IF_ERROR(BuildModelFile(params, layers, metadata, &w, extra));
  return w.Write(path);
}

Result<std::vector<float>> ReadModelFile(const std::string& path,
                                         const std::vector<TensorLayout>& layers) {
  auto file = SafetensorsFile::Read(path);
  if (!file.ok()) return file.status();
  uint64_t total = 0;
  for (const auto& l : layers) {
    total = std::max(total, l.offset + Elements(l));
  }
  std::vector<float> params(total, 0.0f);
  for (const auto& l : layers) {
    const auto* t = file->Find(l.name);
    if (t == nullptr) {
      return Status::InvalidArgument(path + " has no tensor '" + l.name +
                                     "': is it a model of this config?");
    }
    if (t->dtype != DType::kF32 || t->shape != l.shape) {
      return Status::InvalidArgument(path + ": tensor '" + l.name +
                                     "' has another shape or dtype than this config's model");
    }
    const auto data = file->Data(*t);
    std::memcpy(params.data() + l.offset, data.data(), data.size());
  }
  return params;
}

const SafetensorsFile::Tensor* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::string SafetensorsFile::Meta(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? std::string() : it->second;
}

}  // namespace sparseps
