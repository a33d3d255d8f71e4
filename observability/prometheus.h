// Live metrics for Prometheus: every daemon keeps its metrics in a prometheus-cpp registry and,
// when metrics.port is set, serves them on GET /metrics in Prometheus's text exposition format
// (prometheus-cpp's registry and text serializer; libmicrohttpd serves them: prometheus-cpp's own
// CivetWeb exposer runs its threads on 100 KB stacks, smaller than a CUDA worker's static TLS). The
// names follow Prometheus's conventions: `sparseps_<role>_<what>_<unit>`, counters end in _total,
// times are in seconds, sizes in bytes; every series carries the labels role (scheduler, server,
// worker) and rank.
//
// Thread-safety: the metrics (Counter, Gauge, Histogram) may be updated from any thread while the
// exposer's threads read them (prometheus-cpp's own locking); Add* and Start from one thread.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "proto/config.pb.h"
#include "transport/message.h"

struct MHD_Daemon;

namespace sparseps {

// The port a daemon serves its metrics on (metrics.port + offset, proto/config.proto): 0 when
// metrics are off. `role`: "scheduler", "server" or "worker"; `rank` within the role.
uint32_t MetricsPort(const proto::JobConfig& config, const std::string& role, int rank);

class MetricsRegistry {
 public:
  // An empty registry for `role` (every series gets the labels role and rank).
  MetricsRegistry(std::string role, int rank);
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Serves /metrics on host:port until destroyed (port 0: does nothing). `host` empty means all
  // addresses. Errors: IoError naming the address when it cannot be bound (a port in use).
  Status Start(const std::string& host, uint32_t port);
  // Starts on MetricsPort(config, role, rank) at metrics.host, else node.bind_host, else
  // node.host, and logs the URL.
  Status StartFromConfig(const proto::JobConfig& config);
  // The address served on ("host:port"); empty when not serving.
  const std::string& address() const { return address_; }
  // Whether /metrics is served: callers may skip refreshing series nobody can read.
  bool serving() const { return !address_.empty(); }

  // A series of the family `name` (created on first use, with `help`) with `labels` on top of role
  // and rank. References stay valid for the registry's lifetime.
  prometheus::Counter& Counter(const std::string& name, const std::string& help,
                               const prometheus::Labels& labels = {});
  prometheus::Gauge& Gauge(const std::string& name, const std::string& help,
                           const prometheus::Labels& labels = {});
  prometheus::Histogram& Histogram(const std::string& name, const std::string& help,
                                   const prometheus::Histogram::BucketBoundaries& buckets,
                                   const prometheus::Labels& labels = {});

  // Histogram buckets for times in seconds: 100 us to 60 s, about 3 per decade.
  static const prometheus::Histogram::BucketBoundaries& SecondsBuckets();

 private:
  prometheus::Labels With(const prometheus::Labels& labels) const;

  const std::string role_;
  const int rank_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::map<std::string, prometheus::Family<prometheus::Counter>*> counters_;
  std::map<std::string, prometheus::Family<prometheus::Gauge>*> gauges_;
  std::map<std::string, prometheus::Family<prometheus::Histogram>*> histograms_;
  std::string address_;
  struct HttpDeleter {
    void operator()(MHD_Daemon* d) const;
  };
  std::unique_ptr<MHD_Daemon, HttpDeleter> http_;  // last: stopped before the registry goes
};

// Raises `counter` to `total` (a count kept elsewhere as a running total); never lowers it.
void AdvanceTo(prometheus::Counter& counter, double total);

// Bytes by message type as two counter families, `<prefix>_sent_bytes_total{type}` and
// `<prefix>_received_bytes_total{type}`, kept up to running totals (TrafficByCommand). Series are
// made as types appear. Thread-compatible.
class TrafficSeries {
 public:
  // `what` ends each family's help text, e.g. "on the data socket".
  TrafficSeries(MetricsRegistry& registry, std::string prefix, std::string what)
      : registry_(registry), prefix_(std::move(prefix)), what_(std::move(what)) {}
  void Update(const std::vector<TrafficByCommand::Row>& rows);

 private:
  MetricsRegistry& registry_;
  const std::string prefix_, what_;
  std::vector<std::pair<prometheus::Counter*, prometheus::Counter*>> series_;  // sent, received
};

}  // namespace sparseps
