// The worker daemon: data, model, training loop with compressed pushes to the servers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/config.pb.h"

namespace sparseps {

// Indices of the training samples worker `rank` of `num_workers` owns: a permutation of
// [0, num_samples) fixed by `seed`, dealt round-robin. Shards are disjoint and cover every sample.
std::vector<uint32_t> ShardIndices(size_t num_samples, uint64_t seed, int rank, int num_workers);

// Iterations per epoch, the same on every worker so that BSP lines up:
// floor((num_samples / num_workers) / batch_size).
uint64_t StepsPerEpoch(size_t num_samples, int num_workers, size_t batch_size);

// The device a worker trains on for train.device = `requested`: cpu stays cpu; auto is cuda when a
// CUDA device answers and the GPU training path is built, else cpu, with *detail saying why;
// cuda fails with FailedPrecondition naming the reason (no CUDA in this build, no driver or
// device, or no GPU training path yet: so far only the kernels in kernels/cuda exist).
Result<proto::Device> ResolveDevice(proto::Device requested, std::string* detail);

// Runs one worker: loads the data, registers (reporting the model size), initialises the servers
// (rank 0), trains for train.epochs (or train.max_steps) with BSP push/pull, evaluates on the
// test set (rank 0), writes <run.dir>/metrics-worker-<rank>.csv (and eval-worker-0.csv), reports
// DONE and waits for the scheduler's SHUTDOWN.
Status RunWorker(const proto::JobConfig& config);

}  // namespace sparseps
