#include "config/config.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>
#include <xxhash.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

namespace sparseps {
namespace {

namespace pb = google::protobuf;

std::string Where(const std::string& origin, const YAML::Node& node) {
  const YAML::Mark m = node.Mark();
  if (m.line < 0) return origin;
  return origin + ":" + std::to_string(m.line + 1) + ":" + std::to_string(m.column + 1);
}

std::string KnownKeys(const pb::Descriptor* d) {
  std::string out;
  for (int i = 0; i < d->field_count(); ++i) {
    if (i) out += ", ";
    out += d->field(i)->name();
  }
  return out;
}

std::string EnumChoices(const pb::EnumDescriptor* e) {
  std::string out;
  for (int i = 0; i < e->value_count(); ++i) {
    const std::string& n = e->value(i)->name();
    if (n.find("UNSPECIFIED") != std::string::npos) continue;
    if (!out.empty()) out += ", ";
    out += ConfigSpelling(n);
  }
  return out;
}

Status Bad(const std::string& where, const std::string& key, const std::string& what) {
  return Status::InvalidArgument(where + ": key '" + key + "': " + what);
}

template <typename T>
bool ParseInteger(const std::string& s, T* out) {
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (b != e && *b == '+') ++b;
  auto [p, ec] = std::from_chars(b, e, *out);
  return ec == std::errc() && p == e;
}

Status CheckBounds(const pb::FieldDescriptor* f, double v, const std::string& where,
                   const std::string& key) {
  const auto& opts = f->options();
  if (opts.HasExtension(proto::min) && v < opts.GetExtension(proto::min)) {
    std::ostringstream os;
    os << "value " << v << " is below the minimum " << opts.GetExtension(proto::min);
    return Bad(where, key, os.str());
  }
  if (opts.HasExtension(proto::max) && v > opts.GetExtension(proto::max)) {
    std::ostringstream os;
    os << "value " << v << " is above the maximum " << opts.GetExtension(proto::max);
    return Bad(where, key, os.str());
  }
  return Status::OK();
}

// Sets (or, for repeated fields, adds) one scalar value from YAML text.
Status SetScalar(pb::Message* msg, const pb::FieldDescriptor* f, const std::string& text,
                 const std::string& where, const std::string& key) {
  const pb::Reflection* r = msg->GetReflection();
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32:
    case pb::FieldDescriptor::CPPTYPE_INT64: {
      int64_t v;
      if (!ParseInteger(text, &v))
        return Bad(where, key, "expected an integer, got '" + text + "'");
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_INT32 &&
          (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())) {
        return Bad(where, key, "value " + text + " does not fit a 32-bit integer");
      }
      SPARSEPS_RETURN_IF_ERROR(CheckBounds(f, static_cast<double>(v), where, key));
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_INT32) {
        rep ? r->AddInt32(msg, f, static_cast<int32_t>(v))
            : r->SetInt32(msg, f, static_cast<int32_t>(v));
      } else {
        rep ? r->AddInt64(msg, f, v) : r->SetInt64(msg, f, v);
      }
      return Status::OK();
    }
    case pb::FieldDescriptor::CPPTYPE_UINT32:
    case pb::FieldDescriptor::CPPTYPE_UINT64: {
      uint64_t v;
      if (!ParseInteger(text, &v)) {
        return Bad(where, key, "expected a non-negative integer, got '" + text + "'");
      }
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_UINT32 &&
          v > std::numeric_limits<uint32_t>::max()) {
        return Bad(where, key, "value " + text + " does not fit a 32-bit integer");
      }
      SPARSEPS_RETURN_IF_ERROR(CheckBounds(f, static_cast<double>(v), where, key));
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_UINT32) {
        rep ? r->AddUInt32(msg, f, static_cast<uint32_t>(v))
            : r->SetUInt32(msg, f, static_cast<uint32_t>(v));
      } else {
        rep ? r->AddUInt64(msg, f, v) : r->SetUInt64(msg, f, v);
      }
      return Status::OK();
    }
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
    case pb::FieldDescriptor::CPPTYPE_FLOAT: {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v)) {
        return Bad(where, key, "expected a finite number, got '" + text + "'");
      }
      SPARSEPS_RETURN_IF_ERROR(CheckBounds(f, v, where, key));
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_DOUBLE) {
        rep ? r->AddDouble(msg, f, v) : r->SetDouble(msg, f, v);
      } else {
        rep ? r->AddFloat(msg, f, static_cast<float>(v))
            : r->SetFloat(msg, f, static_cast<float>(v));
      }
      return Status::OK();
    }
    case pb::FieldDescriptor::CPPTYPE_BOOL: {
      bool v;
      if (text == "true") {
        v = true;
      } else if (text == "false") {
        v = false;
      } else {
        return Bad(where, key, "expected true or false, got '" + text + "'");
      }
      rep ? r->AddBool(msg, f, v) : r->SetBool(msg, f, v);
      return Status::OK();
    }
    case pb::FieldDescriptor::CPPTYPE_STRING:
      rep ? r->AddString(msg, f, text) : r->SetString(msg, f, text);
      return Status::OK();
    case pb::FieldDescriptor::CPPTYPE_ENUM: {
      std::string upper = text;
      std::transform(upper.begin(), upper.end(), upper.begin(),
                     [](unsigned char c) { return std::toupper(c); });
      const pb::EnumValueDescriptor* ev = f->enum_type()->FindValueByName(upper);
      if (ev == nullptr || ev->name().find("UNSPECIFIED") != std::string::npos) {
        return Bad(where, key,
                   "unknown value '" + text + "'; one of: " + EnumChoices(f->enum_type()));
      }
      rep ? r->AddEnum(msg, f, ev) : r->SetEnum(msg, f, ev);
      return Status::OK();
    }
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      return Bad(where, key, "is a section; expected a mapping of keys, got '" + text + "'");
  }
  return Bad(where, key, "unsupported field type");
}

Status MergeNode(const YAML::Node& node, pb::Message* msg, const std::string& prefix,
                 const std::string& origin, ConfigSources* sources);

Status MergeField(const YAML::Node& value, pb::Message* msg, const pb::FieldDescriptor* f,
                  const std::string& key, const std::string& where, const std::string& origin,
                  ConfigSources* sources) {
  const pb::Reflection* r = msg->GetReflection();
  if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE && !f->is_repeated()) {
    if (value.IsNull()) return Status::OK();  // an empty section keeps the defaults
    if (!value.IsMap()) return Bad(where, key, "is a section; expected a mapping of keys");
    return MergeNode(value, r->MutableMessage(msg, f), key, origin, sources);
  }
  if (value.IsNull()) return Bad(where, key, "has no value");
  if (f->is_repeated()) {
    if (!value.IsSequence()) return Bad(where, key, "expected a list, e.g. [1, 2]");
    r->ClearField(msg, f);  // a list given in YAML replaces, never appends to, the previous one
    for (const auto& item : value) {
      if (!item.IsScalar()) return Bad(Where(origin, item), key, "list items must be scalars");
      SPARSEPS_RETURN_IF_ERROR(SetScalar(msg, f, item.Scalar(), Where(origin, item), key));
    }
  } else {
    if (!value.IsScalar()) return Bad(where, key, "expected a single value");
    SPARSEPS_RETURN_IF_ERROR(SetScalar(msg, f, value.Scalar(), where, key));
  }
  if (sources != nullptr) (*sources)[key] = where;
  return Status::OK();
}

Status MergeNode(const YAML::Node& node, pb::Message* msg, const std::string& prefix,
                 const std::string& origin, ConfigSources* sources) {
  const pb::Descriptor* d = msg->GetDescriptor();
  // yaml-cpp keeps every pair of a mapping, duplicates included; YAML forbids them, and taking
  // one silently would drop what the other says.
  std::map<std::string, std::string> seen;  // key name -> where it was first given
  for (const auto& kv : node) {
    const std::string name = kv.first.Scalar();
    const std::string key = prefix.empty() ? name : prefix + "." + name;
    const std::string where = Where(origin, kv.first);
    if (const auto [it, fresh] = seen.emplace(name, where); !fresh) {
      return Status::InvalidArgument(where + ": key '" + key + "' is given twice (first at " +
                                     it->second + "); merge the two into one");
    }
    const pb::FieldDescriptor* f = d->FindFieldByName(name);
    if (f == nullptr) {
      return Status::InvalidArgument(where + ": unknown key '" + key + "'; known keys" +
                                     (prefix.empty() ? "" : " in '" + prefix + "'") + ": " +
                                     KnownKeys(d));
    }
    SPARSEPS_RETURN_IF_ERROR(
        MergeField(kv.second, msg, f, key, Where(origin, kv.second), origin, sources));
  }
  return Status::OK();
}

std::string FieldValueText(const pb::Message& msg, const pb::FieldDescriptor* f, int index) {
  const pb::Reflection* r = msg.GetReflection();
  const bool rep = f->is_repeated();
  std::ostringstream os;
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32:
      os << (rep ? r->GetRepeatedInt32(msg, f, index) : r->GetInt32(msg, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_INT64:
      os << (rep ? r->GetRepeatedInt64(msg, f, index) : r->GetInt64(msg, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      os << (rep ? r->GetRepeatedUInt32(msg, f, index) : r->GetUInt32(msg, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      os << (rep ? r->GetRepeatedUInt64(msg, f, index) : r->GetUInt64(msg, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      os << (rep ? r->GetRepeatedDouble(msg, f, index) : r->GetDouble(msg, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
      os << (rep ? r->GetRepeatedFloat(msg, f, index) : r->GetFloat(msg, f));
      break;
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      os << ((rep ? r->GetRepeatedBool(msg, f, index) : r->GetBool(msg, f)) ? "true" : "false");
      break;
    case pb::FieldDescriptor::CPPTYPE_STRING:
      os << '"' << (rep ? r->GetRepeatedString(msg, f, index) : r->GetString(msg, f)) << '"';
      break;
    case pb::FieldDescriptor::CPPTYPE_ENUM: {
      os << ConfigSpelling((rep ? r->GetRepeatedEnum(msg, f, index) : r->GetEnum(msg, f))->name());
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
  return os.str();
}

void Describe(const pb::Message& msg, const std::string& prefix, std::vector<std::string>* out) {
  const pb::Descriptor* d = msg.GetDescriptor();
  const pb::Reflection* r = msg.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    const std::string key = prefix.empty() ? f->name() : prefix + "." + f->name();
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE && !f->is_repeated()) {
      Describe(r->GetMessage(msg, f), key, out);
    } else if (f->is_repeated()) {
      std::string list = "[";
      for (int j = 0; j < r->FieldSize(msg, f); ++j) {
        if (j) list += ", ";
        list += FieldValueText(msg, f, j);
      }
      out->push_back(key + " = " + list + "]");
    } else {
      out->push_back(key + " = " + FieldValueText(msg, f, 0));
    }
  }
}

}  // namespace

Status MergeYamlText(const std::string& text, const std::string& origin, proto::JobConfig* config,
                     ConfigSources* sources) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(origin + ":" + std::to_string(e.mark.line + 1) + ":" +
                                   std::to_string(e.mark.column + 1) +
                                   ": YAML syntax error: " + e.msg);
  }
  if (root.IsNull()) return Status::OK();
  if (!root.IsMap()) {
    return Status::InvalidArgument(Where(origin, root) +
                                   ": the top level must be a mapping of sections; known keys: " +
                                   KnownKeys(proto::JobConfig::descriptor()));
  }
  try {
    return MergeNode(root, config, "", origin, sources);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(origin + ": " + e.what());
  }
}

Status ApplyOverride(const std::string& assignment, proto::JobConfig* config,
                     ConfigSources* sources) {
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    return Status::InvalidArgument("--set " + assignment +
                                   ": expected key=value, e.g. train.lr=0.05");
  }
  const std::string key = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  const std::string where = "--set " + key;
  pb::Message* msg = config;
  std::string walked;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    const std::string part =
        key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const pb::Descriptor* d = msg->GetDescriptor();
    const pb::FieldDescriptor* f = d->FindFieldByName(part);
    const std::string here = walked.empty() ? part : walked + "." + part;
    if (f == nullptr) {
      return Status::InvalidArgument(where + ": unknown key '" + here + "'; known keys" +
                                     (walked.empty() ? "" : " in '" + walked + "'") + ": " +
                                     KnownKeys(d));
    }
    if (dot == std::string::npos) {
      YAML::Node value;
      try {
        value = YAML::Load(text);
      } catch (const YAML::Exception& e) {
        return Bad(where, key, "value is not valid YAML: " + e.msg);
      }
      if (value.IsNull() && f->cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING) {
        value = YAML::Node(std::string());  // `--set run.dir=` means the empty string
      }
      try {
        return MergeField(value, msg, f, key, where, where, sources);
      } catch (const YAML::Exception& e) {
        return Bad(where, key, e.what());
      }
    }
    if (f->cpp_type() != pb::FieldDescriptor::CPPTYPE_MESSAGE || f->is_repeated()) {
      return Status::InvalidArgument(where + ": '" + here + "' is not a section");
    }
    msg = msg->GetReflection()->MutableMessage(msg, f);
    walked = here;
    start = dot + 1;
  }
}

std::string SourceOf(const ConfigSources& sources, const std::string& key) {
  auto it = sources.find(key);
  return it == sources.end() ? "config (default)" : it->second;
}

Result<proto::JobConfig> LoadConfig(const std::string& path,
                                    const std::vector<std::string>& overrides,
                                    const EnvLookup& env_in, ConfigSources* sources_out,
                                    RankEnv rank_env) {
  proto::JobConfig config;
  ConfigSources sources;
  if (!path.empty()) {
    std::ifstream in(path);
    if (!in) return Status::InvalidArgument(path + ": cannot open the config file");
    std::stringstream buf;
    buf << in.rdbuf();
    SPARSEPS_RETURN_IF_ERROR(MergeYamlText(buf.str(), path, &config, &sources));
  }

  const EnvLookup env = env_in ? env_in : [](const char* n) { return std::getenv(n); };
  if (const char* s = env("SPARSEPS_SCHEDULER"); s != nullptr && *s) {
    const std::string v = s;
    const size_t colon = v.rfind(':');
    uint32_t port = 0;
    if (colon == std::string::npos || colon == 0 || !ParseInteger(v.substr(colon + 1), &port) ||
        port == 0 || port > 65535) {
      return Status::InvalidArgument("env SPARSEPS_SCHEDULER='" + v + "': expected host:port");
    }
    config.mutable_cluster()->set_scheduler_host(v.substr(0, colon));
    config.mutable_cluster()->set_scheduler_port(port);
    sources["cluster.scheduler_host"] = sources["cluster.scheduler_port"] =
        "env SPARSEPS_SCHEDULER";
  }
  if (const char* s = env("SPARSEPS_HOST"); s != nullptr && *s) {
    config.mutable_node()->set_host(s);
    sources["node.host"] = "env SPARSEPS_HOST";
  }
  if (const char* s = env("SPARSEPS_BIND_HOST"); s != nullptr && *s) {
    config.mutable_node()->set_bind_host(s);
    sources["node.bind_host"] = "env SPARSEPS_BIND_HOST";
  }
  if (config.node().rank() < 0) {
    const char* name = nullptr;
    auto rank = rank_env == RankEnv::kSparsepsRankOrRank
                    ? FirstEnvInteger({"SPARSEPS_RANK", "RANK"}, "rank", env, &name)
                    : FirstEnvInteger({"SPARSEPS_RANK"}, "rank", env, &name);
    if (!rank.ok()) return rank.status();
    if (*rank >= 0) {
      config.mutable_node()->set_rank(*rank);
      sources["node.rank"] = std::string("env ") + name;
    }
  }

  for (const auto& o : overrides) SPARSEPS_RETURN_IF_ERROR(ApplyOverride(o, &config, &sources));
  SPARSEPS_RETURN_IF_ERROR(ValidateConfig(config, sources));
  if (sources_out != nullptr) *sources_out = std::move(sources);
  return config;
}

Result<int32_t> FirstEnvInteger(std::initializer_list<const char*> names, const std::string& what,
                                const EnvLookup& env_in, const char** name) {
  const EnvLookup env = env_in ? env_in : [](const char* n) { return std::getenv(n); };
  for (const char* n : names) {
    const char* s = env(n);
    if (s == nullptr || !*s) continue;
    int32_t value = -1;
    if (*s < '0' || *s > '9' || !ParseInteger(std::string(s), &value)) {
      return Status::InvalidArgument(std::string("env ") + n + "='" + s +
                                     "': expected a non-negative integer " + what);
    }
    if (name != nullptr) *name = n;
    return value;
  }
  return -1;
}

std::vector<std::string> EnvironmentHelp(RankEnv rank_env) {
  std::vector<std::string> lines = {
      "SPARSEPS_SCHEDULER=host:port  the scheduler's address (cluster.scheduler_host, "
      "cluster.scheduler_port)",
      "SPARSEPS_HOST=addr            the address this node binds and announces (node.host)",
      "SPARSEPS_BIND_HOST=addr       the address it binds when peers use another one "
      "(node.bind_host)",
      "SPARSEPS_RANK=r               this node's rank within its role (node.rank)"};
  if (rank_env == RankEnv::kSparsepsRankOrRank) {
    lines.push_back(
        "RANK=r                        a worker's rank as torchrun sets it, when SPARSEPS_RANK is "
        "unset");
    lines.push_back(
        "SPARSEPS_LOCAL_RANK=r         the worker's rank among its host's workers: with "
        "train.device cuda and train.cuda_device -1 it computes on GPU r modulo the GPUs it sees "
        "(else LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID, the first set)");
  }
  lines.push_back("The config file and --set win over the environment.");
  return lines;
}

std::vector<std::string> DescribeConfig(const proto::JobConfig& config) {
  std::vector<std::string> out;
  Describe(config, "", &out);
  return out;
}

std::string CanonicalJobConfig(const proto::JobConfig& config) {
  static const char* const kJobSections[] = {
      "model.", "data.", "train.", "compression.", "collective.", "checkpoint.", "aggregation "};
  static const char* const kJobKeys[] = {"cluster.num_servers ", "cluster.num_workers ",
                                         "cluster.on_worker_failure ", "cluster.min_workers ",
                                         "security.curve "};
  static const char* const kPerHost[] = {"data.dir ", "train.device ", "train.cuda_device ",
                                         "checkpoint.dir ", "checkpoint.resume "};
  auto starts = [](const std::string& line, const char* prefix) {
    return line.compare(0, std::strlen(prefix), prefix) == 0;
  };
  std::string text;
  for (const std::string& line : DescribeConfig(config)) {
    bool keep = false;
    for (const char* p : kJobSections) keep = keep || starts(line, p);
    for (const char* p : kJobKeys) keep = keep || starts(line, p);
    for (const char* p : kPerHost) keep = keep && !starts(line, p);
    if (keep) text += line + "\n";
  }
  return text;
}

std::string ConfigHash(const std::string& text) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(text.data(), text.size())));
  return hex;
}

std::vector<std::string> ConfigDifferences(const std::string& ours, const std::string& theirs) {
  auto parse = [](const std::string& text) {
    std::map<std::string, std::string> kv;
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
      const auto eq = line.find(" = ");
      if (eq == std::string::npos) continue;
      kv[line.substr(0, eq)] = line.substr(eq + 3);
    }
    return kv;
  };
  const auto a = parse(ours);
  const auto b = parse(theirs);
  std::vector<std::string> out;
  for (const auto& [key, value] : a) {
    auto it = b.find(key);
    const std::string other = it == b.end() ? "(absent)" : it->second;
    if (other != value) out.push_back(key + ": " + value + " vs " + other);
  }
  for (const auto& [key, value] : b) {
    if (!a.count(key)) out.push_back(key + ": (absent) vs " + value);
  }
  return out;
}

std::string ConfigSpelling(std::string enum_name) {
  std::transform(enum_name.begin(), enum_name.end(), enum_name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return enum_name;
}

}  // namespace sparseps
