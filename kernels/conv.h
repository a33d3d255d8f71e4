// Convolution and pooling kernels for the CNN (worker/cnn.h): im2col / col2im for a "same"
// convolution and 2x2 max pooling, on NHWC tensors (batch x height x width x channels, row-major).
// The convolution itself is one GEMM over the im2col matrix (kernels/dense.h).
//
// Thread-safety: reentrant.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sparseps::kernels {

// Im2col for a k x k convolution with stride 1 and zero padding k / 2 (k odd: the output has the
// input's height and width). x: [batch x h x w x c]; col: [batch*h*w x k*k*c], row (b, y, x),
// column (ky, kx, ci) — the layout of the weights [c_out x k*k*c] of worker/cnn.h.
void Im2ColSame(const float* x, size_t batch, size_t h, size_t w, size_t c, size_t k, float* col);

// The adjoint of Im2ColSame: dx[b, y, x, ci] = the sum of the dcol entries Im2ColSame copied
// from x[b, y, x, ci]. Overwrites dx ([batch x h x w x c]).
void Col2ImSame(const float* dcol, size_t batch, size_t h, size_t w, size_t c, size_t k, float* dx);

// 2x2 max pooling with stride 2 (odd trailing rows/columns dropped): y [batch x h/2 x w/2 x c],
// argmax [same shape] = the offset in x of each maximum (the first of equal values, in row order).
void MaxPool2x2(const float* x, size_t batch, size_t h, size_t w, size_t c, float* y,
                uint32_t* argmax);

// The backward pass of MaxPool2x2: dx = 0 (n_in elements), then dx[argmax[i]] += dy[i] for the
// n_out outputs.
void MaxPool2x2Backward(const float* dy, const uint32_t* argmax, size_t n_out, size_t n_in,
                        float* dx);

}  // namespace sparseps::kernels
