// `gloo`: Gloo's dense ring allreduce over its own TCP transport (Debian libgloo-dev), the
// baseline that torch.distributed users get on CPU. Gloo's rendezvous runs over the workers'
// ZeroMQ peer group (each worker publishes its Gloo address to every peer), so no shared file
// system or Redis is needed. Gloo's traffic does not pass through our transport; its bytes are
// counted as the ring algorithm sends them: 2 (P-1)/P * 4n each way per call.
#pragma once

#include "config/config.h"
#include "worker/collectives/collective.h"

namespace sparseps {

// Connects a Gloo full mesh among the workers of `group` (Gloo binds on `host`). Errors: IoError
// with Gloo's message when the rendezvous or a connection fails (or times out after
// group->timeout_s()).
Result<std::unique_ptr<Collective>> MakeGlooCollective(PeerGroup* group, size_t num_params,
                                                       const std::string& host);

// The `gloo`: Gloo binds on options.host (MakeGlooCollective); a row of the table of collectives
// (collective.cc).
Result<std::unique_ptr<Collective>> MakeGloo(PeerGroup* group, const CollectiveOptions& options);

// Gloo's config check (its row's): not with security.curve (Gloo's TCP transport is neither
// authenticated nor encrypted). Errors: InvalidArgument naming the file, line and key.
Status CheckGlooConfig(const proto::JobConfig& job, const ConfigSources& sources);

}  // namespace sparseps
