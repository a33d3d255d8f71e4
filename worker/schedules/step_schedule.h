// How one iteration of PS mode goes, a type per schedule (train.overlap, the encoding's rounds):
//   WholeStep     compress the whole gradient, push every key range, pull, apply (plain BSP,
//                 ssp, async; SBC's local steps between pushes);
//   TwoRoundStep  the count sketch's second round: sketches, the servers' candidates, their exact
//                 values, then the pull (compression.sketch.second_round);
//   DelayedStep   one iteration in flight: the pull is applied at the next step's start
//                 (train.overlap: delay, after train.delay_warmup_steps), around either of those;
//   RangeStep     each key range compressed and pushed as soon as the backward pass finished it,
//                 from a thread of its own (train.overlap: backward; on the host, or on the
//                 device with the encoding's device compressor per range).
// The PS aggregator (ps_aggregator.cc) holds what every schedule shares (the client, the
// parameters, where the model computes: model_copy.h, the iteration counter) and keeps the books
// after a step: the iteration, a checkpoint due, the model's copy told.
//
// Thread-safety: one thread, but RangeStep's GradientReady (any thread).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "encodings/compressor.h"
#include "proto/config.pb.h"
#include "storage/checkpoint.h"
#include "worker/aggregator.h"
#include "worker/ps_client.h"
#include "worker/schedules/model_copy.h"

namespace sparseps {

// What a schedule works on, owned by the PS aggregator, which outlives the schedule.
struct PsStepContext {
  const proto::JobConfig* config = nullptr;
  PsClient* ps = nullptr;
  std::vector<float>* params = nullptr;  // the job's parameters (host)
  // Where the model computes (the job's parameters, or SBC's local copy): made after the
  // schedule, read at each step.
  const std::unique_ptr<ModelCopy>* model = nullptr;
  int64_t* push_round = nullptr;  // the iteration the next push is of
  // The model's parameters on the device (a model on the device: weight decay reads them where
  // a schedule adds it on the device; synced before each step's forward pass). Null on the host.
  DeviceBuffer* params_d = nullptr;
};

// How a step ended.
enum class StepEnd {
  kLocal,     // an SBC local step: nothing was sent
  kApplied,   // pushed, and the pulled parameters are applied
  kInFlight,  // pushed; applied by AwaitInFlight (DelayedStep)
};

class StepSchedule {
 public:
  virtual ~StepSchedule() = default;

  // One iteration of `grad` (num_params floats; device memory when on_device, which only a
  // schedule whose takes_device_gradient() is true gets), weight decay already in (but for
  // RangeStep, which adds it range by range). `trained`: where an SBC local step trains. Fills
  // *stats (encode_ms, comm_ms, push_ms, pull_ms, selected, ranges). Errors: the compression's
  // (NaN/Inf: InvalidArgument) and the communication's.
  virtual Result<StepEnd> Step(float* grad, bool on_device, float* trained, StepStats* stats) = 0;

  // DelayedStep: waits for the iteration in flight and applies it (*applied then true). Others:
  // nothing in flight.
  virtual Status AwaitInFlight(StepStats* stats, bool* applied) {
    *applied = false;
    return Status::OK();
  }

  // RangeStep: see Aggregator::BeginStep and GradientReady. Others: false, nothing.
  virtual bool BeginStep(float* grad) { return false; }
  virtual void GradientReady(size_t key_begin) {}
  virtual bool overlaps() const { return false; }
  // True when Step leaves its iteration in flight (DelayedStep past its warm-up).
  virtual bool delays() const { return false; }

  // The compressors' part of a checkpoint, their warm-up epoch, their residuals (num_params
  // floats), and the keys the pulls changed (begin: the range's first key; keys relative to it).
  virtual void State(StateArchive& archive) = 0;
  virtual void SetEpoch(uint32_t epoch) = 0;
  // The adaptive density's scale for the compressors (Compressor::SetDensityScale).
  virtual void SetDensityScale(double scale) = 0;
  virtual Status ReadResidual(std::vector<float>* out) = 0;
  virtual void OnChanged(uint64_t begin, std::span<const uint32_t> keys,
                         std::span<const float> delta) = 0;
  // The compression runs on the device (a device gradient stays there).
  virtual bool takes_device_gradient() const { return false; }
  // SBC: the model trains a local copy between pushes.
  virtual bool trains_local_copy() const = 0;
};

// The schedule for ctx's job: RangeStep for train.overlap: backward (a model on the device: with
// a device compressor per key range where the encoding has one and trains no local copy; else it
// pushes after the backward pass, logged), else WholeStep or TwoRoundStep (the sketch's second
// round), inside a DelayedStep for train.overlap: delay. A model on the device gets the
// encoding's device compressor where it has one. Errors: device memory for those compressors.
Result<std::unique_ptr<StepSchedule>> MakeStepSchedule(const PsStepContext& ctx,
                                                       bool model_on_device);

}  // namespace sparseps
