// The C interface (include/sparseps/sparseps.h) over the C++ Worker (include/sparseps/client.h):
// every exception becomes a code and a message, nothing crosses the boundary.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "sparseps/client.h"
#include "sparseps/sparseps.h"

struct sparseps_worker {
  sparseps::client::Worker worker;
  sparseps::client::SparseUpdate sparse;      // the last sparse step's result
  sparseps::client::Worker::Handoff handoff;  // the last hand-over received
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
      case sparseps::client::ErrorCode::kInterrupted:
        return Fail(SPARSEPS_INTERRUPTED, e.what(), err, err_len);
      case sparseps::client::ErrorCode::kRolledBack:
        return Fail(SPARSEPS_ROLLED_BACK, e.what(), err, err_len);
      case sparseps::client::ErrorCode::kLost:
        return Fail(SPARSEPS_LOST, e.what(), err, err_len);
      case sparseps::client::ErrorCode::kJobEnded:
        return Fail(SPARSEPS_JOB_ENDED, e.what(), err, err_len);
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

// call(state, model) for a loop's state (state_n bytes) and model (model_n floats), each NULL
// only when empty.
template <typename F>
int WithStateAndModel(sparseps_worker* worker, const uint8_t* state, size_t state_n,
                      const float* model, size_t model_n, char* err, size_t err_len, F&& call) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  if (state == nullptr && state_n > 0) return Missing("state", err, err_len);
  if (model == nullptr && model_n > 0) return Missing("model", err, err_len);
  return Guard(
      [&] {
        call(std::span<const uint8_t>(state, state_n), std::span<const float>(model, model_n));
      },
      err, err_len);
}

// count C buffers as the client library's; false when one has no memory.
bool Buffers(const sparseps_buffer* in, size_t count, std::vector<sparseps::client::Buffer>* out) {
  if (in == nullptr && count > 0) return false;
  for (size_t i = 0; i < count; ++i) {
    if (in[i].data == nullptr && in[i].size > 0) return false;
    out->push_back({in[i].data, in[i].size, in[i].device});
  }
  return true;
}

// Copies `from` (of `what`) into out (n elements), which must match its size.
int CopyOut(const std::vector<float>& from, const char* what, float* out, size_t n, char* err,
            size_t err_len) {
  if (n != from.size()) {
    return Fail(SPARSEPS_INVALID_ARGUMENT,
                std::string(what) + ": out has " + std::to_string(n) + " elements; the job has " +
                    std::to_string(from.size()),
                err, err_len);
  }
  if (n > 0 && out == nullptr) return Missing("out", err, err_len);
  std::copy(from.begin(), from.end(), out);
  if (err != nullptr && err_len > 0) err[0] = '\0';
  return SPARSEPS_OK;
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
            sparseps::client::Worker(config_path != nullptr ? config_path : "", sets, rank),
            {},
            {}};
      },
      err, err_len);
}

void sparseps_worker_free(sparseps_worker* worker) { delete worker; }

int sparseps_cuda_build(void) { return sparseps::client::CudaBuild() ? 1 : 0; }
int sparseps_device_of(const void* pointer) { return sparseps::client::DeviceOf(pointer); }

int sparseps_worker_init_buffers(sparseps_worker* worker, const sparseps_buffer* params,
                                 size_t count, const char* const* names, char* err,
                                 size_t err_len) {
  // Each buffer a vector of its size.
  std::vector<size_t> ndims(count, 1);
  std::vector<uint64_t> dims(count);
  for (size_t i = 0; params != nullptr && i < count; ++i) dims[i] = params[i].size;
  return sparseps_worker_init_tensors(worker, params, count, names, ndims.data(), dims.data(), err,
                                      err_len);
}

int sparseps_worker_init_tensors(sparseps_worker* worker, const sparseps_buffer* params,
                                 size_t count, const char* const* names, const size_t* ndims,
                                 const uint64_t* dims, char* err, size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  std::vector<sparseps::client::Buffer> buffers;
  if (!Buffers(params, count, &buffers)) return Missing("params", err, err_len);
  if (ndims == nullptr && count > 0) return Missing("ndims", err, err_len);
  std::vector<sparseps::client::TensorInfo> tensors;
  const uint64_t* next = dims;
  for (size_t i = 0; i < count; ++i) {
    if (names != nullptr && names[i] == nullptr) return Missing("a name", err, err_len);
    if (ndims[i] > 0 && dims == nullptr) return Missing("dims", err, err_len);
    // An empty name: the library's own (Init checks each shape against its buffer).
    tensors.push_back({names != nullptr ? names[i] : "", {next, next + ndims[i]}});
    next += ndims[i];
  }
  return Guard([&] { worker->worker.Init(buffers, tensors); }, err, err_len);
}

int sparseps_worker_push_pull_update(sparseps_worker* worker, const sparseps_buffer* grads,
                                     size_t count, float* update, double loss, char* err,
                                     size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  std::vector<sparseps::client::Buffer> buffers;
  if (!Buffers(grads, count, &buffers)) return Missing("grads", err, err_len);
  return Guard([&] { worker->worker.PushPull(buffers, update, loss); }, err, err_len);
}

int sparseps_worker_push_pull_sparse(sparseps_worker* worker, const sparseps_buffer* grads,
                                     size_t count, double loss, size_t* num_changed, char* err,
                                     size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  if (num_changed == nullptr) return Missing("num_changed", err, err_len);
  std::vector<sparseps::client::Buffer> buffers;
  if (!Buffers(grads, count, &buffers)) return Missing("grads", err, err_len);
  worker->sparse = {};
  const int code =
      Guard([&] { worker->sparse = worker->worker.PushPullSparse(buffers, loss); }, err, err_len);
  *num_changed = worker->sparse.update.size();  // every key after a dense step (no keys kept)
  return code;
}

int sparseps_worker_begin_step(sparseps_worker* worker, const sparseps_buffer* grad, int* begun,
                               char* err, size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  if (begun == nullptr) return Missing("begun", err, err_len);
  std::vector<sparseps::client::Buffer> buffers;
  if (!Buffers(grad, 1, &buffers)) return Missing("grad", err, err_len);
  *begun = 0;
  return Guard([&] { *begun = worker->worker.BeginStep(buffers[0]) ? 1 : 0; }, err, err_len);
}

int sparseps_worker_gradient_ready(sparseps_worker* worker, size_t key_begin, char* err,
                                   size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  return Guard([&] { worker->worker.GradientReady(key_begin); }, err, err_len);
}

int sparseps_worker_sparse_result(const sparseps_worker* worker, int64_t* keys, float* update,
                                  float* params, size_t num_changed, char* err, size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  const auto& u = worker->sparse;
  if (num_changed != u.update.size()) {
    return Fail(SPARSEPS_INVALID_ARGUMENT,
                "num_changed is " + std::to_string(num_changed) + "; the last sparse step has " +
                    std::to_string(u.update.size()),
                err, err_len);
  }
  if (keys != nullptr && u.all) {
    std::iota(keys, keys + num_changed, int64_t{0});  // a dense step: every key
  } else if (keys != nullptr) {
    std::copy(u.keys.begin(), u.keys.end(), keys);
  }
  if (update != nullptr) std::copy(u.update.begin(), u.update.end(), update);
  if (params != nullptr) std::copy(u.params.begin(), u.params.end(), params);
  if (err != nullptr && err_len > 0) err[0] = '\0';
  return SPARSEPS_OK;
}

int sparseps_worker_params(const sparseps_worker* worker, float* out, size_t n, char* err,
                           size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  std::vector<float> p;
  const int code = Guard(
      [&] {
        const auto now = worker->worker.params();
        p.assign(now.begin(), now.end());
      },
      err, err_len);
  return code != SPARSEPS_OK ? code : CopyOut(p, "params", out, n, err, err_len);
}

int sparseps_worker_residual(const sparseps_worker* worker, float* out, size_t n, char* err,
                             size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  std::vector<float> r;
  const int code = Guard([&] { r = worker->worker.residual(); }, err, err_len);
  return code != SPARSEPS_OK ? code : CopyOut(r, "residual", out, n, err, err_len);
}

int sparseps_worker_set_trained_model(sparseps_worker* worker, const float* params, size_t n,
                                      char* err, size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  if (params == nullptr && n > 0) return Missing("params", err, err_len);
  return Guard([&] { worker->worker.SetTrainedModel({params, n}); }, err, err_len);
}

int sparseps_worker_set_model_buffers(sparseps_worker* worker, size_t count,
                                      const char* const* names, const uint64_t* const* shapes,
                                      const size_t* ndims, const float* const* values, char* err,
                                      size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  if (count > 0 &&
      (names == nullptr || shapes == nullptr || ndims == nullptr || values == nullptr)) {
    return Missing("names, shapes, ndims or values", err, err_len);
  }
  using sparseps::client::Error;
  using sparseps::client::ErrorCode;
  return Guard(
      [&] {
        std::vector<sparseps::client::Worker::ModelBuffer> buffers(count);
        for (size_t i = 0; i < count; ++i) {
          auto& b = buffers[i];
          const std::string which = "set_model_buffers: buffer " + std::to_string(i);
          if (names[i] == nullptr) throw Error(ErrorCode::kInvalidArgument, which + " has no name");
          b.name = names[i];
          if (ndims[i] > 0 && shapes[i] == nullptr) {
            throw Error(ErrorCode::kInvalidArgument, which + " (" + b.name + ") has no shape");
          }
          b.shape.assign(shapes[i], shapes[i] + ndims[i]);
          uint64_t n = 1;
          for (uint64_t d : b.shape) n *= d;
          if (n > 0 && values[i] == nullptr) {
            throw Error(ErrorCode::kInvalidArgument, which + " (" + b.name + ") has no values");
          }
          b.values.assign(values[i], values[i] + n);
        }
        worker->worker.SetModelBuffers(std::move(buffers));
      },
      err, err_len);
}

int sparseps_worker_set_checkpoint_state(sparseps_worker* worker, const uint8_t* state,
                                         size_t state_n, const float* model, size_t model_n,
                                         char* err, size_t err_len) {
  return WithStateAndModel(worker, state, state_n, model, model_n, err, err_len,
                           [&](auto st, auto m) { worker->worker.SetCheckpointState(st, m); });
}

size_t sparseps_worker_checkpoint_state(const sparseps_worker* w, uint8_t* out, size_t capacity) {
  if (w == nullptr) return 0;
  const auto& s = w->worker.checkpoint_state();
  if (out != nullptr) std::copy_n(s.begin(), std::min(capacity, s.size()), out);
  return s.size();
}

int sparseps_worker_send_handoff(sparseps_worker* worker, const uint8_t* state, size_t state_n,
                                 const float* model, size_t model_n, char* err, size_t err_len) {
  return WithStateAndModel(worker, state, state_n, model, model_n, err, err_len,
                           [&](auto st, auto m) { worker->worker.SendHandoff(st, m); });
}

int sparseps_worker_receive_handoff(sparseps_worker* worker, int* from, size_t* state_n,
                                    size_t* model_n, char* err, size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  return Guard(
      [&] {
        worker->handoff = worker->worker.ReceiveHandoff();
        if (from != nullptr) *from = worker->handoff.from;
        if (state_n != nullptr) *state_n = worker->handoff.state.size();
        if (model_n != nullptr) *model_n = worker->handoff.model.size();
      },
      err, err_len);
}

size_t sparseps_worker_handoff_state(const sparseps_worker* w, uint8_t* out, size_t capacity) {
  if (w == nullptr) return 0;
  const auto& s = w->handoff.state;
  if (out != nullptr) std::copy_n(s.begin(), std::min(capacity, s.size()), out);
  return s.size();
}

size_t sparseps_worker_handoff_model(const sparseps_worker* w, float* out, size_t capacity) {
  if (w == nullptr) return 0;
  const auto& m = w->handoff.model;
  if (out != nullptr) std::copy_n(m.begin(), std::min(capacity, m.size()), out);
  return m.size();
}

size_t sparseps_worker_handoff_missing(const sparseps_worker* w, char* out, size_t out_len) {
  if (w == nullptr) return 0;
  if (out != nullptr && out_len > 0) std::snprintf(out, out_len, "%s", w->handoff.missing.c_str());
  return w->handoff.missing.size() + 1;
}

int sparseps_worker_report_evaluation(sparseps_worker* worker, double test_accuracy, char* err,
                                      size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  return Guard([&] { worker->worker.ReportEvaluation(test_accuracy); }, err, err_len);
}

int sparseps_worker_allreduce_values(sparseps_worker* worker, const double* values, size_t n,
                                     double* sums, uint32_t* contributors, char* err,
                                     size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  if (n > 0 && (values == nullptr || sums == nullptr))
    return Missing("values or sums", err, err_len);
  return Guard(
      [&] {
        const auto got =
            worker->worker.AllreduceValues(std::span<const double>(values, n), contributors);
        std::copy(got.begin(), got.end(), sums);
      },
      err, err_len);
}

int sparseps_worker_set_density_scale(sparseps_worker* worker, double scale, char* err,
                                      size_t err_len) {
  if (worker == nullptr) return Missing("worker", err, err_len);
  return Guard([&] { worker->worker.SetDensityScale(scale); }, err, err_len);
}

void sparseps_worker_set_interruptible(sparseps_worker* worker, int interruptible) {
  if (worker != nullptr) worker->worker.set_interruptible(interruptible != 0);
}

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

int sparseps_worker_resumed(const sparseps_worker* w) {
  return w != nullptr && w->worker.resumed() ? 1 : 0;
}
int sparseps_worker_rejoined(const sparseps_worker* w) {
  return w != nullptr && w->worker.rejoined() ? 1 : 0;
}
int sparseps_worker_checkpoint_due(const sparseps_worker* w) {
  return w != nullptr && w->worker.checkpoint_due() ? 1 : 0;
}
int sparseps_worker_handoff_due(const sparseps_worker* w) {
  return w != nullptr && w->worker.handoff_due() ? 1 : 0;
}
int sparseps_worker_handoff_expected(const sparseps_worker* w) {
  return w != nullptr && w->worker.handoff_expected() ? 1 : 0;
}
int sparseps_worker_allreduce(const sparseps_worker* w) {
  return w != nullptr && w->worker.allreduce() ? 1 : 0;
}
void sparseps_worker_last_step(const sparseps_worker* w, sparseps_step_counters* out) {
  if (out == nullptr) return;
  *out = {};
  out->applied = -1;
  if (w == nullptr) return;
  const auto c = w->worker.last_step();
  *out = {c.bytes_sent, c.bytes_received, c.selected, c.applied, c.encode_ms, c.comm_ms};
}
size_t sparseps_worker_live_workers(const sparseps_worker* w, int* ranks, size_t capacity) {
  if (w == nullptr) return 0;
  const auto live = w->worker.live_workers();
  for (size_t i = 0; ranks != nullptr && i < live.size() && i < capacity; ++i) ranks[i] = live[i];
  return live.size();
}
int sparseps_worker_data_split(const sparseps_worker* w, uint64_t step, int* index, int* count,
                               char* err, size_t err_len) {
  if (w == nullptr) return Missing("worker", err, err_len);
  return Guard(
      [&] {
        const auto split = w->worker.data_split(step);
        if (index != nullptr) *index = split.index;
        if (count != nullptr) *count = split.count;
      },
      err, err_len);
}
size_t sparseps_worker_config(const sparseps_worker* w, char* out, size_t out_len) {
  if (w == nullptr) return 0;
  std::string text;
  for (const auto& [key, value] : w->worker.config()) text += key + " = " + value + "\n";
  if (out != nullptr && out_len > 0) std::snprintf(out, out_len, "%s", text.c_str());
  return text.size() + 1;
}

}  // extern "C"
