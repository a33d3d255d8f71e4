#include "worker/trainer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "common/control_client.h"
#include "common/daemon.h"
#include "common/metrics.h"
#include "kernels/device.h"
#include "kernels/error_feedback.h"
#include "worker/collectives/collective.h"
#include "worker/collectives/ring.h"
#include "worker/compressor.h"
#if SPARSEPS_HAVE_CUDA
#include "worker/cuda/gpu_compressor.h"
#endif
#include "worker/device_buffer.h"
#include "worker/idx_reader.h"
#include "worker/model.h"
#include "worker/ps_client.h"

namespace sparseps {
namespace {

// Fisher-Yates with a 64-bit generator: the same order on every machine for the same seed.
void Shuffle(std::vector<uint32_t>* v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = v->size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(rng() % i);
    std::swap((*v)[i - 1], (*v)[j]);
  }
}

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// collective.measure_quality: the share of the squared L2 mass of the exact global top-K of
// `sum` (the dense sum of the workers' contributions, K = entries applied) that the update's keys
// hold. 1 for a dense update or an empty sum.
double TopKMassShare(const std::vector<float>& sum, const CollectiveUpdate& update) {
  if (update.dense || update.indices.empty()) return 1.0;
  double applied = 0.0;
  for (uint32_t key : update.indices) applied += double{sum[key]} * sum[key];
  std::vector<float> sq(sum.size());
  for (size_t i = 0; i < sum.size(); ++i) sq[i] = sum[i] * sum[i];
  const size_t k = std::min(update.indices.size(), sq.size());
  std::nth_element(sq.begin(), sq.begin() + static_cast<std::ptrdiff_t>(k - 1), sq.end(),
                   std::greater<float>());
  double best = 0.0;
  for (size_t i = 0; i < k; ++i) best += sq[i];
  return best > 0.0 ? applied / best : 1.0;
}

}  // namespace

Result<proto::Device> ResolveDevice(proto::Device requested, std::string* detail) {
  detail->clear();
  if (requested == proto::CPU) return proto::CPU;
  std::string why;
  if (kernels::CudaDeviceAvailable(&why)) {
    *detail = std::string("train.device: ") + (requested == proto::AUTO ? "auto chose " : "") +
              "cuda: " + why;
    return proto::CUDA;
  }
  if (requested == proto::AUTO) {
    *detail = "train.device: auto chose cpu: " + why;
    return proto::CPU;
  }
  return Status::FailedPrecondition("train.device: cuda, but " + why +
                                    " (use train.device: cpu or auto)");
}

std::vector<uint32_t> ShardIndices(size_t num_samples, uint64_t seed, int rank, int num_workers) {
  std::vector<uint32_t> perm(num_samples);
  for (size_t i = 0; i < num_samples; ++i) perm[i] = static_cast<uint32_t>(i);
  Shuffle(&perm, seed);
  std::vector<uint32_t> mine;
  for (size_t i = static_cast<size_t>(rank); i < num_samples;
       i += static_cast<size_t>(num_workers)) {
    mine.push_back(perm[i]);
  }
  return mine;
}

uint64_t StepsPerEpoch(size_t num_samples, int num_workers, size_t batch_size) {
  return (num_samples / static_cast<size_t>(num_workers)) / batch_size;
}

Status RunWorker(const proto::JobConfig& config) {
  const auto& tc = config.train();
  const int num_workers = static_cast<int>(config.cluster().num_workers());
  std::string device_detail;
  auto device = ResolveDevice(tc.device(), &device_detail);
  if (!device.ok()) return device.status();
  if (!device_detail.empty()) spdlog::info("{}", device_detail);
  auto train = LoadIdxSplit(config.data().dir(), "train", config.data().max_train_samples());
  if (!train.ok()) return train.status();
  auto test = LoadIdxSplit(config.data().dir(), "t10k", config.data().max_test_samples());
  if (!test.ok()) return test.status();
  const uint64_t steps_per_epoch = StepsPerEpoch(train->num_samples, num_workers, tc.batch_size());
  if (steps_per_epoch == 0) {
    return Status::InvalidArgument("train.batch_size " + std::to_string(tc.batch_size()) +
                                   " is larger than a worker's share of " +
                                   std::to_string(train->num_samples / num_workers) + " samples");
  }
  auto made_model = MakeModel(config.model(), *train, *device);
  if (!made_model.ok()) return made_model.status();
  Model& model = **made_model;
  const size_t n = model.num_params();

  zmq::context_t context(1);
  ControlClient control(context, config, proto::WORKER);
  // Allreduce mode: the workers' own data port, bound before registering so the scheduler can
  // hand it to the peers.
  const bool allreduce = config.aggregation() == proto::ALLREDUCE;
  std::unique_ptr<PeerGroup> group;
  if (allreduce) {
    auto bound = PeerGroup::Bind(context, config.node().host(), config.collective().port(),
                                 config.cluster().request_timeout_s());
    if (!bound.ok()) return bound.status();
    group = std::move(*bound);
  }
  // Everything after registration reports its failure to the scheduler, which ends the job at
  // once naming this worker and the cause.
  Status result = [&]() -> Status {
    SPARSEPS_RETURN_IF_ERROR(control.Register(config.node().host(), group ? group->port() : 0, n));
    SPARSEPS_RETURN_IF_ERROR(control.WaitForMembership());
    const int rank = control.rank();
    SetLogName("worker-" + std::to_string(rank));
    control.StartHeartbeats();

    PsClient ps(context, control.membership(), rank, &control,
                config.cluster().request_timeout_s());
    std::unique_ptr<Collective> collective;
    std::vector<float> params(n, 0.0f);
    const auto init_start = Clock::now();
    if (allreduce) {
      // Every worker starts from the same seeded weights; the collective keeps them equal.
      std::vector<PeerGroup::PeerAddress> peers(static_cast<size_t>(num_workers));
      for (const auto& node : control.membership().nodes()) {
        if (node.role() == proto::WORKER && node.rank() >= 0 && node.rank() < num_workers) {
          peers[static_cast<size_t>(node.rank())] = {node.host(), node.port()};
        }
      }
      group->Connect(rank, peers);
      group->SetPollHook([&] { return control.Poll(); }, &control.socket());
      auto made = MakeCollective(config, group.get(), n);
      if (!made.ok()) return made.status();
      collective = std::move(*made);
      model.InitParams(tc.seed(), params.data());
      SPARSEPS_RETURN_IF_ERROR(control.Barrier("init", proto::WORKER));
    } else {
      if (rank == 0) {
        model.InitParams(tc.seed(), params.data());
        SPARSEPS_RETURN_IF_ERROR(ps.Init(params.data()));
      }
      SPARSEPS_RETURN_IF_ERROR(control.Barrier("init", proto::WORKER));
      SPARSEPS_RETURN_IF_ERROR(ps.PullInitial(params.data()));
    }
    auto bytes_sent = [&] { return collective ? collective->bytes_sent() : ps.bytes_sent(); };
    auto bytes_received = [&] {
      return collective ? collective->bytes_received() : ps.bytes_received();
    };
    // Allreduce mode: DGC momentum correction on the worker (u = m u + g; acc += u); the
    // collective takes acc and leaves the residual in it; params -= lr / W * update; u is zeroed
    // where the update applied (momentum factor masking) by the sparse collectives.
    std::vector<float> velocity, acc, probe;
    CollectiveUpdate update;
    const bool measure_quality = allreduce && config.collective().measure_quality();
    const bool aggregated_momentum = config.collective().momentum() == proto::AGGREGATED;
    uint64_t probe_tag = uint64_t{1} << 63;  // tags of the diagnostic ring, apart from the others
    if (allreduce) {
      velocity.assign(n, 0.0f);
      acc.assign(n, 0.0f);
    }
    const float momentum = static_cast<float>(tc.momentum());
    const float step_scale = static_cast<float>(tc.lr()) / static_cast<float>(num_workers);
    // GPU models compute on device copies of the parameters and the gradient. The device copy
    // of the parameters is kept up to date by uploading only what changed: the keys of each
    // pull reply or sparse update (everything after a dense one). With a device compressor (PS
    // mode: topk, sbc, sketch) the gradient stays there and only the
    // encoded payload's parts come down; otherwise it comes down whole and the CPU compressor or
    // collective takes it.
    const bool on_gpu = model.on_device();
    DeviceBuffer params_d, grad_d, eval_d;
    ChangedKeys changed(n);
    if (on_gpu) {
      SPARSEPS_RETURN_IF_ERROR(params_d.Allocate(n));
      SPARSEPS_RETURN_IF_ERROR(grad_d.Allocate(n));
    }
    spdlog::info(
        "model: {}, {} parameters; {} training samples on this worker, {} steps per epoch; "
        "initialised in {:.2f} s",
        model.Describe(), n, train->num_samples / num_workers, steps_per_epoch,
        SecondsSince(init_start));

    const std::string& dir = config.run().dir();
    CsvWriter metrics, evals;
    SPARSEPS_RETURN_IF_ERROR(
        metrics.Open(dir.empty() ? "" : dir + "/metrics-worker-" + std::to_string(rank) + ".csv",
                     {"step", "epoch", "loss", "bytes_sent", "bytes_received", "selected",
                      "compute_ms", "encode_ms", "comm_ms", "wall_s", "applied", "topk_mass"}));
    if (rank == 0) {
      SPARSEPS_RETURN_IF_ERROR(
          evals.Open(dir.empty() ? "" : dir + "/eval-worker-0.csv",
                     {"epoch", "step", "wall_s", "test_loss", "test_accuracy", "train_s"}));
    }

    std::vector<uint32_t> shard = ShardIndices(train->num_samples, tc.seed(), rank, num_workers);
    std::unique_ptr<Compressor> compressor;
#if SPARSEPS_HAVE_CUDA
    if (on_gpu && !allreduce) {
      auto made = MakeGpuCompressor(n, config.compression(), momentum, static_cast<float>(tc.lr()));
      if (!made.ok()) return made.status();
      compressor = std::move(*made);
    }
#endif
    if (!compressor) compressor = MakeCompressor(config, n);
    // Allreduce mode on a GPU: the contribution (momentum correction, residual) stays on the
    // device and the collective's operations run there, so only what the collective needs comes
    // to the host (the selected entries for TopK-AllGather, gTop-k and ExDyna).
    bool gpu_contribution = false;
#if SPARSEPS_HAVE_CUDA
    std::unique_ptr<GpuContribution> contribution_d;
    if (on_gpu && collective) {
      auto made = GpuContribution::Make(n, config.compression().selection(),
                                        config.compression().sample_ratio(), collective->k(),
                                        momentum, aggregated_momentum);
      if (!made.ok()) return made.status();
      contribution_d = std::move(*made);
      gpu_contribution = true;
    }
#endif
    const bool grad_on_device = compressor->on_device() || gpu_contribution;
    if (on_gpu && collective) {
      spdlog::info("allreduce contribution on the GPU ({})",
                   config.collective().algorithm() == proto::TOPK_ALLGATHER ||
                           config.collective().algorithm() == proto::GTOPK ||
                           config.collective().algorithm() == proto::EXDYNA
                       ? "only the selected entries come to the host"
                       : "this collective takes all of it to the host");
    } else if (on_gpu) {
      spdlog::info("compression on the {}", grad_on_device
                                                ? "GPU (only the encoded payload comes to the host)"
                                                : "CPU (the gradient comes to the host)");
    }
    ps.set_changed_callback([&](uint64_t begin, std::span<const uint32_t> keys) {
      compressor->OnChanged(begin, keys);
      if (on_gpu) changed.Add(begin, keys);
    });
    // SBC trains a local copy between pushes (on the device with the device compressor, else on
    // the host); the pulled parameters replace it after each push.
    const bool local_copy = config.compression().encoding() == proto::SBC;
    std::vector<float> local;
    if (local_copy) local = params;
    float* model_params = local_copy ? local.data() : params.data();
    int64_t push_round = 0;
    const auto& sk = config.compression().sketch();
    const bool two_rounds = config.compression().encoding() == proto::SKETCH && sk.second_round() &&
                            !sk.server_momentum();
    const size_t batch = tc.batch_size();
    const size_t features = train->num_features;
    std::vector<float> xb(batch * features), grad(n);
    std::vector<uint8_t> yb(batch);
    std::vector<Message> pushes;

    uint64_t total_steps = tc.epochs() * steps_per_epoch;
    if (tc.max_steps() > 0) total_steps = std::min<uint64_t>(total_steps, tc.max_steps());
    const uint32_t epochs =
        static_cast<uint32_t>((total_steps + steps_per_epoch - 1) / steps_per_epoch);
    const float wd = static_cast<float>(tc.weight_decay());

    const auto train_start = Clock::now();
    auto last_progress = train_start;
    uint64_t progress_steps = 0;
    double progress_loss = 0.0, epoch_loss = 0.0, last_loss = 0.0;
    double test_accuracy = -1.0;
    uint64_t step = 0;
    uint32_t epochs_done = 0;
    double eval_s = 0.0;  // time spent evaluating, left out of train_s
    auto evaluate = [&](uint32_t epoch) -> Status {
      const auto e0 = Clock::now();
      const float* eval_params = params.data();
      if (on_gpu && local_copy) {
        // params_d holds SBC's local copy: the global parameters go to a buffer of their own.
        if (eval_d.size() != n) SPARSEPS_RETURN_IF_ERROR(eval_d.Allocate(n));
        SPARSEPS_RETURN_IF_ERROR(eval_d.Upload(params.data()));
        eval_params = eval_d.data();
      } else if (on_gpu) {
        SPARSEPS_RETURN_IF_ERROR(SyncToDevice(params.data(), &changed, &params_d));
        eval_params = params_d.data();
      }
      auto [loss, acc] = model.Evaluate(eval_params, *test);
      SPARSEPS_RETURN_IF_ERROR(model.status());
      test_accuracy = acc;
      const double wall = SecondsSince(train_start);
      evals.Row({static_cast<double>(epoch), static_cast<double>(step), wall, loss, acc,
                 wall - eval_s - SecondsSince(e0)});
      eval_s += SecondsSince(e0);
      spdlog::info("eval epoch {} step {}: test loss {:.4f}, test accuracy {:.2f}%", epoch, step,
                   loss, 100.0 * acc);
      return Status::OK();
    };

    for (uint32_t epoch = 0; epoch < epochs && step < total_steps; ++epoch) {
      Shuffle(&shard,
              tc.seed() ^ (0x9e3779b97f4a7c15ULL * (epoch + 1)) ^ static_cast<uint64_t>(rank));
      compressor->SetEpoch(epoch);
      if (collective) {
        collective->set_k(WarmupK(config.compression().density(),
                                  config.compression().warmup_epochs(), epoch, n));
      }
      epoch_loss = 0.0;
      uint64_t epoch_steps = 0;
      for (uint64_t s = 0; s < steps_per_epoch && step < total_steps; ++s, ++step) {
        const auto t0 = Clock::now();
        for (size_t b = 0; b < batch; ++b) {
          const uint32_t idx = shard[s * batch + b];
          std::copy_n(train->images.data() + size_t{idx} * features, features,
                      xb.data() + b * features);
          yb[b] = train->labels[idx];
        }
        double loss = 0.0;
        if (on_gpu) {
          // A local copy trained on the host goes up whole; otherwise what changed goes up.
          if (local_copy && !grad_on_device) changed.AddAll();
          SPARSEPS_RETURN_IF_ERROR(SyncToDevice(model_params, &changed, &params_d));
          loss = model.ForwardBackward(params_d.data(), xb.data(), yb.data(), batch, grad_d.data(),
                                       nullptr);
          SPARSEPS_RETURN_IF_ERROR(model.status());
          if (grad_on_device) {
            if (wd > 0) SPARSEPS_RETURN_IF_ERROR(grad_d.Axpy(wd, params_d));
          } else {
            SPARSEPS_RETURN_IF_ERROR(grad_d.Download(grad.data()));
          }
        } else {
          loss = model.ForwardBackward(model_params, xb.data(), yb.data(), batch, grad.data(),
                                       nullptr);
        }
        // A NaN/Inf gradient is caught by the compressor (one pass over it, not two).
        if (!std::isfinite(loss)) {
          return Status::FailedPrecondition("the loss became NaN/Inf at step " +
                                            std::to_string(step) + " (try a smaller train.lr)");
        }
        if (wd > 0 && !grad_on_device) kernels::Axpy(wd, model_params, grad.data(), n);
        const auto t1 = Clock::now();
        const uint64_t sent0 = bytes_sent(), recv0 = bytes_received();
        auto t2 = t1;
        double topk_mass = -1.0;  // collective.measure_quality only
        if (gpu_contribution) {
#if SPARSEPS_HAVE_CUDA
          if (Status a = contribution_d->Accumulate(grad_d.data()); !a.ok()) {
            return Status::FailedPrecondition(a.message() + " at step " + std::to_string(step) +
                                              " (try a smaller train.lr)");
          }
          if (measure_quality) {
            probe.resize(n);
            SPARSEPS_RETURN_IF_ERROR(contribution_d->Read(probe.data(), /*zero=*/false));
            SPARSEPS_RETURN_IF_ERROR(RingAllreduce(group.get(), probe_tag, probe.data(), n,
                                                   config.collective().segment_bytes() / 4));
            probe_tag += uint64_t{1} << 32;
          }
          t2 = Clock::now();
          SPARSEPS_RETURN_IF_ERROR(collective->Allreduce(contribution_d.get(), &update));
          if (!aggregated_momentum && !update.dense) {
            SPARSEPS_RETURN_IF_ERROR(contribution_d->MaskMomentum(update.indices));
          }
#endif
        } else if (collective) {
          if (!kernels::AllFinite(grad.data(), n)) {
            return Status::FailedPrecondition("the gradient holds NaN or Inf at step " +
                                              std::to_string(step) + " (try a smaller train.lr)");
          }
          if (aggregated_momentum) {
            kernels::Axpy(1.0f, grad.data(), acc.data(), n);
          } else {
            kernels::MomentumCorrection(velocity.data(), acc.data(), grad.data(), momentum, n);
          }
          if (measure_quality) {
            probe = acc;
            SPARSEPS_RETURN_IF_ERROR(RingAllreduce(group.get(), probe_tag, probe.data(), n,
                                                   config.collective().segment_bytes() / 4));
            probe_tag += uint64_t{1} << 32;
          }
          t2 = Clock::now();
          SPARSEPS_RETURN_IF_ERROR(collective->Allreduce(&acc, &update));
        }
        if (collective) {
          if (measure_quality) topk_mass = TopKMassShare(probe, update);
          if (aggregated_momentum) {
            // v = m v + update; params -= lr / W v (dense: v decays everywhere).
            kernels::Scale(momentum, velocity.data(), n);
            if (update.dense) {
              kernels::Axpy(1.0f, update.sum.data(), velocity.data(), n);
            } else {
              kernels::ScatterAdd(velocity.data(), update.indices.data(), update.values.data(),
                                  update.indices.size());
            }
            kernels::Axpy(-step_scale, velocity.data(), params.data(), n);
            changed.AddAll();
          } else if (update.dense) {
            kernels::Axpy(-step_scale, update.sum.data(), params.data(), n);
            changed.AddAll();
          } else {
            for (size_t e = 0; e < update.indices.size(); ++e) {
              params[update.indices[e]] -= step_scale * update.values[e];
              velocity[update.indices[e]] = 0.0f;
            }
            if (on_gpu) changed.Add(0, update.indices);
          }
        } else if (compressor->LocalStep(grad_on_device ? grad_d.data() : grad.data(),
                                         grad_on_device ? params_d.data() : model_params)) {
          pushes.clear();
          if (Status c = compressor->Compress(grad_on_device ? grad_d.data() : grad.data(),
                                              ps.ranges(), &pushes);
              !c.ok()) {
            return Status::FailedPrecondition(c.message() + " at step " + std::to_string(step) +
                                              " (try a smaller train.lr)");
          }
          t2 = Clock::now();
          if (two_rounds) {
            SPARSEPS_RETURN_IF_ERROR(ps.SketchTwoRounds(
                push_round++, pushes,
                [&](size_t r, std::span<const uint32_t> candidates, Message* push) {
                  return compressor->ExactValues(ps.ranges()[r], candidates, push);
                },
                params.data()));
          } else {
            SPARSEPS_RETURN_IF_ERROR(ps.PushPull(push_round++, pushes, params.data()));
          }
          if (local_copy) {
            std::copy(params.begin(), params.end(), local.begin());
            changed.AddAll();
          }
        }
        const auto t3 = Clock::now();
        metrics.Row(
            {static_cast<double>(step + 1), static_cast<double>(epoch + 1), loss,
             static_cast<double>(bytes_sent() - sent0),
             static_cast<double>(bytes_received() - recv0),
             static_cast<double>(collective ? collective->last_selected()
                                            : compressor->last_selected()),
             Ms(t0, t1), Ms(t1, t2), Ms(t2, t3), SecondsSince(train_start),
             // Entries applied this step (allreduce: the update's size; -1 in PS mode,
             // where the servers apply).
             collective ? static_cast<double>(update.dense ? n : update.indices.size()) : -1.0,
             topk_mass});
        epoch_loss += loss;
        ++epoch_steps;
        if (rank == 0 && tc.eval_every_steps() > 0 && (step + 1) % tc.eval_every_steps() == 0 &&
            step + 1 < total_steps) {
          ++step;  // the row names the number of steps done
          SPARSEPS_RETURN_IF_ERROR(evaluate(epoch + 1));
          --step;
        }
        progress_loss += loss;
        ++progress_steps;
        last_loss = loss;
        const double since = std::chrono::duration<double>(t3 - last_progress).count();
        if (rank == 0 && since >= config.run().progress_interval_s()) {
          // loss: the mean since the previous line; test_acc: the last evaluation's; samples/s:
          // the cluster's since the previous line; MB: this worker's totals so far.
          spdlog::info(
              "progress epoch {}/{} step {}/{} loss {:.4f} test_acc {} cluster {:.0f} samples/s, "
              "this worker sent {:.2f} MB and received {:.2f} MB in all",
              epoch + 1, epochs, step + 1, total_steps, progress_loss / progress_steps,
              test_accuracy < 0 ? std::string("n/a") : fmt::format("{:.2f}%", 100 * test_accuracy),
              static_cast<double>(progress_steps * batch * num_workers) / since, bytes_sent() / 1e6,
              bytes_received() / 1e6);
          last_progress = t3;
          progress_steps = 0;
          progress_loss = 0.0;
        }
      }
      if (epoch_steps > 0) last_loss = epoch_loss / static_cast<double>(epoch_steps);
      epochs_done = epoch + 1;
      const uint32_t every = tc.eval_every_epochs();
      if (rank == 0 && every > 0 && epochs_done % every == 0 && step < total_steps) {
        SPARSEPS_RETURN_IF_ERROR(evaluate(epochs_done));
      }
    }
    const double train_s = SecondsSince(train_start);
    if (rank == 0) SPARSEPS_RETURN_IF_ERROR(evaluate(epochs_done));

    proto::WorkerStats stats;
    stats.set_steps(step);
    stats.set_epochs(epochs_done);
    stats.set_bytes_sent(bytes_sent());
    stats.set_bytes_received(bytes_received());
    stats.set_final_test_accuracy(test_accuracy);
    stats.set_final_train_loss(last_loss);
    stats.set_wall_s(train_s);
    stats.set_samples_per_s(static_cast<double>(step * batch) / std::max(train_s, 1e-9));
    spdlog::info(
        "training done: {} steps in {:.1f} s, {:.0f} samples/s on this worker, sent {:.0f} B/step, "
        "received {:.0f} B/step{}",
        step, train_s, stats.samples_per_s(),
        step ? static_cast<double>(bytes_sent()) / static_cast<double>(step) : 0.0,
        step ? static_cast<double>(bytes_received()) / static_cast<double>(step) : 0.0,
        rank == 0 ? fmt::format(", final test accuracy {:.2f}%", 100 * test_accuracy) : "");
    SPARSEPS_RETURN_IF_ERROR(control.SendDone(stats));
    Status s = control.WaitFor([&] { return control.shutdown_requested(); },
                               config.cluster().request_timeout_s(), "SHUTDOWN from the scheduler");
    control.StopHeartbeats();
    return s;
  }();
  control.ReportFailure(result);
  return result;
}

}  // namespace sparseps
