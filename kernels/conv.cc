#include "kernels/conv.h"

#include <algorithm>

namespace sparseps::kernels {

void Im2ColSame(const float* x, size_t batch, size_t h, size_t w, size_t c, size_t k, float* col) {
  const ptrdiff_t pad = static_cast<ptrdiff_t>(k / 2);
  const ptrdiff_t hh = static_cast<ptrdiff_t>(h), ww = static_cast<ptrdiff_t>(w);
  const size_t row_len = k * k * c;
  for (size_t b = 0; b < batch; ++b) {
    const float* xb = x + b * h * w * c;
    for (ptrdiff_t y = 0; y < hh; ++y) {
      for (ptrdiff_t xx = 0; xx < ww; ++xx) {
        float* out =
            col + ((b * h + static_cast<size_t>(y)) * w + static_cast<size_t>(xx)) * row_len;
        for (ptrdiff_t ky = 0; ky < static_cast<ptrdiff_t>(k); ++ky) {
          const ptrdiff_t sy = y + ky - pad;
          for (ptrdiff_t kx = 0; kx < static_cast<ptrdiff_t>(k); ++kx, out += c) {
            const ptrdiff_t sx = xx + kx - pad;
            if (sy < 0 || sy >= hh || sx < 0 || sx >= ww) {
              std::fill(out, out + c, 0.0f);
            } else {
              std::copy_n(xb + (static_cast<size_t>(sy) * w + static_cast<size_t>(sx)) * c, c, out);
            }
          }
        }
      }
    }
  }
}

void Col2ImSame(const float* dcol, size_t batch, size_t h, size_t w, size_t c, size_t k,
                float* dx) {
  std::fill(dx, dx + batch * h * w * c, 0.0f);
  const ptrdiff_t pad = static_cast<ptrdiff_t>(k / 2);
  const ptrdiff_t hh = static_cast<ptrdiff_t>(h), ww = static_cast<ptrdiff_t>(w);
  const size_t row_len = k * k * c;
  for (size_t b = 0; b < batch; ++b) {
    float* db = dx + b * h * w * c;
    for (ptrdiff_t y = 0; y < hh; ++y) {
      for (ptrdiff_t xx = 0; xx < ww; ++xx) {
        const float* in =
            dcol + ((b * h + static_cast<size_t>(y)) * w + static_cast<size_t>(xx)) * row_len;
        for (ptrdiff_t ky = 0; ky < static_cast<ptrdiff_t>(k); ++ky) {
          const ptrdiff_t sy = y + ky - pad;
          for (ptrdiff_t kx = 0; kx < static_cast<ptrdiff_t>(k); ++kx, in += c) {
            const ptrdiff_t sx = xx + kx - pad;
            if (sy < 0 || sy >= hh || sx < 0 || sx >= ww) continue;
            float* d = db + (static_cast<size_t>(sy) * w + static_cast<size_t>(sx)) * c;
            for (size_t ci = 0; ci < c; ++ci) d[ci] += in[ci];
          }
        }
      }
    }
  }
}

void MaxPool2x2(const float* x, size_t batch, size_t h, size_t w, size_t c, float* y,
                uint32_t* argmax) {
  const size_t oh = h / 2, ow = w / 2;
  for (size_t b = 0; b < batch; ++b) {
    for (size_t oy = 0; oy < oh; ++oy) {
      for (size_t ox = 0; ox < ow; ++ox) {
        const size_t out = ((b * oh + oy) * ow + ox) * c;
        for (size_t ci = 0; ci < c; ++ci) {
          size_t best = ((b * h + 2 * oy) * w + 2 * ox) * c + ci;
          for (size_t dy = 0; dy < 2; ++dy) {
            for (size_t dx = 0; dx < 2; ++dx) {
              const size_t at = ((b * h + 2 * oy + dy) * w + 2 * ox + dx) * c + ci;
              if (x[at] > x[best]) best = at;
            }
          }
          y[out + ci] = x[best];
          argmax[out + ci] = static_cast<uint32_t>(best);
        }
      }
    }
  }
}

void MaxPool2x2Backward(const float* dy, const uint32_t* argmax, size_t n_out, size_t n_in,
                        float* dx) {
  std::fill(dx, dx + n_in, 0.0f);
  for (size_t i = 0; i < n_out; ++i) dx[argmax[i]] += dy[i];
}

}  // namespace sparseps::kernels
