#include "common/status.h"

namespace sparseps {

std::string Status::ToString() const {
  const char* name = "OK";
  switch (code_) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      name = "invalid argument";
      break;
    case StatusCode::kNotFound:
      name = "not found";
      break;
    case StatusCode::kDeadlineExceeded:
      name = "deadline exceeded";
      break;
    case StatusCode::kIoError:
      name = "I/O error";
      break;
    case StatusCode::kProtocolError:
      name = "protocol error";
      break;
    case StatusCode::kFailedPrecondition:
      name = "failed precondition";
      break;
    case StatusCode::kAborted:
      name = "aborted";
      break;
    case StatusCode::kInternal:
      name = "internal error";
      break;
    case StatusCode::kUnavailable:
      name = "unavailable";
      break;
    case StatusCode::kDisconnected:
      name = "disconnected";
      break;
  }
  return std::string(name) + ": " + message_;
}

}  // namespace sparseps
