// The C interface (include/sparseps/sparseps.h) over the C++ Worker (include/sparseps/client.h):
// every exception becomes a code and a message, nothing crosses the boundary.
#include <cstdio>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "sparseps/client.h"
#include "sparseps/sparseps.h"

struct sparseps_worker {
  sparseps::client::Worker worker;
};

namespace {

// Writes `message` into err (err_len bytes, NUL-terminated) when err is given; returns code.
int Fail(int code, const std::string& message, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) std::snprintf(err, err_len, "%s", message.c_str());
  return code;
}

// Runs f, turning what it throws into a code and a message.
template <typename F>
int Guard(F&& f, char* err, size_t err_len) {
  try {
    f();
    if (err != nullptr && err_len > 0) err[0] = '\0';
    return SPARSEPS_OK;
  } catch (const sparseps::client::Error& e) {
    switch (e.code()) {
      case sparseps::client::ErrorCode::kInvalidArgument:
        return Fail(SPARSEPS_INVALID_ARGUMENT, e.what(), err, err_len);
      case sparseps::client::ErrorCode::kDeadlineExceeded:
        return Fail(SPARSEPS_DEADLINE_EXCEEDED, e.what(), err, err_len);
      default:
        return Fail(SPARSEPS_FAILED, e.what(), err, err_len);
    }
  } catch (const std::exception& e) {
    return Fail(SPARSEPS_FAILED, e.what(), err, err_len);
  } catch (...) {
    return Fail(SPARSEPS_FAILED, "unknown exception", err, err_len);
  }
}

// A null handle or pointer with a size: the same error everywhere.
int Missing(const char* what, char* err, size_t err_len) {
  return Fail(SPARSEPS_INVALID_ARGUMENT, std::string(what) + " is NULL", err, err_len);
}

}  // namespace

extern "C" {

const char* sparseps_version(void) {
  static const std::string version = sparseps::client::Version();
  return version.c_str();
}

int sparseps_worker_new(const char* config_path, const char* const* overrides, size_t num_overrides,
                        int rank, sparseps_worker** out, char* err, size_t err_len) {
  if (out == nullptr) return Missing("out", err, err_len);
  *out = nullptr;
  if (overrides == nullptr && num_overrides > 0) return Missing("overrides", err, err_len);
  std::vector<std::string> sets;
  for (size_t i = 0; i < num_overrides; ++i) {
    if (overrides[i] == nullptr) return Missing("an override", err, err_len);
    sets.emplace_back(overrides[i]);
  }
  return Guard(
      [&] {
        *out = new sparseps_worker{
            sparseps::client::Worker(config_path != nullptr ? config_path : "", sets, rank)};
      },
      err, err_len);
}

void sparseps_worker_free(sparseps_worker* worker) { delete worker; }

int sparseps_worker_init(sparseps_worker* worker, float* params, size_t n, char* err,
                         size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  if (params == nullptr && n > 0) return Missing("params", err, err_len);
  return Guard([&] { worker->worker.Init(std::span<float>(params, n)); }, err, err_len);
}

int sparseps_worker_push_pull(sparseps_worker* worker, float* grad, float* params, size_t n,
                              char* err, size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  if ((grad == nullptr || params == nullptr) && n > 0)
    return Missing("grad or params", err, err_len);
  return Guard(
      [&] { worker->worker.PushPull(std::span<float>(grad, n), std::span<float>(params, n)); }, err,
      err_len);
}

int sparseps_worker_synchronize(sparseps_worker* worker, float* params, size_t n, char* err,
                                size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  if (params == nullptr && n > 0) return Missing("params", err, err_len);
  return Guard([&] { worker->worker.Synchronize(std::span<float>(params, n)); }, err, err_len);
}

int sparseps_worker_set_epoch(sparseps_worker* worker, uint32_t epoch, char* err, size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  return Guard([&] { worker->worker.SetEpoch(epoch); }, err, err_len);
}

int sparseps_worker_finish(sparseps_worker* worker, double test_accuracy, double train_loss,
                           double samples_per_s, double train_s, char* err, size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  return Guard([&] { worker->worker.Finish(test_accuracy, train_loss, samples_per_s, train_s); },
               err, err_len);
}

int sparseps_worker_rank(const sparseps_worker* w) { return w != nullptr ? w->worker.rank() : -1; }
int sparseps_worker_num_workers(const sparseps_worker* w) {
  return w != nullptr ? w->worker.num_workers() : 0;
}
int sparseps_worker_is_leader(const sparseps_worker* w) {
  return w != nullptr && w->worker.is_leader() ? 1 : 0;
}
size_t sparseps_worker_num_params(const sparseps_worker* w) {
  return w != nullptr ? w->worker.num_params() : 0;
}
uint64_t sparseps_worker_step(const sparseps_worker* w) {
  return w != nullptr ? w->worker.step() : 0;
}
double sparseps_worker_lr(const sparseps_worker* w) { return w != nullptr ? w->worker.lr() : 0.0; }
uint64_t sparseps_worker_bytes_sent(const sparseps_worker* w) {
  return w != nullptr ? w->worker.bytes_sent() : 0;
}
uint64_t sparseps_worker_bytes_received(const sparseps_worker* w) {
  return w != nullptr ? w->worker.bytes_received() : 0;
}

}  // extern "C"
