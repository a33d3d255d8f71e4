// The worker daemon: data, model, training loop with compressed pushes to the servers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/config.h"
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

// The CUDA device ordinal a worker process computes on, for train.cuda_device = `configured`
// among `count` devices (count >= 1): `configured` when >= 0; for -1 the host's local rank
// modulo count (several workers share a GPU when they outnumber them), the local rank read
// through `env` (null: the process's) from SPARSEPS_LOCAL_RANK, LOCAL_RANK,
// OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID, the first one set; 0 without any. *detail says
// which and why ("GPU 1 of 4: local rank 1 (LOCAL_RANK)"). Errors: InvalidArgument naming
// train.cuda_device for an ordinal >= count, or the variable for a value that is not a
// non-negative integer.
Result<int> PickCudaDevice(int configured, int count, std::string* detail,
                           const EnvLookup& env = nullptr);

// Runs one worker: loads the data, registers (reporting the model size), initialises the servers
// (rank 0), trains for train.epochs (or train.max_steps) with BSP push/pull, evaluates on the
// test set (rank 0), writes <run.dir>/metrics-worker-<rank>.csv (and eval-worker-0.csv), reports
// DONE and waits for the scheduler's SHUTDOWN.
Status RunWorker(const proto::JobConfig& config);

}  // namespace sparseps
