// Where a PS worker's model computes between pushes, a type per case:
//   JobParamsCopy  at the job's parameters, which each pull changes key by key;
//   LocalCopy      SBC's local copy (compression.local_iterations): trained by the local steps
//                  between pushes, replaced whole by the pulled parameters after each push.
// The PS aggregator calls every hook each time; the type decides what it does.
//
// Thread-safety: one thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "worker/device_buffer.h"

namespace sparseps {

// Before the parameters the model computes at change: the keys (key_begin + keys[j]), or all.
using WillChangeFn = std::function<void(uint64_t key_begin, std::span<const uint32_t>, bool all)>;

class ModelCopy {
 public:
  // params: the job's parameters; changed: what a device copy of the model's parameters lacks;
  // will_change: the change observer's hook. All outlive the ModelCopy.
  ModelCopy(std::vector<float>* params, ChangedKeys* changed, WillChangeFn will_change)
      : params_(params), changed_(changed), will_change_(std::move(will_change)) {}
  virtual ~ModelCopy() = default;

  // The host copy the model computes at when it is not the job's parameters; null otherwise.
  virtual float* local() { return nullptr; }
  // The host copy the model computes at.
  virtual float* host() { return params_->data(); }
  // The job's parameters were set (the start, a resume, a rejoin).
  virtual void Started() {}
  // A pull changed `keys` of the job's parameters (from key_begin on).
  virtual void Pulled(uint64_t key_begin, std::span<const uint32_t> keys) {
    will_change_(key_begin, keys, false);
  }
  // A step (or a synchronising pull) begins that may change the model's parameters anywhere.
  virtual void BeforeStep() {}
  // A step's (or the synchronising) pull replies are applied.
  virtual void Applied() {}
  // Where the step's local training goes (SBC): a device copy when the compressor trains on the
  // device, else the host copy.
  float* Trained(bool on_device, DeviceBuffer* device) {
    return on_device ? device->data() : host();
  }

 protected:
  std::vector<float>* params_;
  ChangedKeys* changed_;
  WillChangeFn will_change_;
};

// The model computes at the job's parameters: what a pull changes is announced key by key.
using JobParamsCopy = ModelCopy;

// SBC's local copy: announced whole before a step, replaced by the pulled parameters after one.
class LocalCopy final : public ModelCopy {
 public:
  using ModelCopy::ModelCopy;
  float* local() override { return local_.data(); }
  float* host() override { return local_.data(); }
  void Started() override { local_ = *params_; }
  void Pulled(uint64_t, std::span<const uint32_t>) override {}  // announced by BeforeStep
  void BeforeStep() override { will_change_(0, {}, true); }
  void Applied() override {
    std::copy(params_->begin(), params_->end(), local_.begin());
    changed_->AddAll();
  }

 private:
  std::vector<float> local_;
};

}  // namespace sparseps
