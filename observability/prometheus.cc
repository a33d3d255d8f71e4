#include "observability/prometheus.h"

#include <microhttpd.h>
#include <netdb.h>
#include <prometheus/text_serializer.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace sparseps {

uint32_t MetricsPort(const proto::JobConfig& config, const std::string& role, int rank) {
  const uint32_t base = config.metrics().port();
  if (base == 0) return 0;
  uint32_t offset = 0;
  if (role == "server") offset = 1 + static_cast<uint32_t>(rank);
  if (role == "worker") {
    offset = 1 + config.cluster().num_servers() + static_cast<uint32_t>(rank);
  }
  return base + offset;
}

MetricsRegistry::MetricsRegistry(std::string role, int rank)
    : role_(std::move(role)), rank_(rank), registry_(std::make_shared<prometheus::Registry>()) {}

MetricsRegistry::~MetricsRegistry() = default;  // stops the HTTP daemon first (declared last)

namespace {

// GET /metrics: the registry in the text exposition format; anything else 404 / 405.
MHD_Result ServeMetrics(void* cls, MHD_Connection* connection, const char* url, const char* method,
                        const char* /*version*/, const char* /*upload*/, size_t* /*upload_size*/,
                        void** /*state*/) {
  auto* registry = static_cast<prometheus::Registry*>(cls);
  unsigned status = MHD_HTTP_OK;
  std::string body;
  if (std::strcmp(method, "GET") != 0 && std::strcmp(method, "HEAD") != 0) {
    status = MHD_HTTP_METHOD_NOT_ALLOWED;
    body = "GET /metrics\n";
  } else if (std::strcmp(url, "/metrics") != 0) {
    status = MHD_HTTP_NOT_FOUND;
    body = "GET /metrics\n";
  } else {
    body = prometheus::TextSerializer().Serialize(registry->Collect());
  }
  MHD_Response* response =
      MHD_create_response_from_buffer(body.size(), body.data(), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
  const MHD_Result r = MHD_queue_response(connection, status, response);
  MHD_destroy_response(response);
  return r;
}

}  // namespace

void MetricsRegistry::HttpDeleter::operator()(MHD_Daemon* d) const { MHD_stop_daemon(d); }

Status MetricsRegistry::Start(const std::string& host, uint32_t port) {
  if (port == 0 || http_ != nullptr) return Status::OK();
  if (port > 65535) return Status::InvalidArgument("metrics port " + std::to_string(port));
  const std::string where =
      (host.empty() ? std::string("0.0.0.0") : host) + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int e = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
      e != 0) {
    return Status::IoError("cannot serve metrics on " + where + ": " + gai_strerror(e));
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> addresses(found, freeaddrinfo);
  // One thread of libmicrohttpd's own (default stack size) answers the scrapes.
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD;
  if (found->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
  errno = 0;
  MHD_Daemon* d = MHD_start_daemon(
      flags, static_cast<uint16_t>(port), nullptr, nullptr, &ServeMetrics, registry_.get(),
      MHD_OPTION_SOCK_ADDR, found->ai_addr, MHD_OPTION_CONNECTION_TIMEOUT, 10u, MHD_OPTION_END);
  if (d == nullptr) {
    const int e = errno;
    return Status::IoError("cannot serve metrics on " + where + ": " +
                           (e != 0 ? std::strerror(e) : "libmicrohttpd could not start") +
                           " (metrics.port: each daemon takes port + its offset; is one in use?)");
  }
  http_.reset(d);
  address_ = where;
  return Status::OK();
}

Status MetricsRegistry::StartFromConfig(const proto::JobConfig& config) {
  const uint32_t port = MetricsPort(config, role_, rank_);
  if (port == 0) return Status::OK();
  std::string host = config.metrics().host();
  if (host.empty()) host = config.node().bind_host();
  if (host.empty()) host = config.node().host();
  SPARSEPS_RETURN_IF_ERROR(Start(host, port));
  spdlog::info("metrics on http://{}/metrics", address_);
  return Status::OK();
}

prometheus::Labels MetricsRegistry::With(const prometheus::Labels& labels) const {
  prometheus::Labels all = labels;
  all["role"] = role_;
  all["rank"] = std::to_string(rank_);
  return all;
}

prometheus::Counter& MetricsRegistry::Counter(const std::string& name, const std::string& help,
                                              const prometheus::Labels& labels) {
  auto& family = counters_[name];
  if (family == nullptr) {
    family = &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
  }
  return family->Add(With(labels));
}

prometheus::Gauge& MetricsRegistry::Gauge(const std::string& name, const std::string& help,
                                          const prometheus::Labels& labels) {
  auto& family = gauges_[name];
  if (family == nullptr) {
    family = &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
  }
  return family->Add(With(labels));
}

prometheus::Histogram& MetricsRegistry::Histogram(
    const std::string& name, const std::string& help,
    const prometheus::Histogram::BucketBoundaries& buckets, const prometheus::Labels& labels) {
  auto& family = histograms_[name];
  if (family == nullptr) {
    family = &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_);
  }
  return family->Add(With(labels), buckets);
}

const prometheus::Histogram::BucketBoundaries& MetricsRegistry::SecondsBuckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60};
  return kBuckets;
}

void TrafficSeries::Update(const std::vector<TrafficByCommand::Row>& rows) {
  // Types only ever appear, and keep their order: one new pair of series per new type.
  for (size_t i = 0; i < rows.size(); ++i) {
    if (i == series_.size()) {
      const prometheus::Labels type{{"type", rows[i].type}};
      series_.emplace_back(
          &registry_.Counter(prefix_ + "_sent_bytes_total",
                             "Bytes sent " + what_ + ", by message type", type),
          &registry_.Counter(prefix_ + "_received_bytes_total",
                             "Bytes received " + what_ + ", by message type", type));
    }
    AdvanceTo(*series_[i].first, static_cast<double>(rows[i].sent));
    AdvanceTo(*series_[i].second, static_cast<double>(rows[i].received));
  }
}

void AdvanceTo(prometheus::Counter& counter, double total) {
  const double now = counter.Value();
  if (total > now) counter.Increment(total - now);
}

}  // namespace sparseps
