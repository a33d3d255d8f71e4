// What the aggregators (ps_aggregator.cc, allreduce_aggregator.cc) share, and how each is made.
// Internal to worker/: a training loop makes one with MakeAggregator (worker/aggregator.h).
#pragma once

#include <memory>
#include <string>
#include <zmq.hpp>

#include "transport/control_client.h"
#include "worker/aggregator.h"
#include "worker/collectives/peer_group.h"

namespace sparseps {

// Milliseconds from a to b.
inline double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The workers' barrier before the first step: named by the membership epoch, so that a worker
// that joined later (and never entered the first) meets the others at a rollback's.
inline std::string InitBarrier(const ControlClient& control) {
  return "init-" + std::to_string(control.membership().epoch());
}

// Push to the servers, pull the new parameters (PS mode): ps_aggregator.cc.
std::unique_ptr<Aggregator> MakePsAggregator(const proto::JobConfig& config,
                                             zmq::context_t& context, size_t num_params,
                                             bool model_on_device);

// The workers sum among themselves over `group` (allreduce mode): allreduce_aggregator.cc.
// `layers`: the model's tensors, for a collective that works layer by layer (powersgd).
std::unique_ptr<Aggregator> MakeAllreduceAggregator(const proto::JobConfig& config,
                                                    std::unique_ptr<PeerGroup> group,
                                                    size_t num_params, bool model_on_device,
                                                    std::vector<TensorLayout> layers);

}  // namespace sparseps
