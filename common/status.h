// Errors as values: Status (a code and a message) and Result<T> (a value or a Status).
//
// Thread-safety: values; safe to copy between threads.
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace sparseps {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad configuration or input (daemons exit with code 2)
  kNotFound,
  kDeadlineExceeded,  // a wait ran out of time; the message names who is missing
  kIoError,
  kProtocolError,  // a malformed or unexpected message
  kFailedPrecondition,
  kAborted,      // the job was ended by the scheduler (FATAL) or by a signal
  kUnavailable,  // a server died: the work in progress is void until the job rolls back
  kInternal,
  kDisconnected,  // this node is out of the job: it heard nothing from the scheduler for
                  // cluster.heartbeat_timeout_s (its host was cut off, or the scheduler died), or
                  // the scheduler removed it (declared dead while it was stopped or slow); the
                  // job may go on without it (daemons exit with code 3)
};

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status DeadlineExceeded(std::string m) {
    return {StatusCode::kDeadlineExceeded, std::move(m)};
  }
  static Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
  static Status ProtocolError(std::string m) { return {StatusCode::kProtocolError, std::move(m)}; }
  static Status FailedPrecondition(std::string m) {
    return {StatusCode::kFailedPrecondition, std::move(m)};
  }
  static Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status Disconnected(std::string m) { return {StatusCode::kDisconnected, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// A value of type T, or the Status saying why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}          // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {}  // NOLINT: implicit by design

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  // REQUIRES: ok().
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

// Returns from the enclosing function when `expr` (a Status) is not OK.
#define SPARSEPS_RETURN_IF_ERROR(expr)             \
  do {                                             \
    ::sparseps::Status status_macro_ = (expr);     \
    if (!status_macro_.ok()) return status_macro_; \
  } while (0)

}  // namespace sparseps
