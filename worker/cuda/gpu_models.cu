// GPU twins of the MLP and the CNN (see gpu_models.h): one class for both, an optional stack of
// conv layers and then the fully connected layers, mirroring worker/cnn.cc and worker/mlp.cc
// operation for operation.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "encodings/cuda/cuda_arrays.h"
#include "encodings/cuda/cuda_status.h"
#include "kernels/cuda/counted_memcpy.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/dense_kernels.h"
#include "kernels/device.h"
#include "worker/cnn.h"
#include "worker/cuda/cublas_loader.h"
#include "worker/cuda/gpu_models.h"
#include "worker/mlp.h"

namespace sparseps {
namespace {

namespace gpu = kernels::gpu;

Status BlasFailure(const CublasApi& api, cublasStatus_t e, const char* what) {
  return Status::FailedPrecondition(std::string("cuBLAS error in ") + what + ": " +
                                    api.status_string(e));
}

#define GPU_TRY(expr, what)                             \
  do {                                                  \
    const cudaError_t e_ = (expr);                      \
    if (e_ != cudaSuccess) return CudaStatus(e_, what); \
  } while (0)
// In GpuNet's members only: the message comes from the loaded cuBLAS (blas_api_).
#define BLAS_TRY(expr, what)                                                   \
  do {                                                                         \
    const cublasStatus_t e_ = (expr);                                          \
    if (e_ != CUBLAS_STATUS_SUCCESS) return BlasFailure(*blas_api_, e_, what); \
  } while (0)

class GpuNet final : public Model {
 public:
  // twin: the CPU model (layout, InitParams, Describe); convs/kernel/head_offset: its conv
  // layers (none for an MLP); head: its fully connected part.
  GpuNet(std::unique_ptr<Model> twin, std::vector<Cnn::Conv> convs, size_t kernel,
         size_t head_offset, const Mlp& head)
      : twin_(std::move(twin)),
        convs_(std::move(convs)),
        kernel_(kernel),
        head_offset_(head_offset),
        sizes_(head.sizes()) {
    for (size_t l = 0; l + 1 < sizes_.size(); ++l) {
      w_offset_.push_back(head.w_offset(l));
      b_offset_.push_back(head.b_offset(l));
    }
    col_.resize(convs_.size());
    act_.resize(convs_.size());
    pooled_.resize(convs_.size());
    argmax_.resize(convs_.size());
    fc_.resize(sizes_.size() - 1);
  }

  ~GpuNet() override {
    if (blas_ != nullptr) blas_api_->destroy(blas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status Start() {
    GPU_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    Result<const CublasApi*> api = Cublas();
    if (!api.ok()) return api.status();
    blas_api_ = *api;
    BLAS_TRY(blas_api_->create(&blas_), "cublasCreate");
    BLAS_TRY(blas_api_->set_stream(blas_, stream_), "cublasSetStream");
    // FP32 GEMMs (no TF32), so the GPU model stays within float rounding of the CPU model.
    BLAS_TRY(blas_api_->set_math_mode(blas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    return Status::OK();
  }

  size_t num_params() const override { return twin_->num_params(); }
  std::string Describe() const override { return twin_->Describe() + " on CUDA"; }
  bool on_device() const override { return true; }
  void InitParams(uint64_t seed, float* params) const override { twin_->InitParams(seed, params); }
  Status status() const override { return status_; }

  double ForwardBackward(const float* params, const float* x, const uint8_t* y, size_t batch,
                         float* grad, size_t* correct) override {
    if (!status_.ok()) return std::numeric_limits<double>::quiet_NaN();
    double loss = 0.0;
    Record([&]() -> Status {
      SPARSEPS_RETURN_IF_ERROR(Upload(x, y, batch));
      SPARSEPS_RETURN_IF_ERROR(Forward(params, batch));
      SPARSEPS_RETURN_IF_ERROR(Backward(params, batch, grad));
      return SumLoss(batch, &loss, correct);
    }());
    return status_.ok() ? loss : std::numeric_limits<double>::quiet_NaN();
  }

  std::pair<double, double> Evaluate(const float* params, const Dataset& data) override {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    if (!status_.ok()) return {nan, nan};
    auto result = EvaluateInChunks(
        data, convs_.empty() ? 1000 : 100,
        [&](const float* x, const uint8_t* y, size_t n, size_t* correct) {
          double loss = nan;
          if (!status_.ok()) return loss;
          Record([&]() -> Status {
            SPARSEPS_RETURN_IF_ERROR(Upload(x, y, n));
            SPARSEPS_RETURN_IF_ERROR(Forward(params, n));
            GPU_TRY(gpu::SoftmaxCrossEntropy(logits(), y_.p, n, sizes_.back(), nullptr, row_loss_.p,
                                             row_correct_.p, stream_),
                    "softmax cross-entropy");
            return SumLoss(n, &loss, correct);
          }());
          return loss;
        });
    if (!status_.ok()) return {nan, nan};
    return result;
  }

 private:
  // Keeps s as the model's status (nvcc's front end warns on the ignored Status& of operator=).
  void Record(Status s) { static_cast<void>(status_ = std::move(s)); }

  size_t features() const { return convs_.empty() ? sizes_[0] : convs_[0].h * convs_[0].w; }
  float* logits() { return fc_.back().p; }

  // Row-major C = op(A) op(B) through column-major cuBLAS: C^T = op(B)^T op(A)^T.
  Status Gemm(bool ta, bool tb, size_t m, size_t n, size_t k, const float* a, size_t lda,
              const float* b, size_t ldb, float* c, size_t ldc) {
    const float one = 1.0f, zero = 0.0f;
    BLAS_TRY(blas_api_->sgemm(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                              static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &one,
                              b, static_cast<int>(ldb), a, static_cast<int>(lda), &zero, c,
                              static_cast<int>(ldc)),
             "cublasSgemm");
    return Status::OK();
  }

  Status Reserve(size_t batch) {
    if (batch <= reserved_batch_) return Status::OK();
    const size_t classes = sizes_.back();
    SPARSEPS_RETURN_IF_ERROR(x_.Reserve(batch * features()));
    SPARSEPS_RETURN_IF_ERROR(x_host_.Reserve(batch * features()));
    SPARSEPS_RETURN_IF_ERROR(y_.Reserve(batch));
    SPARSEPS_RETURN_IF_ERROR(y_host_.Reserve(batch));
    SPARSEPS_RETURN_IF_ERROR(row_loss_.Reserve(batch));
    SPARSEPS_RETURN_IF_ERROR(row_correct_.Reserve(batch));
    SPARSEPS_RETURN_IF_ERROR(loss_host_.Reserve(batch));
    SPARSEPS_RETURN_IF_ERROR(correct_host_.Reserve(batch));
    size_t widest_col = 0, widest_act = 0, widest_rows = batch;
    for (size_t i = 0; i < convs_.size(); ++i) {
      const Cnn::Conv& c = convs_[i];
      const size_t positions = batch * c.h * c.w;
      SPARSEPS_RETURN_IF_ERROR(col_[i].Reserve(positions * kernel_ * kernel_ * c.c_in));
      SPARSEPS_RETURN_IF_ERROR(act_[i].Reserve(positions * c.c_out));
      SPARSEPS_RETURN_IF_ERROR(pooled_[i].Reserve(batch * (c.h / 2) * (c.w / 2) * c.c_out));
      SPARSEPS_RETURN_IF_ERROR(argmax_[i].Reserve(batch * (c.h / 2) * (c.w / 2) * c.c_out));
      widest_col = std::max(widest_col, positions * kernel_ * kernel_ * c.c_in);
      widest_act = std::max({widest_act, positions * c.c_out, positions * c.c_in});
      widest_rows = std::max(widest_rows, positions);
    }
    size_t widest_fc = 0, widest_cols = classes;
    for (size_t l = 0; l + 1 < sizes_.size(); ++l) {
      SPARSEPS_RETURN_IF_ERROR(fc_[l].Reserve(batch * sizes_[l + 1]));
      widest_fc = std::max({widest_fc, sizes_[l + 1], sizes_[l]});
    }
    for (const Cnn::Conv& c : convs_) widest_cols = std::max(widest_cols, c.c_out);
    widest_cols = std::max(widest_cols, widest_fc);
    SPARSEPS_RETURN_IF_ERROR(delta_.Reserve(batch * widest_fc));
    SPARSEPS_RETURN_IF_ERROR(delta_prev_.Reserve(batch * widest_fc));
    SPARSEPS_RETURN_IF_ERROR(d_pooled_.Reserve(std::max(widest_act, batch * widest_fc)));
    SPARSEPS_RETURN_IF_ERROR(d_act_.Reserve(widest_act));
    SPARSEPS_RETURN_IF_ERROR(d_col_.Reserve(widest_col));
    SPARSEPS_RETURN_IF_ERROR(sum_scratch_.Reserve(gpu::SumRowsScratch(widest_rows, widest_cols)));
    reserved_batch_ = batch;
    return Status::OK();
  }

  // Copies the batch to the device through the pinned buffers.
  Status Upload(const float* x, const uint8_t* y, size_t batch) {
    SPARSEPS_RETURN_IF_ERROR(Reserve(batch));
    const size_t nx = batch * features();
    std::memcpy(x_host_.p, x, nx * sizeof(float));
    std::memcpy(y_host_.p, y, batch);
    GPU_TRY(
        CountedMemcpyAsync(x_.p, x_host_.p, nx * sizeof(float), cudaMemcpyHostToDevice, stream_),
        "copying the batch");
    GPU_TRY(CountedMemcpyAsync(y_.p, y_host_.p, batch, cudaMemcpyHostToDevice, stream_),
            "copying the labels");
    return Status::OK();
  }

  Status Forward(const float* params, size_t batch) {
    const float* in = x_.p;
    for (size_t i = 0; i < convs_.size(); ++i) {
      const Cnn::Conv& c = convs_[i];
      const size_t positions = batch * c.h * c.w, patch = kernel_ * kernel_ * c.c_in;
      GPU_TRY(gpu::Im2ColSame(in, batch, c.h, c.w, c.c_in, kernel_, col_[i].p, stream_), "im2col");
      SPARSEPS_RETURN_IF_ERROR(Gemm(false, true, positions, c.c_out, patch, col_[i].p, patch,
                                    params + c.w_offset, patch, act_[i].p, c.c_out));
      GPU_TRY(gpu::AddBiasRows(act_[i].p, params + c.b_offset, positions, c.c_out, stream_),
              "bias");
      GPU_TRY(gpu::ReluForward(act_[i].p, positions * c.c_out, stream_), "relu");
      GPU_TRY(
          gpu::MaxPool2x2(act_[i].p, batch, c.h, c.w, c.c_out, pooled_[i].p, argmax_[i].p, stream_),
          "max pooling");
      in = pooled_[i].p;
    }
    const float* head = params + head_offset_;
    for (size_t l = 0; l + 1 < sizes_.size(); ++l) {
      const size_t n_in = sizes_[l], n_out = sizes_[l + 1];
      SPARSEPS_RETURN_IF_ERROR(Gemm(false, false, batch, n_out, n_in, in, n_in, head + w_offset_[l],
                                    n_out, fc_[l].p, n_out));
      GPU_TRY(gpu::AddBiasRows(fc_[l].p, head + b_offset_[l], batch, n_out, stream_), "bias");
      if (l + 2 < sizes_.size()) {
        GPU_TRY(gpu::ReluForward(fc_[l].p, batch * n_out, stream_), "relu");
      }
      in = fc_[l].p;
    }
    return Status::OK();
  }

  Status Backward(const float* params, size_t batch, float* grad) {
    GPU_TRY(gpu::SoftmaxCrossEntropy(logits(), y_.p, batch, sizes_.back(), delta_.p, row_loss_.p,
                                     row_correct_.p, stream_),
            "softmax cross-entropy");
    const float* head = params + head_offset_;
    float* head_grad = grad + head_offset_;
    for (size_t l = sizes_.size() - 1; l-- > 0;) {
      const size_t n_in = sizes_[l], n_out = sizes_[l + 1];
      const float* in = l > 0 ? fc_[l - 1].p : (convs_.empty() ? x_.p : pooled_.back().p);
      SPARSEPS_RETURN_IF_ERROR(Gemm(true, false, n_in, n_out, batch, in, n_in, delta_.p, n_out,
                                    head_grad + w_offset_[l], n_out));
      GPU_TRY(
          gpu::SumRows(delta_.p, batch, n_out, head_grad + b_offset_[l], sum_scratch_.p, stream_),
          "bias gradient");
      if (l == 0) {
        if (!convs_.empty()) {
          SPARSEPS_RETURN_IF_ERROR(Gemm(false, true, batch, n_in, n_out, delta_.p, n_out,
                                        head + w_offset_[l], n_out, d_pooled_.p, n_in));
        }
        SPARSEPS_RETURN_IF_ERROR(Report(head_offset_ + w_offset_[l]));
        break;
      }
      SPARSEPS_RETURN_IF_ERROR(Gemm(false, true, batch, n_in, n_out, delta_.p, n_out,
                                    head + w_offset_[l], n_out, delta_prev_.p, n_in));
      GPU_TRY(gpu::ReluBackward(delta_prev_.p, fc_[l - 1].p, batch * n_in, stream_), "relu");
      std::swap(delta_.p, delta_prev_.p);
      std::swap(delta_.cap, delta_prev_.cap);
      // Layer l's weights and biases (the layout's tail from there), as the CPU model reports.
      SPARSEPS_RETURN_IF_ERROR(Report(head_offset_ + w_offset_[l]));
    }
    for (size_t i = convs_.size(); i-- > 0;) {
      const Cnn::Conv& c = convs_[i];
      const size_t positions = batch * c.h * c.w, patch = kernel_ * kernel_ * c.c_in;
      const size_t pooled = batch * (c.h / 2) * (c.w / 2) * c.c_out;
      GPU_TRY(gpu::MaxPool2x2Backward(d_pooled_.p, argmax_[i].p, pooled, positions * c.c_out,
                                      d_act_.p, stream_),
              "max pooling backward");
      GPU_TRY(gpu::ReluBackward(d_act_.p, act_[i].p, positions * c.c_out, stream_), "relu");
      SPARSEPS_RETURN_IF_ERROR(Gemm(true, false, c.c_out, patch, positions, d_act_.p, c.c_out,
                                    col_[i].p, patch, grad + c.w_offset, patch));
      GPU_TRY(
          gpu::SumRows(d_act_.p, positions, c.c_out, grad + c.b_offset, sum_scratch_.p, stream_),
          "bias gradient");
      if (i == 0) return Report(c.w_offset);
      SPARSEPS_RETURN_IF_ERROR(Gemm(false, false, positions, patch, c.c_out, d_act_.p, c.c_out,
                                    params + c.w_offset, patch, d_col_.p, patch));
      GPU_TRY(gpu::Col2ImSame(d_col_.p, batch, c.h, c.w, c.c_in, kernel_, d_pooled_.p, stream_),
              "col2im");
      SPARSEPS_RETURN_IF_ERROR(Report(c.w_offset));  // conv i's weights and biases on
    }
    return Status::OK();
  }

  // grad[key, n) is final: with a hook set (train.overlap: backward, or a trace), once the
  // kernels queued so far have run, since the hook's reader works on streams of its own.
  Status Report(size_t key) {
    if (!reports_gradients()) return Status::OK();
    GPU_TRY(cudaStreamSynchronize(stream_), "the backward pass up to a layer");
    GradientReady(key);
    return Status::OK();
  }

  // Copies the per-row losses back (the one synchronisation of a step) and sums them in row
  // order, as the CPU does.
  Status SumLoss(size_t batch, double* loss, size_t* correct) {
    GPU_TRY(CountedMemcpyAsync(loss_host_.p, row_loss_.p, batch * sizeof(double),
                               cudaMemcpyDeviceToHost, stream_),
            "copying the losses");
    GPU_TRY(
        CountedMemcpyAsync(correct_host_.p, row_correct_.p, batch, cudaMemcpyDeviceToHost, stream_),
        "copying the predictions");
    GPU_TRY(cudaStreamSynchronize(stream_), "the step");
    double total = 0.0;
    size_t right = 0;
    for (size_t r = 0; r < batch; ++r) {
      total += loss_host_.p[r];
      right += correct_host_.p[r];
    }
    *loss = total / static_cast<double>(std::max<size_t>(batch, 1));
    if (correct != nullptr) *correct += right;
    return Status::OK();
  }

  std::unique_ptr<Model> twin_;
  std::vector<Cnn::Conv> convs_;
  size_t kernel_;
  size_t head_offset_;
  std::vector<size_t> sizes_, w_offset_, b_offset_;
  cudaStream_t stream_ = nullptr;
  const CublasApi* blas_api_ = nullptr;  // loaded at Start (dlopen)
  cublasHandle_t blas_ = nullptr;
  Status status_;
  size_t reserved_batch_ = 0;
  DeviceArray<float> x_;
  DeviceArray<uint8_t> y_, row_correct_;
  DeviceArray<double> row_loss_;
  PinnedArray<float> x_host_;
  PinnedArray<uint8_t> y_host_, correct_host_;
  PinnedArray<double> loss_host_;
  std::vector<DeviceArray<float>> col_, act_, pooled_, fc_;
  std::vector<DeviceArray<uint32_t>> argmax_;
  DeviceArray<float> delta_, delta_prev_, d_pooled_, d_act_, d_col_, sum_scratch_;
};

Result<std::unique_ptr<Model>> Start(std::unique_ptr<GpuNet> net) {
  if (std::string why; !kernels::CudaDeviceAvailable(&why)) {
    return Status::FailedPrecondition("train.device: cuda, but " + why);
  }
  SPARSEPS_RETURN_IF_ERROR(net->Start());
  return std::unique_ptr<Model>(std::move(net));
}

}  // namespace

Result<std::unique_ptr<Model>> MakeGpuMlp(size_t inputs, std::vector<size_t> hidden,
                                          size_t classes) {
  auto twin = std::make_unique<Mlp>(inputs, std::move(hidden), classes);
  const Mlp& head = *twin;
  return Start(std::make_unique<GpuNet>(std::move(twin), std::vector<Cnn::Conv>{}, 0, 0, head));
}

Result<std::unique_ptr<Model>> MakeGpuCnn(size_t rows, size_t cols, std::vector<size_t> channels,
                                          size_t kernel, std::vector<size_t> hidden,
                                          size_t classes) {
  auto twin =
      std::make_unique<Cnn>(rows, cols, std::move(channels), kernel, std::move(hidden), classes);
  const Cnn& cnn = *twin;
  auto convs = cnn.convs();
  return Start(std::make_unique<GpuNet>(std::move(twin), std::move(convs), cnn.kernel(),
                                        cnn.head_offset(), cnn.head()));
}

}  // namespace sparseps
