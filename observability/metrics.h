// Metrics files of a run: CSV tables (one row per iteration or evaluation) and JSON summaries.
//
// Thread-safety: one writer per file, used by one thread.
#pragma once

#include <google/protobuf/message.h>

#include <fstream>
#include <string>
#include <vector>

#include "common/status.h"

namespace sparseps {

class CsvWriter {
 public:
  // Creates (truncates) `path` and writes the header row. An empty path makes a writer that
  // discards rows (runs without a run directory). Errors: IoError naming the path.
  Status Open(const std::string& path, const std::vector<std::string>& columns);
  // For a resumed run: keeps the rows of an existing `path` whose column `key_column` is at most
  // `keep_upto` (what the run did up to its checkpoint), drops the rest, and appends after them.
  // Without a readable file with the same header it is Open.
  Status OpenResumed(const std::string& path, const std::vector<std::string>& columns,
                     size_t key_column, double keep_upto);
  // Appends one row; numbers are written with enough digits to round-trip.
  void Row(const std::vector<double>& values);
  bool is_open() const { return out_.is_open(); }

 private:
  std::ofstream out_;
  size_t columns_ = 0;
};

// `message` as pretty-printed JSON: every field in the .proto's order under its .proto name,
// defaults included, integers of every width as JSON numbers (protobuf's own JSON mapping writes
// 64-bit ones as strings, which readers of a summary should not have to convert), enums by name.
std::string ToJsonText(const google::protobuf::Message& message);

// Writes ToJsonText(message) to `path` atomically (write to a temporary file, then rename).
// Errors: IoError.
Status WriteJson(const std::string& path, const google::protobuf::Message& message);

// Creates `dir` and its parents if missing. Errors: IoError.
Status EnsureDirectory(const std::string& dir);

}  // namespace sparseps
