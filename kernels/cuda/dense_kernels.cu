// CUDA twins of the model kernels (see dense_kernels.h).
#include <cmath>

#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/dense_kernels.h"

namespace sparseps::kernels::gpu {
namespace {

__global__ void AddBiasRowsKernel(float* y, const float* bias, size_t rows, size_t cols) {
  const size_t n = rows * cols;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    y[i] = __fadd_rn(y[i], bias[i % cols]);
  }
}

__global__ void ReluForwardKernel(float* y, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    y[i] = y[i] > 0.0f ? y[i] : 0.0f;
  }
}

__global__ void ReluBackwardKernel(float* dy, const float* y, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    if (!(y[i] > 0.0f)) dy[i] = 0.0f;
  }
}

// partial[b, c] = sum of y[r, c] over the rows r of block b (kSumRowsBlock rows).
__global__ void SumRowsPartialKernel(const float* y, size_t rows, size_t cols, float* partial) {
  const size_t c = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  const size_t b = blockIdx.y;
  if (c >= cols) return;
  const size_t end = min(rows, (b + 1) * kSumRowsBlock);
  float s = 0.0f;
  for (size_t r = b * kSumRowsBlock; r < end; ++r) s = __fadd_rn(s, y[r * cols + c]);
  partial[b * cols + c] = s;
}

__global__ void SumPartialsKernel(const float* partial, size_t blocks, size_t cols, float* out) {
  const size_t c = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (size_t b = 0; b < blocks; ++b) s = __fadd_rn(s, partial[b * cols + c]);
  out[c] = s;
}

// One thread per row, the CPU's arithmetic (double exp / log).
__global__ void SoftmaxCrossEntropyKernel(const float* logits, const uint8_t* labels, size_t rows,
                                          size_t classes, float* dlogits, double* row_loss,
                                          uint8_t* row_correct) {
  const size_t r = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  if (r >= rows) return;
  const float* z = logits + r * classes;
  size_t arg = 0;
  float zmax = z[0];
  for (size_t c = 1; c < classes; ++c) {
    if (z[c] > zmax) {
      zmax = z[c];
      arg = c;
    }
  }
  double sum = 0.0;
  for (size_t c = 0; c < classes; ++c) sum += exp(static_cast<double>(z[c] - zmax));
  const double log_sum = log(sum);
  const size_t label = labels[r];
  row_loss[r] = log_sum - static_cast<double>(z[label] - zmax);
  row_correct[r] = arg == label ? 1 : 0;
  if (dlogits != nullptr) {
    const float inv_rows = 1.0f / static_cast<float>(rows);
    float* d = dlogits + r * classes;
    for (size_t c = 0; c < classes; ++c) {
      const double p = exp(static_cast<double>(z[c] - zmax) - log_sum);
      d[c] = __fmul_rn(static_cast<float>(p), inv_rows);
    }
    d[label] = __fsub_rn(d[label], inv_rows);
  }
}

// One thread per col element: (position, ky, kx, ci).
__global__ void Im2ColKernel(const float* x, size_t batch, size_t h, size_t w, size_t c, size_t k,
                             float* col) {
  const size_t row_len = k * k * c;
  const size_t n = batch * h * w * row_len;
  const long pad = static_cast<long>(k / 2);
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const size_t pos = i / row_len, j = i % row_len;
    const size_t ci = j % c, kx = (j / c) % k, ky = j / (c * k);
    const size_t b = pos / (h * w), yx = pos % (h * w);
    const long sy = static_cast<long>(yx / w + ky) - pad, sx = static_cast<long>(yx % w + kx) - pad;
    col[i] = (sy < 0 || sy >= static_cast<long>(h) || sx < 0 || sx >= static_cast<long>(w))
                 ? 0.0f
                 : x[((b * h + static_cast<size_t>(sy)) * w + static_cast<size_t>(sx)) * c + ci];
  }
}

// One thread per dx element; adds the col entries copied from it in the CPU's order (below).
__global__ void Col2ImKernel(const float* dcol, size_t batch, size_t h, size_t w, size_t c,
                             size_t k, float* dx) {
  const size_t n = batch * h * w * c;
  const long pad = static_cast<long>(k / 2);
  const size_t row_len = k * k * c;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const size_t ci = i % c, pix = i / c;
    const size_t b = pix / (h * w), sy = (pix % (h * w)) / w, sx = pix % w;
    float s = 0.0f;
    // The CPU visits output positions (y, x) in row order and, for each, (ky, kx); position
    // (y, x) reads this element with ky = sy - y + pad, kx = sx - x + pad. Same order here.
    for (long ky = static_cast<long>(k) - 1; ky >= 0; --ky) {
      const long y = static_cast<long>(sy) + pad - ky;
      if (y < 0 || y >= static_cast<long>(h)) continue;
      for (long kx = static_cast<long>(k) - 1; kx >= 0; --kx) {
        const long x = static_cast<long>(sx) + pad - kx;
        if (x < 0 || x >= static_cast<long>(w)) continue;
        const size_t pos = (b * h + static_cast<size_t>(y)) * w + static_cast<size_t>(x);
        s = __fadd_rn(
            s,
            dcol[pos * row_len + (static_cast<size_t>(ky) * k + static_cast<size_t>(kx)) * c + ci]);
      }
    }
    dx[i] = s;
  }
}

__global__ void MaxPoolKernel(const float* x, size_t batch, size_t h, size_t w, size_t c, float* y,
                              uint32_t* argmax) {
  const size_t oh = h / 2, ow = w / 2;
  const size_t n = batch * oh * ow * c;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const size_t ci = i % c, pix = i / c;
    const size_t b = pix / (oh * ow), oy = (pix % (oh * ow)) / ow, ox = pix % ow;
    size_t best = ((b * h + 2 * oy) * w + 2 * ox) * c + ci;
    for (size_t dy = 0; dy < 2; ++dy) {
      for (size_t dx = 0; dx < 2; ++dx) {
        const size_t at = ((b * h + 2 * oy + dy) * w + 2 * ox + dx) * c + ci;
        if (x[at] > x[best]) best = at;
      }
    }
    y[i] = x[best];
    argmax[i] = static_cast<uint32_t>(best);
  }
}

// The pooling windows are disjoint, so each dx entry gets at most one dy: a plain store.
__global__ void MaxPoolBackwardKernel(const float* dy, const uint32_t* argmax, size_t n_out,
                                      float* dx) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n_out;
       i += size_t{gridDim.x} * blockDim.x) {
    dx[argmax[i]] = dy[i];
  }
}

}  // namespace

cudaError_t AddBiasRows(float* y, const float* bias, size_t rows, size_t cols,
                        cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  AddBiasRowsKernel<<<Blocks(rows * cols), kThreads, 0, stream>>>(y, bias, rows, cols);
  return cudaGetLastError();
}

cudaError_t ReluForward(float* y, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ReluForwardKernel<<<Blocks(n), kThreads, 0, stream>>>(y, n);
  return cudaGetLastError();
}

cudaError_t ReluBackward(float* dy, const float* y, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ReluBackwardKernel<<<Blocks(n), kThreads, 0, stream>>>(dy, y, n);
  return cudaGetLastError();
}

cudaError_t SumRows(const float* y, size_t rows, size_t cols, float* out, float* scratch,
                    cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  const size_t blocks = (rows + kSumRowsBlock - 1) / kSumRowsBlock;
  if (blocks == 0) return cudaMemsetAsync(out, 0, cols * sizeof(float), stream);
  const unsigned col_blocks = static_cast<unsigned>((cols + kThreads - 1) / kThreads);
  SumRowsPartialKernel<<<dim3(col_blocks, static_cast<unsigned>(blocks)), kThreads, 0, stream>>>(
      y, rows, cols, scratch);
  SPARSEPS_CUDA_TRY(cudaGetLastError());
  SumPartialsKernel<<<col_blocks, kThreads, 0, stream>>>(scratch, blocks, cols, out);
  return cudaGetLastError();
}

cudaError_t SoftmaxCrossEntropy(const float* logits, const uint8_t* labels, size_t rows,
                                size_t classes, float* dlogits, double* row_loss,
                                uint8_t* row_correct, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  SoftmaxCrossEntropyKernel<<<blocks, kThreads, 0, stream>>>(logits, labels, rows, classes, dlogits,
                                                             row_loss, row_correct);
  return cudaGetLastError();
}

cudaError_t Im2ColSame(const float* x, size_t batch, size_t h, size_t w, size_t c, size_t k,
                       float* col, cudaStream_t stream) {
  const size_t n = batch * h * w * k * k * c;
  if (n == 0) return cudaSuccess;
  Im2ColKernel<<<Blocks(n), kThreads, 0, stream>>>(x, batch, h, w, c, k, col);
  return cudaGetLastError();
}

cudaError_t Col2ImSame(const float* dcol, size_t batch, size_t h, size_t w, size_t c, size_t k,
                       float* dx, cudaStream_t stream) {
  const size_t n = batch * h * w * c;
  if (n == 0) return cudaSuccess;
  Col2ImKernel<<<Blocks(n), kThreads, 0, stream>>>(dcol, batch, h, w, c, k, dx);
  return cudaGetLastError();
}

cudaError_t MaxPool2x2(const float* x, size_t batch, size_t h, size_t w, size_t c, float* y,
                       uint32_t* argmax, cudaStream_t stream) {
  const size_t n = batch * (h / 2) * (w / 2) * c;
  if (n == 0) return cudaSuccess;
  MaxPoolKernel<<<Blocks(n), kThreads, 0, stream>>>(x, batch, h, w, c, y, argmax);
  return cudaGetLastError();
}

cudaError_t MaxPool2x2Backward(const float* dy, const uint32_t* argmax, size_t n_out, size_t n_in,
                               float* dx, cudaStream_t stream) {
  SPARSEPS_CUDA_TRY(cudaMemsetAsync(dx, 0, n_in * sizeof(float), stream));
  if (n_out == 0) return cudaSuccess;
  MaxPoolBackwardKernel<<<Blocks(n_out), kThreads, 0, stream>>>(dy, argmax, n_out, dx);
  return cudaGetLastError();
}

}  // namespace sparseps::kernels::gpu
