#include "observability/metrics.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

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

Status CsvWriter::OpenResumed(const std::string& path, const std::vector<std::string>& columns,
                              size_t key_column, double keep_upto) {
  if (path.empty()) return Open(path, columns);
  std::ifstream in(path);
  std::string header, line;
  std::string expected;
  for (size_t i = 0; i < columns.size(); ++i) expected += (i ? "," : "") + columns[i];
  if (!in || !std::getline(in, header) || header != expected) return Open(path, columns);
  std::string kept = header + "\n";
  while (std::getline(in, line)) {
    std::stringstream fields(line);
    std::string cell;
    for (size_t i = 0; i <= key_column && std::getline(fields, cell, ','); ++i) {
    }
    char* end = nullptr;
    const double key = std::strtod(cell.c_str(), &end);
    if (end != cell.c_str() && key <= keep_upto) kept += line + "\n";
  }
  in.close();
  {
    std::ofstream rewrite(path, std::ios::trunc);
    rewrite << kept;
    if (!rewrite) return Status::IoError("cannot rewrite " + path);
  }
  columns_ = columns.size();
  out_.open(path, std::ios::app);
  if (!out_) return Status::IoError("cannot open " + path);
  out_.precision(std::numeric_limits<double>::max_digits10 - 2);
  return Status::OK();
}

void CsvWriter::Row(const std::vector<double>& values) {
  if (!out_.is_open()) return;
  for (size_t i = 0; i < values.size() && i < columns_; ++i) out_ << (i ? "," : "") << values[i];
  out_ << '\n';
  out_.flush();
}

namespace {

namespace pb = google::protobuf;

nlohmann::ordered_json FieldValue(const pb::Message& msg, const pb::FieldDescriptor* f, int i);

// Every field, in the .proto's order, defaults included; 64-bit integers as JSON numbers.
nlohmann::ordered_json ToJson(const pb::Message& msg) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  const pb::Descriptor* d = msg.GetDescriptor();
  const pb::Reflection* r = msg.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) {
      nlohmann::ordered_json list = nlohmann::ordered_json::array();
      for (int j = 0; j < r->FieldSize(msg, f); ++j) list.push_back(FieldValue(msg, f, j));
      out[f->name()] = std::move(list);
    } else {
      out[f->name()] = FieldValue(msg, f, -1);
    }
  }
  return out;
}

// Field f of msg (element i of a repeated field, or the field itself when i is -1).
nlohmann::ordered_json FieldValue(const pb::Message& msg, const pb::FieldDescriptor* f, int i) {
  const pb::Reflection* r = msg.GetReflection();
  const bool rep = i >= 0;
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32:
      return rep ? r->GetRepeatedInt32(msg, f, i) : r->GetInt32(msg, f);
    case pb::FieldDescriptor::CPPTYPE_INT64:
      return rep ? r->GetRepeatedInt64(msg, f, i) : r->GetInt64(msg, f);
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r->GetRepeatedUInt32(msg, f, i) : r->GetUInt32(msg, f);
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r->GetRepeatedUInt64(msg, f, i) : r->GetUInt64(msg, f);
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return rep ? r->GetRepeatedDouble(msg, f, i) : r->GetDouble(msg, f);
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
      return rep ? r->GetRepeatedFloat(msg, f, i) : r->GetFloat(msg, f);
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r->GetRepeatedBool(msg, f, i) : r->GetBool(msg, f);
    case pb::FieldDescriptor::CPPTYPE_STRING:
      return rep ? r->GetRepeatedString(msg, f, i) : r->GetString(msg, f);
    case pb::FieldDescriptor::CPPTYPE_ENUM:
      return (rep ? r->GetRepeatedEnum(msg, f, i) : r->GetEnum(msg, f))->name();
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      return ToJson(rep ? r->GetRepeatedMessage(msg, f, i) : r->GetMessage(msg, f));
  }
  return nullptr;
}

}  // namespace

std::string ToJsonText(const google::protobuf::Message& message) {
  return ToJson(message).dump(2) + "\n";
}

Status WriteJson(const std::string& path, const google::protobuf::Message& message) {
  const std::string json = ToJsonText(message);
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
