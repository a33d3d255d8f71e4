// Config loading: strict validation with messages naming file, line and key.
#include "config/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "tests/support/config_file.h"

namespace sparseps {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class ConfigTest : public ConfigFileTest {};

TEST_F(ConfigTest, LoadsQuickstart) {
  auto c = LoadConfig(std::string(SPARSEPS_SOURCE_DIR) + "/configs/quickstart.yaml", {}, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->cluster().num_servers(), 2u);
  EXPECT_EQ(c->cluster().num_workers(), 2u);
  EXPECT_EQ(c->compression().encoding(), proto::TOPK);
  EXPECT_DOUBLE_EQ(c->compression().density(), 0.01);
  ASSERT_EQ(c->model().hidden_size(), 2);
  EXPECT_EQ(c->model().hidden(0), 256u);
}

TEST_F(ConfigTest, UnknownKeyNamesFileLineAndKey) {
  auto path = Write("cluster:\n  num_workers: 2\n  num_wrokers: 3\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":3:"));
  EXPECT_THAT(c.status().message(), HasSubstr("unknown key 'cluster.num_wrokers'"));
}

TEST_F(ConfigTest, UnknownSectionIsRejected) {
  auto path = Write("clutser:\n  num_workers: 2\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":1:"));
  EXPECT_THAT(c.status().message(), HasSubstr("'clutser'"));
}

TEST_F(ConfigTest, WrongTypeNamesFileLineAndKey) {
  auto path = Write("run:\n  name: x\ntrain:\n  batch_size: sixty-four\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":4:"));
  EXPECT_THAT(c.status().message(), HasSubstr("train.batch_size"));
}

TEST_F(ConfigTest, ListWhereScalarExpected) {
  auto path = Write("train:\n  lr: [1, 2]\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":2:"));
  EXPECT_THAT(c.status().message(), HasSubstr("train.lr"));
}

TEST_F(ConfigTest, OutOfRangeNamesKey) {
  auto path = Write("compression:\n  density: 1.5\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":2:"));
  EXPECT_THAT(c.status().message(), HasSubstr("compression.density"));
}

TEST_F(ConfigTest, LoadsTheCnnConfig) {
  auto c = LoadConfig(std::string(SPARSEPS_SOURCE_DIR) + "/configs/cnn.yaml", {}, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->model().type(), proto::CNN);
  ASSERT_EQ(c->model().channels_size(), 2);
  EXPECT_EQ(c->model().channels(1), 32u);
  EXPECT_EQ(c->model().kernel_size(), 5u);
}

TEST_F(ConfigTest, CnnSettingsAreCheckedNamingFileLineAndKey) {
  auto path = Write("model:\n  type: cnn\n  hidden: [16]\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":2:"));
  EXPECT_THAT(c.status().message(), HasSubstr("'model.channels' is empty"));

  path = Write("model:\n  type: cnn\n  channels: [4]\n  kernel_size: 4\n");
  c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":4:"));
  EXPECT_THAT(c.status().message(), HasSubstr("'model.kernel_size' (4) must be odd"));

  path = Write("model:\n  type: mlp\n  channels: [4]\n");
  c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":3:"));
  EXPECT_THAT(c.status().message(), HasSubstr("'model.type' is not cnn"));

  // A type no worker builds is refused, not taken for the MLP.
  path = Write("model:\n  type: model_type_unspecified\n");
  c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":2:"));
  EXPECT_THAT(c.status().message(), HasSubstr("unknown value 'model_type_unspecified'"));
  // The same checks without a file (the worker's MakeModel, a config made in code), naming the
  // key.
  proto::ModelConfig m;
  m.set_type(proto::MODEL_TYPE_UNSPECIFIED);
  EXPECT_THAT(ValidateModelConfig(m).message(),
              HasSubstr("'model.type' (MODEL_TYPE_UNSPECIFIED) is no model this worker can build"));
  m.set_type(proto::CNN);
  Status s = ValidateModelConfig(m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), ::testing::StartsWith("key 'model.channels' is empty"));
  m.add_channels(4);
  EXPECT_TRUE(ValidateModelConfig(m).ok());
}

TEST_F(ConfigTest, WarmupDensityNeedsAWarmupAndIsAtLeastTheDensityNamingFileLineAndKey) {
  auto path = Write("compression:\n  density: 0.001\n  warmup_epochs: 2\n  warmup_density: 1\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_DOUBLE_EQ(c->compression().warmup_density(), 1.0);
  c = LoadConfig(path, {"compression.warmup_epochs=0"}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":4:"));
  EXPECT_THAT(c.status().message(), HasSubstr("'compression.warmup_density' (1.000000) is set"));
  EXPECT_THAT(c.status().message(), HasSubstr("'compression.warmup_epochs' is 0"));
  c = LoadConfig(path, {"compression.warmup_density=0.0001"}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("is below 'compression.density'"));
}

TEST_F(ConfigTest, UnknownEncodingIsRejected) {
  auto path = Write("compression:\n  encoding: topq\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("compression.encoding"));
}

TEST_F(ConfigTest, MalformedYamlNamesLine) {
  auto path = Write("cluster:\n  num_workers: [2\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path));
}

TEST_F(ConfigTest, MissingFile) {
  auto c = LoadConfig("/nonexistent/sparseps.yaml", {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("/nonexistent/sparseps.yaml"));
}

TEST_F(ConfigTest, OverridesApplyAndAreChecked) {
  auto path = Write("cluster:\n  num_workers: 2\n");
  auto c = LoadConfig(path, {"cluster.num_workers=5", "train.lr=0.5"}, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->cluster().num_workers(), 5u);
  EXPECT_DOUBLE_EQ(c->train().lr(), 0.5);

  auto bad = LoadConfig(path, {"train.lrr=0.5"}, NoEnv);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("--set train.lrr"));
  auto bad_type = LoadConfig(path, {"train.epochs=many"}, NoEnv);
  ASSERT_FALSE(bad_type.ok());
  EXPECT_THAT(bad_type.status().message(), HasSubstr("train.epochs"));
  auto no_value = LoadConfig(path, {"train.epochs"}, NoEnv);
  EXPECT_FALSE(no_value.ok());
}

TEST_F(ConfigTest, SchedulerAddressFromEnvironment) {
  auto path = Write("cluster:\n  num_workers: 2\n");
  std::map<std::string, std::string> env = {{"SPARSEPS_SCHEDULER", "10.0.0.7:9100"}};
  auto lookup = [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  auto c = LoadConfig(path, {}, lookup);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->cluster().scheduler_host(), "10.0.0.7");
  EXPECT_EQ(c->cluster().scheduler_port(), 9100u);

  env["SPARSEPS_SCHEDULER"] = "10.0.0.7:notaport";
  EXPECT_FALSE(LoadConfig(path, {}, lookup).ok());
}

// YAML forbids a key twice in one mapping; yaml-cpp keeps both, and taking either would drop
// what the other says. Both places are named.
TEST_F(ConfigTest, SectionGivenTwiceNamesBothLines) {
  auto path = Write("train:\n  lr: 0.5\ncluster:\n  num_workers: 3\ntrain:\n  epochs: 4\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":5:1: key 'train' is given twice"));
  EXPECT_THAT(c.status().message(), HasSubstr("(first at " + path + ":1:1)"));
}

TEST_F(ConfigTest, KeyGivenTwiceInASectionNamesBothLines) {
  auto path = Write("train:\n  lr: 0.5\n  epochs: 2\n  lr: 0.1\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":4:3: key 'train.lr' is given twice"));
  EXPECT_THAT(c.status().message(), HasSubstr("(first at " + path + ":2:3)"));
  // The same name in two different sections is not a duplicate.
  path = Write("compression:\n  sketch:\n    seed: 1\ntrain:\n  seed: 2\n");
  auto ok = LoadConfig(path, {}, NoEnv);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->compression().sketch().seed(), 1u);
  EXPECT_EQ(ok->train().seed(), 2u);
}

// node.rank -1 takes SPARSEPS_RANK, and for a worker RANK (torchrun's) when SPARSEPS_RANK is
// unset; SLURM_PROCID and OMPI_COMM_WORLD_RANK number every task of a job, whatever its role, and
// are never a rank. A rank in the config or on the command line wins over the environment.
TEST_F(ConfigTest, RankFromTheEnvironment) {
  auto path = Write("cluster:\n  num_workers: 4\n");
  std::map<std::string, std::string> env;
  auto lookup = [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  constexpr auto kServer = RankEnv::kSparsepsRank;
  constexpr auto kWorker = RankEnv::kSparsepsRankOrRank;
  ConfigSources sources;
  auto c = LoadConfig(path, {}, lookup, &sources, kWorker);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->node().rank(), -1);

  // One srun over all roles: the task ids are not ranks of any role.
  env = {{"OMPI_COMM_WORLD_RANK", "3"}, {"SLURM_PROCID", "2"}};
  EXPECT_EQ(LoadConfig(path, {}, lookup, nullptr, kWorker)->node().rank(), -1);
  EXPECT_EQ(LoadConfig(path, {}, lookup, nullptr, kServer)->node().rank(), -1);

  // torchrun's RANK is a worker's rank, not a server's.
  env["RANK"] = "1";
  c = LoadConfig(path, {}, lookup, &sources, kWorker);
  EXPECT_EQ(c->node().rank(), 1);
  EXPECT_EQ(sources["node.rank"], "env RANK");
  EXPECT_EQ(LoadConfig(path, {}, lookup, nullptr, kServer)->node().rank(), -1);

  env["SPARSEPS_RANK"] = "0";
  for (RankEnv role : {kServer, kWorker}) {
    c = LoadConfig(path, {}, lookup, &sources, role);
    EXPECT_EQ(c->node().rank(), 0);
    EXPECT_EQ(sources["node.rank"], "env SPARSEPS_RANK");
  }

  env = {{"RANK", "-1"}};
  auto bad = LoadConfig(path, {}, lookup, nullptr, kWorker);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("env RANK='-1'"));
  EXPECT_TRUE(LoadConfig(path, {}, lookup, nullptr, kServer).ok());  // not read at all
  env = {{"SPARSEPS_RANK", "one"}};
  EXPECT_THAT(LoadConfig(path, {}, lookup).status().message(), HasSubstr("env SPARSEPS_RANK"));

  // An explicit rank wins.
  env = {{"SPARSEPS_RANK", "1"}};
  EXPECT_EQ(LoadConfig(path, {"node.rank=3"}, lookup)->node().rank(), 3);
  path = Write("node:\n  rank: 2\n");
  EXPECT_EQ(LoadConfig(path, {}, lookup)->node().rank(), 2);
}

// --help lists exactly the variables LoadConfig reads: RANK for a worker only.
TEST(EnvironmentHelp, NamesWhatIsRead) {
  auto joined = [](const std::vector<std::string>& lines) {
    std::string s;
    for (const auto& l : lines) s += l + "\n";
    return s;
  };
  const std::string server = joined(EnvironmentHelp(RankEnv::kSparsepsRank));
  const std::string worker = joined(EnvironmentHelp(RankEnv::kSparsepsRankOrRank));
  for (const char* v :
       {"SPARSEPS_SCHEDULER", "SPARSEPS_HOST", "SPARSEPS_BIND_HOST", "SPARSEPS_RANK"}) {
    EXPECT_THAT(server, HasSubstr(v));
    EXPECT_THAT(worker, HasSubstr(v));
  }
  EXPECT_THAT(server, Not(HasSubstr("\nRANK")));
  EXPECT_THAT(worker, HasSubstr("\nRANK=r"));
  EXPECT_THAT(worker, HasSubstr("\nSPARSEPS_LOCAL_RANK=r"));  // its GPU (train.cuda_device)
  EXPECT_THAT(server, Not(HasSubstr("LOCAL_RANK")));
  EXPECT_THAT(worker, Not(HasSubstr("SLURM_PROCID")));
}

TEST_F(ConfigTest, LogLevelIsChecked) {
  auto path = Write("run:\n  log_level: debug\n");
  auto c = LoadConfig(path, {}, NoEnv);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->run().log_level(), "debug");
  path = Write("run:\n  name: x\n  log_level: verbose\n");
  c = LoadConfig(path, {}, NoEnv);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr(path + ":3:"));
  EXPECT_THAT(c.status().message(), HasSubstr("unknown level 'verbose'"));
}

// What the scheduler compares between nodes (the config hash of REGISTER): the job's keys, not a
// host's own, such as which device (and which of its GPUs) a worker computes on.
TEST(CanonicalJobConfig, LeavesOutWhereAWorkerComputes) {
  proto::JobConfig a;
  proto::JobConfig b = a;
  b.mutable_train()->set_device(proto::CUDA);
  b.mutable_train()->set_cuda_device(2);
  b.mutable_data()->set_dir("/elsewhere");
  EXPECT_EQ(CanonicalJobConfig(a), CanonicalJobConfig(b));
  b.mutable_train()->set_lr(0.5);
  EXPECT_NE(CanonicalJobConfig(a), CanonicalJobConfig(b));
  EXPECT_THAT(CanonicalJobConfig(b), HasSubstr("train.lr "));
}

}  // namespace
}  // namespace sparseps
