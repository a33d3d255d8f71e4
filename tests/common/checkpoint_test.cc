// Safetensors files and checkpoint node files: round trips, and every kind of damage refused
// with the file named (truncation, a flipped bit anywhere, another config, a missing manifest).
#include "storage/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "storage/safetensors.h"
#include "transport/control_client.h"
#include "transport/van.h"

namespace sparseps {
namespace {

using ::testing::HasSubstr;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("sparseps-ckpt-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  std::filesystem::path dir_;
};

std::string Slurp(const std::string& path) { return *ReadWholeFile(path); }
void Spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST_F(CheckpointTest, SafetensorsRoundTripFollowsTheFormat) {
  SafetensorsWriter w;
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  const uint64_t scalar = 123456789012345ull;
  w.AddF32("layer.weight", {2, 3}, a);
  w.Add("step", DType::kU64, {}, &scalar, sizeof(scalar));
  w.SetMetadata("note", "hello");
  ASSERT_TRUE(w.Write(Path("m.safetensors")).ok());

  const std::string bytes = Slurp(Path("m.safetensors"));
  // 8-byte little-endian header length, a JSON header padded to 8 bytes, then the data.
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + a.size() * 4 + 8);
  EXPECT_EQ(bytes[8], '{');
  EXPECT_THAT(bytes.substr(8, n), HasSubstr("\"dtype\":\"F32\""));
  EXPECT_THAT(bytes.substr(8, n), HasSubstr("\"shape\":[2,3]"));

  auto f = SafetensorsFile::Read(Path("m.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->Meta("note"), "hello");
  const auto* t = f->Find("layer.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<uint64_t>{2, 3}));
  std::vector<float> back(6);
  std::memcpy(back.data(), f->Data(*t).data(), 24);
  EXPECT_EQ(back, a);
  const auto* s = f->Find("step");
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->shape.empty());
  uint64_t got = 0;
  std::memcpy(&got, f->Data(*s).data(), 8);
  EXPECT_EQ(got, scalar);
}

TEST_F(CheckpointTest, ModelFileHoldsTheBuffersBesideTheParametersAndReadsBack) {
  const std::vector<float> params = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<TensorLayout> layers = {{"fc.weight", {2, 3}, 0}, {"fc.bias", {2}, 6}};
  ExtraTensors buffers{{{"bn.running_mean", {2}, 0}, {"bn.num_batches_tracked", {}, 2}},
                       {0.25f, -0.5f, 40.0f}};
  ASSERT_TRUE(WriteModelFile(Path("m.safetensors"), params, layers, {}, &buffers).ok());
  auto f = SafetensorsFile::Read(Path("m.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->names().size(), 4u);
  const auto* mean = f->Find("bn.running_mean");
  ASSERT_NE(mean, nullptr);
  std::vector<float> got(2);
  std::memcpy(got.data(), f->Data(*mean).data(), 8);
  EXPECT_EQ(got, (std::vector<float>{0.25f, -0.5f}));
  const auto* count = f->Find("bn.num_batches_tracked");
  ASSERT_NE(count, nullptr);
  EXPECT_TRUE(count->shape.empty());
  float c = 0;
  std::memcpy(&c, f->Data(*count).data(), 4);
  EXPECT_EQ(c, 40.0f);
  // The parameters read back by their layers as before: the buffers are beside them.
  auto back = ReadModelFile(Path("m.safetensors"), layers);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, params);

  // A buffer named as a layer, or buffers that do not cover their values, write nothing.
  buffers.layers[0].name = "fc.bias";
  Status s = WriteModelFile(Path("dup.safetensors"), params, layers, {}, &buffers);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("two tensors named fc.bias"));
  buffers.layers[0].name = "bn.running_mean";
  buffers.values.push_back(1.0f);
  s = WriteModelFile(Path("short.safetensors"), params, layers, {}, &buffers);
  EXPECT_THAT(s.message(), HasSubstr("the layers cover 3 of 4 buffers"));
  EXPECT_FALSE(std::filesystem::exists(Path("dup.safetensors")));
  EXPECT_FALSE(std::filesystem::exists(Path("short.safetensors")));
}

TEST_F(CheckpointTest, BuffersAddedToABuiltModelFileAreBesideTheParameters) {
  // A checkpoint's model file is built at the snapshot; the loop's buffers come after it.
  const std::vector<float> params = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<TensorLayout> layers = {{"fc.weight", {2, 3}, 0}, {"fc.bias", {2}, 6}};
  SafetensorsWriter w;
  ASSERT_TRUE(BuildModelFile(params, layers, {{"format", "sparseps-model"}}, &w).ok());
  // Refused whole, nothing added: a buffer named as a layer; buffers that miss values.
  ExtraTensors clash{{{"bn.running_mean", {1}, 0}, {"fc.bias", {1}, 1}}, {0.5f, 2.0f}};
  Status s = AddModelBuffers(clash, layers, &w);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("two tensors named fc.bias"));
  ExtraTensors uncovered{{{"bn.running_mean", {1}, 0}}, {0.5f, 2.0f}};
  EXPECT_THAT(AddModelBuffers(uncovered, layers, &w).message(),
              HasSubstr("the layers cover 1 of 2 buffers"));
  ExtraTensors buffers{{{"bn.running_var", {2}, 0}}, {0.75f, 1.5f}};
  ASSERT_TRUE(AddModelBuffers(buffers, layers, &w).ok());
  auto f = SafetensorsFile::Parse(w.Serialize(), "built.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->names().size(), 3u);  // fc.weight, fc.bias, bn.running_var: no running_mean
  const auto* var = f->Find("bn.running_var");
  ASSERT_NE(var, nullptr);
  std::vector<float> got(2);
  std::memcpy(got.data(), f->Data(*var).data(), 8);
  EXPECT_EQ(got, (std::vector<float>{0.75f, 1.5f}));
}

TEST_F(CheckpointTest, MalformedSafetensorsAreRefusedNamingTheFile) {
  SafetensorsWriter w;
  w.AddF32("x", {4}, std::vector<float>{1, 2, 3, 4});
  const std::string good = w.Serialize();
  for (size_t cut : {size_t{0}, size_t{5}, size_t{12}, good.size() - 1}) {
    auto f = SafetensorsFile::Parse(good.substr(0, cut), "cut.safetensors");
    ASSERT_FALSE(f.ok()) << "cut at " << cut;
    EXPECT_THAT(f.status().message(), HasSubstr("cut.safetensors"));
  }
  std::string huge = good;
  huge[7] = '\x7f';  // a header length beyond the file
  EXPECT_FALSE(SafetensorsFile::Parse(huge, "h").ok());
  std::string extra = good + "junk";
  EXPECT_THAT(SafetensorsFile::Parse(extra, "e").status().message(), HasSubstr("after the last"));
  EXPECT_EQ(SafetensorsFile::Read(Path("none")).status().code(), StatusCode::kNotFound);
}

// A component with arrays and scalars, saved and restored through one State function.
struct Component {
  std::vector<float> residual;
  std::vector<uint32_t> keys;
  uint64_t step = 0;
  float threshold = 0.0f;
  void State(StateArchive& a) {
    auto scope = a.Scope("part");
    a.Array("residual", &residual);
    a.Array("keys", &keys);
    a.Value("step", &step);
    a.Value("threshold", &threshold);
  }
};

CheckpointIdentity Id(uint64_t iteration = 40) {
  return {proto::WORKER, 1, iteration, 1, "00112233aabbccdd"};
}

TEST_F(CheckpointTest, NodeFileRoundTripsEveryValueExactly) {
  Component c{{0.1f, -3e-8f, 5.0f}, {7, 9}, 41, 0.125f};
  StateArchive save;
  c.State(save);
  CheckpointFileInfo info;
  const std::string iter_dir = CheckpointIterationDir(dir_.string(), 40);
  ASSERT_TRUE(WriteCheckpointFile(iter_dir, "worker-1.safetensors", Id(), save, &info).ok());
  EXPECT_EQ(info.bytes, std::filesystem::file_size(iter_dir + "/worker-1.safetensors"));
  EXPECT_EQ(info.xxh3.size(), 16u);
  EXPECT_FALSE(std::filesystem::exists(iter_dir + "/worker-1.safetensors.tmp"));

  auto f = ReadCheckpointFile(iter_dir + "/worker-1.safetensors", Id(), info);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  Component d;
  d.residual.resize(3);
  StateArchive load(&*f);
  d.State(load);
  ASSERT_TRUE(load.status().ok()) << load.status().ToString();
  EXPECT_EQ(d.residual, c.residual);
  EXPECT_EQ(d.keys, c.keys);
  EXPECT_EQ(d.step, 41u);
  EXPECT_EQ(d.threshold, 0.125f);

  // Another size than this job's is refused naming the array.
  Component e;
  e.residual.resize(4);
  StateArchive load2(&*f);
  e.State(load2);
  EXPECT_THAT(load2.status().message(), HasSubstr("part.residual"));
}

TEST_F(CheckpointTest, TruncatedOrBitFlippedFilesAreRefusedAndNothingLoaded) {
  Component c{std::vector<float>(1000, 0.5f), {1, 2, 3}, 7, 1.0f};
  StateArchive save;
  c.State(save);
  CheckpointFileInfo info;
  const std::string iter_dir = CheckpointIterationDir(dir_.string(), 40);
  ASSERT_TRUE(WriteCheckpointFile(iter_dir, "w.safetensors", Id(), save, &info).ok());
  const std::string path = iter_dir + "/w.safetensors";
  const std::string good = Slurp(path);

  // With the manifest's size and checksum: any change is caught before parsing.
  Spit(path, good.substr(0, good.size() - 100));
  auto t = ReadCheckpointFile(path, Id(), info);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr(path));
  EXPECT_THAT(t.status().message(), HasSubstr("truncated"));
  for (size_t pos : {size_t{3}, size_t{40}, good.size() / 2, good.size() - 1}) {
    std::string bad = good;
    bad[pos] ^= 0x10;
    Spit(path, bad);
    auto r = ReadCheckpointFile(path, Id(), info);
    ASSERT_FALSE(r.ok()) << "flip at " << pos;
    EXPECT_THAT(r.status().message(), HasSubstr(path));
  }
  // Without a manifest the per-array checksums still catch a flip in the data.
  std::string bad = good;
  bad[good.size() - 10] ^= 0x01;
  Spit(path, bad);
  auto r = ReadCheckpointFile(path, Id(), CheckpointFileInfo{});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("checksum"));

  // Another config, iteration or node.
  Spit(path, good);
  CheckpointIdentity other = Id();
  other.config_fingerprint = "ffffffffffffffff";
  EXPECT_THAT(ReadCheckpointFile(path, other, info).status().message(),
              HasSubstr("another config"));
  EXPECT_THAT(ReadCheckpointFile(path, Id(41), info).status().message(), HasSubstr("iteration 40"));
  other = Id();
  other.rank = 0;
  EXPECT_FALSE(ReadCheckpointFile(path, other, info).ok());
  EXPECT_TRUE(ReadCheckpointFile(path, Id(), info).ok());
}

// A node file w.safetensors of `iteration` in dir's folder of it, with the manifest that makes
// the checkpoint complete when `manifest`.
void WriteIteration(const std::string& dir, uint64_t iteration, bool manifest) {
  Component c{{1.0f}, {}, iteration, 0.0f};
  StateArchive save;
  c.State(save);
  CheckpointFileInfo info;
  const std::string d = CheckpointIterationDir(dir, iteration);
  ASSERT_TRUE(WriteCheckpointFile(d, "w.safetensors", Id(iteration), save, &info).ok());
  if (manifest) {
    ASSERT_TRUE(WriteCheckpointManifest(d, {iteration, 1, "00112233aabbccdd", {info}, {}}).ok());
  }
}

TEST_F(CheckpointTest, OnlyCheckpointsWithAManifestCountAndOldOnesArePruned) {
  const std::string dir = dir_.string();
  EXPECT_FALSE(LatestCheckpoint(dir).has_value());
  WriteIteration(dir, 100, true);
  WriteIteration(dir, 200, true);
  WriteIteration(dir, 250, false);  // abandoned before the next complete one
  WriteIteration(dir, 300, true);
  WriteIteration(dir, 400, false);  // being written
  auto latest = LatestCheckpoint(dir);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->iteration, 300u);
  ASSERT_EQ(latest->files.size(), 1u);
  EXPECT_EQ(latest->files[0].file, "w.safetensors");

  // A manifest that is not JSON makes its folder incomplete.
  Spit(CheckpointIterationDir(dir, 300) + "/MANIFEST.json", "{not json");
  EXPECT_EQ(LatestCheckpoint(dir)->iteration, 200u);
  ASSERT_TRUE(WriteCheckpointManifest(CheckpointIterationDir(dir, 300),
                                      {300, 1, "00112233aabbccdd", latest->files, {}})
                  .ok());

  EXPECT_EQ(PruneCheckpoints(dir, 2), (std::vector<uint64_t>{300, 200}));
  EXPECT_FALSE(std::filesystem::exists(CheckpointIterationDir(dir, 100)));
  EXPECT_TRUE(std::filesystem::exists(CheckpointIterationDir(dir, 200)));
  EXPECT_FALSE(std::filesystem::exists(CheckpointIterationDir(dir, 250)));
  EXPECT_TRUE(std::filesystem::exists(CheckpointIterationDir(dir, 300)));
  EXPECT_TRUE(std::filesystem::exists(CheckpointIterationDir(dir, 400)));
  // keep 0: every complete one stays, and is named.
  EXPECT_EQ(PruneCheckpoints(dir, 0), (std::vector<uint64_t>{300, 200}));
  EXPECT_TRUE(std::filesystem::exists(CheckpointIterationDir(dir, 200)));
}

// The manifest keeps the job's changes of its live workers (Membership.splits) for a resumed
// job's epochs; a manifest without them (none happened, or an older writer's) reads as none, and
// ranks out of order are refused naming the file.
TEST_F(CheckpointTest, TheManifestKeepsTheLiveWorkersChanges) {
  const std::string dir = dir_.string();
  WriteIteration(dir, 100, true);
  EXPECT_TRUE(LatestCheckpoint(dir)->splits.empty());
  EXPECT_EQ(Slurp(CheckpointIterationDir(dir, 100) + "/MANIFEST.json").find("splits"),
            std::string::npos);
  const std::string d = CheckpointIterationDir(dir, 200);
  WriteIteration(dir, 200, false);
  const auto files = ReadCheckpointManifest(CheckpointIterationDir(dir, 100))->files;
  ASSERT_TRUE(WriteCheckpointManifest(
                  d, {200, 3, "00112233aabbccdd", files, {{5, {1, 2}}, {150, {0, 1, 2}}}})
                  .ok());
  auto m = ReadCheckpointManifest(d);
  ASSERT_TRUE(m.ok()) << m.status().message();
  ASSERT_EQ(m->splits.size(), 2u);
  EXPECT_EQ(m->splits[0].from_iteration, 5);
  EXPECT_EQ(m->splits[0].ranks, (std::vector<int>{1, 2}));
  EXPECT_EQ(m->splits[1].from_iteration, 150);
  EXPECT_EQ(m->splits[1].ranks, (std::vector<int>{0, 1, 2}));
  std::string text = Slurp(d + "/MANIFEST.json");
  const size_t at = text.find("\"ranks\": [\n        1,\n        2");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, std::string("\"ranks\": [\n        1,\n        2").size(),
               "\"ranks\": [\n        2,\n        1");
  Spit(d + "/MANIFEST.json", text);
  m = ReadCheckpointManifest(d);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), ::testing::HasSubstr("MANIFEST.json refused: unsorted ranks"));
}

// A node's folder on a host of its own holds its files and no manifest: it prunes to the list
// of the checkpoints the scheduler keeps, leaving those and any newer folder.
TEST_F(CheckpointTest, ANodesFolderIsPrunedToTheCheckpointsTheSchedulerKeeps) {
  const std::string dir = dir_.string();
  for (uint64_t iteration : {100, 200, 250, 300, 400}) WriteIteration(dir, iteration, false);
  std::filesystem::create_directories(dir + "/not-an-iteration");
  PruneCheckpointsTo(dir, {300, 100});
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    left.push_back(e.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"iter-0000000100", "iter-0000000300", "iter-0000000400",
                                            "not-an-iteration"}));
  EXPECT_TRUE(std::filesystem::exists(CheckpointIterationDir(dir, 300) + "/w.safetensors"));
  // Again, with nothing left to delete (another node of the host pruned first): no change.
  PruneCheckpointsTo(dir, {300, 100});
  EXPECT_TRUE(std::filesystem::exists(CheckpointIterationDir(dir, 100)));
  PruneCheckpointsTo(dir, {400});
  EXPECT_FALSE(std::filesystem::exists(CheckpointIterationDir(dir, 100)));
  EXPECT_FALSE(std::filesystem::exists(CheckpointIterationDir(dir, 300)));
  EXPECT_TRUE(std::filesystem::exists(CheckpointIterationDir(dir, 400)));
}

// The node's side, wired as the daemons wire it: a fake scheduler (a ROUTER on loopback) sends
// CHECKPOINTS_KEPT to a ControlClient with KeepCheckpointsAsTheScheduler, and Poll prunes the
// node's folder (run.dir/checkpoints); a list that is empty or not newest first is refused,
// counted and changes nothing.
TEST_F(CheckpointTest, AControlClientPrunesItsFolderWhenTheSchedulerSaysWhatItKeeps) {
  zmq::context_t context(1);
  auto router = BindRouter(context, "127.0.0.1", 0);
  ASSERT_TRUE(router.ok()) << router.status().ToString();
  proto::JobConfig config;
  config.mutable_run()->set_dir(dir_.string());
  config.mutable_cluster()->set_scheduler_host("127.0.0.1");
  config.mutable_cluster()->set_scheduler_port(router->port);
  const std::string dir = CheckpointDir(config);
  for (uint64_t iteration : {10, 20, 30}) {
    std::filesystem::create_directories(CheckpointIterationDir(dir, iteration));
    Spit(CheckpointIterationDir(dir, iteration) + "/worker-1.safetensors", "x");
  }
  ControlClient control(context, config, proto::WORKER);
  KeepCheckpointsAsTheScheduler(control, config);
  ASSERT_TRUE(control.Register("127.0.0.1", 0, 1).ok());
  std::string node;
  ASSERT_EQ(PollIn({&router->socket}, 10000), std::vector<bool>{true});
  ASSERT_TRUE(RecvMessage(router->socket, true, &node, nullptr).ok());
  auto send_kept = [&](std::vector<uint64_t> iterations) {
    Message m;
    m.header.set_command(proto::CHECKPOINTS_KEPT);
    m.header.set_sender_role(proto::SCHEDULER);
    for (uint64_t i : iterations) m.header.mutable_checkpoints_kept()->add_iterations(i);
    ASSERT_TRUE(SendMessage(router->socket, m, &node).ok());
  };
  auto folders = [&] {
    std::vector<uint64_t> left;
    for (uint64_t iteration : {10, 20, 30}) {
      if (std::filesystem::exists(CheckpointIterationDir(dir, iteration)))
        left.push_back(iteration);
    }
    return left;
  };
  // Polls the client until `done` (within 10 s).
  auto poll_until = [&](const std::function<bool()>& done) {
    for (int i = 0; i < 1000 && !done(); ++i) {
      ASSERT_TRUE(control.Poll().ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(done());
  };
  send_kept({});
  send_kept({20, 30});
  send_kept({30, 30});
  poll_until([&] { return control.rejected() == 3; });
  EXPECT_EQ(folders(), (std::vector<uint64_t>{10, 20, 30}));
  send_kept({30, 20});
  poll_until([&] { return folders().size() == 2; });
  EXPECT_EQ(folders(), (std::vector<uint64_t>{20, 30}));
  EXPECT_EQ(control.rejected(), 3u);
}

TEST(ConfigFingerprint, CoversWhatDefinesTheTrainingOnly) {
  proto::JobConfig a;
  a.mutable_train()->set_lr(0.05);
  proto::JobConfig b = a;
  b.mutable_train()->set_epochs(9);  // training longer is a resume, not another job
  b.mutable_run()->set_dir("/elsewhere");
  b.mutable_node()->set_rank(3);
  // The servers' recovery threads: the same result for any count (a resume may use more cores).
  b.mutable_compression()->mutable_sketch()->set_server_threads(8);
  // Where it computes: a checkpoint resumes on the CPU, the GPU or another of a host's GPUs.
  b.mutable_train()->set_device(proto::CUDA);
  b.mutable_train()->set_cuda_device(3);
  EXPECT_EQ(ConfigFingerprint(a), ConfigFingerprint(b));
  b.mutable_train()->set_lr(0.1);
  EXPECT_NE(ConfigFingerprint(a), ConfigFingerprint(b));
  proto::JobConfig c = a;
  c.mutable_compression()->set_density(0.02);
  EXPECT_NE(ConfigFingerprint(a), ConfigFingerprint(c));
  c = a;
  c.mutable_cluster()->set_num_workers(3);
  EXPECT_NE(ConfigFingerprint(a), ConfigFingerprint(c));
}

}  // namespace
}  // namespace sparseps
