#include "worker/collectives/gloo.h"

#include <gloo/allreduce.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <chrono>
#include <stdexcept>

namespace sparseps {
namespace {

// Gloo's rendezvous Store over the peer group. Gloo's interface has no status, so errors are
// thrown (as its own stores do) and caught at the call into Gloo.
class PeerStore final : public gloo::rendezvous::Store {
 public:
  explicit PeerStore(PeerGroup* group) : group_(group) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    Status s = group_->StoreSet(key, data);
    if (!s.ok()) throw std::runtime_error(s.ToString());
  }
  std::vector<char> get(const std::string& key) override {
    auto v = group_->StoreGet(key);
    if (!v.ok()) throw std::runtime_error(v.status().ToString());
    return *v;
  }
  void wait(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) get(k);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    wait(keys);
  }

 private:
  PeerGroup* group_;
};

class GlooCollective final : public Collective {
 public:
  GlooCollective(PeerGroup* group, size_t num_params,
                 std::shared_ptr<gloo::rendezvous::Context> context)
      : Collective(group, num_params, num_params), context_(std::move(context)) {}

  using Collective::Allreduce;
  Status Allreduce(Contribution* x, CollectiveUpdate* update) override {
    update->dense = true;
    update->sum.resize(n_);
    SPARSEPS_RETURN_IF_ERROR(x->Read(update->sum.data(), /*zero=*/true));
    if (group_->size() > 1) {
      try {
        gloo::AllreduceOptions opts(context_);
        opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
        opts.setOutput(update->sum.data(), n_);
        opts.setReduceFunction(
            static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
        opts.setTag(static_cast<uint32_t>(++calls_));
        gloo::allreduce(opts);
      } catch (const std::exception& e) {
        return Status::IoError(std::string("Gloo allreduce failed: ") + e.what());
      }
      const uint64_t p = static_cast<uint64_t>(group_->size());
      wire_bytes_ += 2 * (p - 1) * (n_ * sizeof(float)) / p;
    }
    last_selected_ = n_;
    return Status::OK();
  }
  uint64_t bytes_sent() const override { return group_->bytes_sent() + wire_bytes_; }
  uint64_t bytes_received() const override { return group_->bytes_received() + wire_bytes_; }

 private:
  std::shared_ptr<gloo::rendezvous::Context> context_;
  uint64_t wire_bytes_ = 0;
};

}  // namespace

Result<std::unique_ptr<Collective>> MakeGlooCollective(PeerGroup* group, size_t num_params,
                                                       const std::string& host) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(group->rank(), group->size());
    context->setTimeout(std::chrono::milliseconds(static_cast<int64_t>(group->timeout_s() * 1000)));
    if (group->size() > 1) {
      PeerStore store(group);
      context->connectFullMesh(store, device);
    }
    return std::unique_ptr<Collective>(new GlooCollective(group, num_params, std::move(context)));
  } catch (const std::exception& e) {
    return Status::IoError(std::string("Gloo could not connect the workers: ") + e.what());
  }
}

Result<std::unique_ptr<Collective>> MakeGloo(PeerGroup* group, const CollectiveOptions& options) {
  return MakeGlooCollective(group, options.num_params, options.host);
}

Status CheckGlooConfig(const proto::JobConfig& job, const ConfigSources& sources) {
  if (job.security().curve() && job.aggregation() == proto::ALLREDUCE &&
      job.collective().algorithm() == proto::GLOO) {
    return Status::InvalidArgument(
        SourceOf(sources, "collective.algorithm") +
        ": key 'collective.algorithm' is gloo but 'security.curve' is on: Gloo's TCP transport is "
        "neither authenticated nor encrypted, and Debian's Gloo is built without its TLS transport "
        "(GLOO_HAVE_TRANSPORT_TCP_TLS 0); use ring (dense, over our CURVE sockets) or turn CURVE "
        "off");
  }
  return Status::OK();
}

}  // namespace sparseps
