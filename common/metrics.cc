#include "common/metrics.h"

#include <google/protobuf/util/json_util.h>

#include <cstdio>
#include <filesystem>
#include <limits>

namespace sparseps {

Status CsvWriter::Open(const std::string& path, const std::vector<std::string>& columns) {
  columns_ = columns.size();
  if (path.empty()) return Status::OK();
  out_.open(path, std::ios::trunc);
  if (!out_) return Status::IoError("cannot create " + path);
  out_.precision(std::numeric_limits<double>::max_digits10 - 2);
  for (size_t i = 0; i < columns.size(); ++i) out_ << (i ? "," : "") << columns[i];
  out_ << '\n';
  out_.flush();
  return Status::OK();
}

void CsvWriter::Row(const std::vector<double>& values) {
  if (!out_.is_open()) return;
  for (size_t i = 0; i < values.size() && i < columns_; ++i) out_ << (i ? "," : "") << values[i];
  out_ << '\n';
  out_.flush();
}

Status WriteJson(const std::string& path, const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = true;
  opts.always_print_primitive_fields = true;
  opts.preserve_proto_field_names = true;
  auto st = google::protobuf::util::MessageToJsonString(message, &json, opts);
  if (!st.ok()) return Status::Internal("JSON encoding failed: " + st.ToString());
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return Status::IoError("cannot create " + tmp);
    out << json;
    if (!out) return Status::IoError("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return Status::IoError("cannot rename " + tmp + " to " + path);
  }
  return Status::OK();
}

Status EnsureDirectory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("cannot create directory " + dir + ": " + ec.message());
  return Status::OK();
}

}  // namespace sparseps
