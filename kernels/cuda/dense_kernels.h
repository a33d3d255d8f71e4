// CUDA twins of the model kernels in kernels/dense.h and kernels/conv.h (bias, ReLU, softmax
// cross-entropy, im2col / col2im, 2x2 max pooling) for the GPU models (worker/cuda). The GEMMs
// themselves are cuBLAS sgemm calls in the models.
//
// Conventions as kernels/cuda/gpu_kernels.h: device pointers, work enqueued on `stream`, the
// launch's CUDA error returned. Matrices row-major, tensors NHWC. Results equal the CPU twins'
// bitwise (the same operations in the same order per element), except SumRows, which adds in
// blocks of rows (deterministic, within float rounding of the CPU's sum), and
// SoftmaxCrossEntropy, whose double exp/log may differ from glibc's in the last bit.
// Thread-safety: reentrant.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace sparseps::kernels::gpu {

// y[r, c] += bias[c] for a rows x cols matrix.
cudaError_t AddBiasRows(float* y, const float* bias, size_t rows, size_t cols, cudaStream_t stream);

// y = max(y, 0) in place.
cudaError_t ReluForward(float* y, size_t n, cudaStream_t stream);

// dy[i] = 0 where y[i] <= 0.
cudaError_t ReluBackward(float* dy, const float* y, size_t n, cudaStream_t stream);

// out[c] = sum over rows of y[r, c]: partial sums over blocks of kSumRowsBlock rows, then the
// partials in order (deterministic). scratch: SumRowsScratch(rows, cols) floats.
constexpr size_t kSumRowsBlock = 64;
inline size_t SumRowsScratch(size_t rows, size_t cols) {
  return (rows + kSumRowsBlock - 1) / kSumRowsBlock * cols;
}
cudaError_t SumRows(const float* y, size_t rows, size_t cols, float* out, float* scratch,
                    cudaStream_t stream);

// Softmax cross-entropy per row (twin of kernels::SoftmaxCrossEntropy): row_loss[r] = the row's
// loss (nats, double), row_correct[r] = 1 when its arg-max is the label; when dlogits is not null
// it gets (softmax - onehot) / rows. The caller sums row_loss (in row order, as the CPU does).
cudaError_t SoftmaxCrossEntropy(const float* logits, const uint8_t* labels, size_t rows,
                                size_t classes, float* dlogits, double* row_loss,
                                uint8_t* row_correct, cudaStream_t stream);

// Twins of kernels::Im2ColSame / Col2ImSame / MaxPool2x2 / MaxPool2x2Backward (same shapes).
// Col2ImSame gathers per input element (no atomics), so it is deterministic.
cudaError_t Im2ColSame(const float* x, size_t batch, size_t h, size_t w, size_t c, size_t k,
                       float* col, cudaStream_t stream);
cudaError_t Col2ImSame(const float* dcol, size_t batch, size_t h, size_t w, size_t c, size_t k,
                       float* dx, cudaStream_t stream);
cudaError_t MaxPool2x2(const float* x, size_t batch, size_t h, size_t w, size_t c, float* y,
                       uint32_t* argmax, cudaStream_t stream);
cudaError_t MaxPool2x2Backward(const float* dy, const uint32_t* argmax, size_t n_out, size_t n_in,
                               float* dx, cudaStream_t stream);

}  // namespace sparseps::kernels::gpu
