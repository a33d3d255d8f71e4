// Micro-benchmarks of the allreduce methods' own CPU work on one call, on one worker (a group of
// one: the ring sends nothing), so that what a method costs beside its bytes can be read apart
// from the network. Sizes: the comparison's MLP (784-2048-2048-10, 5,824,522 floats) laid out as
// sparseps.torch hands PyTorch's tensors over (Linear weights [outputs x inputs], then biases; the
// C++ Mlp keeps the transpose, worker/mlp.h) and the Transformer language model (2,506,240
// floats); PowerSGD at rank 4, and 16 and 32 on the language model (Vogels et al., NeurIPS 2019,
// Algorithm 1: two products, an orthonormalisation, the update and the residual).
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <vector>

#include "worker/collectives/peer_group.h"
#include "worker/collectives/powersgd.h"

namespace {

// The MLP's tensors as PyTorch's nn.Linear has them (the torch comparisons' PowerSGD rows).
std::vector<sparseps::TensorLayout> TorchMlpLayers() {
  std::vector<sparseps::TensorLayout> layers;
  uint64_t at = 0;
  const uint64_t widths[] = {784, 2048, 2048, 10};
  for (int l = 0; l < 3; ++l) {
    layers.push_back({"fc" + std::to_string(l) + ".weight", {widths[l + 1], widths[l]}, at});
    at += widths[l + 1] * widths[l];
    layers.push_back({"fc" + std::to_string(l) + ".bias", {widths[l + 1]}, at});
    at += widths[l + 1];
  }
  return layers;
}

// The Transformer language model of examples/language_model.py at its defaults (2,506,240
// floats: 8192-token embeddings and output layer of width 128, two pre-norm layers), in
// named_parameters() order, as sparseps.torch hands them over.
std::vector<sparseps::TensorLayout> TorchLmLayers() {
  std::vector<sparseps::TensorLayout> layers;
  uint64_t at = 0;
  auto add = [&](const std::string& name, std::vector<uint64_t> shape) {
    uint64_t n = 1;
    for (uint64_t d : shape) n *= d;
    layers.push_back({name, std::move(shape), at});
    at += n;
  };
  add("embed.weight", {8192, 128});
  add("position.weight", {32, 128});
  for (int l = 0; l < 2; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "self_attn.in_proj_weight", {384, 128});
    add(p + "self_attn.in_proj_bias", {384});
    add(p + "self_attn.out_proj.weight", {128, 128});
    add(p + "self_attn.out_proj.bias", {128});
    add(p + "linear1.weight", {512, 128});
    add(p + "linear1.bias", {512});
    add(p + "linear2.weight", {128, 512});
    add(p + "linear2.bias", {128});
    for (const char* norm : {"norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"}) {
      add(p + norm, {128});
    }
  }
  add("norm.weight", {128});
  add("norm.bias", {128});
  add("out.weight", {8192, 128});
  add("out.bias", {8192});
  return layers;
}

// PowerSgd::Allreduce on a host contribution of a model's size (0: the MLP, 1: the language
// model; the second argument is the rank): gradient plus residual in, the update and the new
// residual out.
void BM_PowerSgdCall(benchmark::State& state) {
  zmq::context_t context(1);
  auto group = sparseps::PeerGroup::Bind(context, "127.0.0.1", 0, 30.0);
  if (!group.ok()) {
    state.SkipWithError(group.status().ToString().c_str());
    return;
  }
  (*group)->Connect(0, {{"127.0.0.1", (*group)->port(), "", ""}});
  sparseps::CollectiveOptions options;
  options.layers = state.range(0) == 0 ? TorchMlpLayers() : TorchLmLayers();
  uint64_t n = 1;
  for (uint64_t d : options.layers.back().shape) n *= d;
  options.num_params = options.layers.back().offset + n;
  options.powersgd_rank = static_cast<uint32_t>(state.range(1));
  sparseps::PowerSgd powersgd(group->get(), options);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> grad(options.num_params), x(options.num_params, 0.0f);
  for (auto& v : grad) v = 1e-3f * normal(rng);
  sparseps::CollectiveUpdate update;
  for (auto _ : state) {
    for (size_t i = 0; i < x.size(); ++i) x[i] += grad[i];
    auto s = powersgd.Allreduce(&x, &update);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(update.sum.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * x.size() * sizeof(float)));
}
BENCHMARK(BM_PowerSgdCall)
    ->ArgNames({"lm", "rank"})
    ->Args({0, 4})
    ->Args({1, 4})
    ->Args({1, 16})
    ->Args({1, 32})
    ->Unit(benchmark::kMillisecond);

}  // namespace
