// Safetensors files (Hugging Face's format, https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON header mapping each tensor's name to its dtype,
// shape and [begin, end) byte offsets into the data that follows (plus an optional
// "__metadata__" map of strings), then the raw little-endian tensor data, contiguous and in
// offset order. The trained model (<run.dir>/model.safetensors) and every checkpoint file
// (storage/checkpoint.h) are written in it, so that PyTorch users read them with the safetensors
// package, or with json and numpy alone.
//
// Thread-safety: a writer or a file is used by one thread; distinct objects are independent.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor_layout.h"

namespace sparseps {

// The element types sparseps writes (safetensors' names: "F32", "F64", "U8", "U32", "I64",
// "U64").
enum class DType { kF32, kF64, kU8, kU32, kI64, kU64 };

// Bytes per element of `dtype`.
size_t DTypeSize(DType dtype);
// Safetensors' name of `dtype` ("F32", ...).
const char* DTypeName(DType dtype);

// Collects tensors and metadata, then writes one file atomically.
class SafetensorsWriter {
 public:
  // Adds tensor `name` of `dtype` and `shape` (elements per dimension; an empty shape is a
  // scalar) whose bytes are data[0, bytes); the bytes are copied. REQUIRES: bytes equals the
  // product of shape times DTypeSize(dtype), and name is new, not "__metadata__".
  void Add(const std::string& name, DType dtype, std::vector<uint64_t> shape, const void* data,
           size_t bytes);
  void AddF32(const std::string& name, std::vector<uint64_t> shape, std::span<const float> v) {
    Add(name, DType::kF32, std::move(shape), v.data(), v.size_bytes());
  }
  // Sets metadata "xxh3.<name>" to each tensor's XXH3-64 (16 hex digits).
  void AddChecksums();
  // Sets a "__metadata__" entry (strings only, as the format requires).
  void SetMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  // Writes the file: to `path`.tmp, fsync, rename over `path`, fsync of the directory, so that
  // `path` is either the old file or the whole new one after a crash. Errors: IoError naming the
  // path.
  Status Write(const std::string& path) const;

  // The file's bytes (what Write writes).
  std::string Serialize() const;

 private:
  struct Tensor {
    DType dtype;
    std::vector<uint64_t> shape;
    std::string data;
  };
  std::map<std::string, Tensor> tensors_;  // written in name order
  std::map<std::string, std::string> metadata_;
};

// A safetensors file read whole into memory and validated: header length within the file, JSON
// well formed, every dtype known, every tensor's byte size equal to its shape's, offsets
// contiguous from 0 to the end of the file.
class SafetensorsFile {
 public:
  struct Tensor {
    DType dtype;
    std::vector<uint64_t> shape;
    uint64_t offset = 0;  // of the data, in the file's bytes
    uint64_t size = 0;    // bytes
  };

  // Reads and validates `path`. Errors: NotFound when it does not exist; IoError when it cannot be
  // read; ProtocolError naming the path and what is wrong (truncated, bad header, bad offsets).
  static Result<SafetensorsFile> Read(const std::string& path);
  // Validates bytes of a file called `name` (for messages).
  static Result<SafetensorsFile> Parse(std::string bytes, const std::string& name);

  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;

  // The tensor `name`, or null.
  const Tensor* Find(const std::string& name) const;
  // The bytes of tensor t (of this file), valid while the file lives.
  std::span<const uint8_t> Data(const Tensor& t) const {
    return {reinterpret_cast<const uint8_t*>(bytes_.data()) + t.offset, t.size};
  }
  // Tensor names in offset order.
  const std::vector<std::string>& names() const { return names_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The metadata value of `key`, or "" when absent.
  std::string Meta(const std::string& key) const;
  const std::string& path() const { return path_; }
  size_t size_bytes() const { return bytes_.size(); }
  const std::string& bytes() const { return bytes_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::string bytes_;
  std::map<std::string, Tensor> tensors_;
  std::vector<std::string> names_;
  std::map<std::string, std::string> metadata_;
};

// Tensors a model file holds beside the parameters: a model's buffers (state that is neither a
// parameter nor aggregated, such as BatchNorm's running mean and variance), F32, laid out by
// `layers` over `values` as the parameters are over theirs.
struct ExtraTensors {
  std::vector<TensorLayout> layers;
  std::vector<float> values;
};

// Writes params (the flat vector, num_params floats) as a safetensors file of F32 tensors, one
// per entry of `layers` (which must cover params exactly), and the tensors of `extra` (optional),
// with `metadata`, atomically. Errors: InvalidArgument when the layers do not cover params (or
// extra's its values), or when a name is taken twice; IoError naming the path.
Status WriteModelFile(const std::string& path, std::span<const float> params,
                      const std::vector<TensorLayout>& layers,
                      const std::map<std::string, std::string>& metadata,
                      const ExtraTensors* extra = nullptr);

// Fills `writer` with what WriteModelFile writes (for writing it later, e.g. on another thread).
Status BuildModelFile(std::span<const float> params, const std::vector<TensorLayout>& layers,
                      const std::map<std::string, std::string>& metadata, SafetensorsWriter* writer,
                      const ExtraTensors* extra = nullptr);

// Adds the tensors of `extra` to a writer that BuildModelFile filled from `layers` (a model
// file built before the buffers were known). Errors: InvalidArgument when extra's layers do not
// cover its values, or when a name is taken twice or is one of `layers`' (nothing is added then).
Status AddModelBuffers(const ExtraTensors& extra, const std::vector<TensorLayout>& layers,
                       SafetensorsWriter* writer);

// Reads a model file back into a flat vector laid out by `layers`. Errors: those of Read;
// InvalidArgument naming the file and the tensor that is missing or has another shape or dtype.
Result<std::vector<float>> ReadModelFile(const std::string& path,
                                         const std::vector<TensorLayout>& layers);

// XXH3-64 of bytes as 16 hex digits (the checksums of model and checkpoint files).
std::string Xxh3Hex(const void* data, size_t bytes);

// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync of the directory).
// Errors: IoError naming the path.
Status WriteFileAtomically(const std::string& path, const std::string& bytes);

// Reads the whole file. Errors: NotFound, IoError, each naming the path.
Result<std::string> ReadWholeFile(const std::string& path);

}  // namespace sparseps
