#include "kernels/golomb.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

namespace sparseps::kernels {
namespace {

// Bit writer: LSB-first into a 64-bit accumulator that holds fewer than 32 pending bits between
// writes, so one write of up to 32 bits never overflows it. Words go to a buffer sized for the
// worst case up front (no per-word reallocation check).
class BitWriter {
 public:
  BitWriter(std::vector<uint8_t>* out, size_t max_bits) : out_(out), start_(out->size()) {
    out_->resize(start_ + (max_bits + 7) / 8 + 8);
    dst_ = out_->data() + start_;
  }
  void Put(uint64_t code, unsigned len) {  // REQUIRES: len <= 32, code < 2^len
    acc_ |= code << pending_;
    pending_ += len;
    if (pending_ >= 32) {
      const uint32_t word = static_cast<uint32_t>(acc_);
      uint8_t bytes[4] = {static_cast<uint8_t>(word), static_cast<uint8_t>(word >> 8),
                          static_cast<uint8_t>(word >> 16), static_cast<uint8_t>(word >> 24)};
      std::memcpy(dst_, bytes, 4);
      dst_ += 4;
      acc_ >>= 32;
      pending_ -= 32;
    }
  }
  void Finish() {
    while (pending_ > 0) {
      *dst_++ = static_cast<uint8_t>(acc_);
      acc_ >>= 8;
      pending_ = pending_ > 8 ? pending_ - 8 : 0;
    }
    out_->resize(static_cast<size_t>(dst_ - out_->data()));
  }

 private:
  std::vector<uint8_t>* out_;
  size_t start_;
  uint8_t* dst_;
  uint64_t acc_ = 0;
  unsigned pending_ = 0;
};

}  // namespace

uint32_t GolombParameter(double p) {
  if (!(p > 0.0)) return 30;
  if (p >= 1.0) return 0;
  const double phi = (1.0 + std::sqrt(5.0)) / 2.0;
  const double b = 1.0 + std::floor(std::log2(std::log(phi - 1.0) / std::log1p(-p)));
  return static_cast<uint32_t>(std::clamp(b, 0.0, 30.0));
}

double GolombExpectedBits(double p, uint32_t b) {
  return b + 1.0 / (1.0 - std::pow(1.0 - p, std::ldexp(1.0, static_cast<int>(b))));
}

uint64_t GolombEncode(const uint32_t* idx, size_t k, uint32_t b, std::vector<uint8_t>* out) {
  // Exact upper bound: each position costs b + 1 bits plus its quotient, and the quotients sum
  // to at most (last index >> b) + k.
  const uint64_t last = k > 0 ? idx[k - 1] : 0;
  BitWriter w(out, k * (b + 2) + (last >> b) + 64);
  uint64_t bits = 0;
  const uint64_t low_mask = (uint64_t{1} << b) - 1;
  int64_t prev = -1;
  for (size_t j = 0; j < k; ++j) {
    const uint64_t gap = static_cast<uint64_t>(static_cast<int64_t>(idx[j]) - prev - 1);
    prev = idx[j];
    uint64_t q = gap >> b;
    bits += q + 1 + b;
    if (q + 1 + b <= 32) [[likely]] {
      w.Put(((uint64_t{1} << q) - 1) | ((gap & low_mask) << (q + 1)),
            static_cast<unsigned>(q + 1 + b));
      continue;
    }
    for (; q >= 32; q -= 32) w.Put(0xffffffffULL, 32);
    w.Put((uint64_t{1} << q) - 1, static_cast<unsigned>(q + 1));  // the run's end and its zero
    if (b > 0) w.Put(gap & low_mask, b);
  }
  w.Finish();
  return bits;
}

const char* GolombDecode(const uint8_t* data, size_t bytes, uint32_t b, size_t k, uint64_t limit,
                         uint32_t* idx_out) {
  if (b > 30) return "Golomb parameter above 30";
  size_t pos = 0;      // next byte of data to load
  uint64_t buf = 0;    // pending bits, LSB first
  unsigned avail = 0;  // how many bits of buf are valid
  auto refill = [&] {
    if (pos + 8 <= bytes) {
      // Whole bytes that fit: load 8 and keep (64 - avail) / 8 of them.
      uint64_t word;
      std::memcpy(&word, data + pos, 8);
      if constexpr (std::endian::native == std::endian::big) word = __builtin_bswap64(word);
      const unsigned take = (64 - avail) / 8;
      if (take > 0) {
        const uint64_t kept = take == 8 ? word : word & ((uint64_t{1} << (8 * take)) - 1);
        buf |= avail == 0 ? kept : kept << avail;
        avail += 8 * take;
        pos += take;
      }
      return;
    }
    while (avail <= 56 && pos < bytes) {
      buf |= static_cast<uint64_t>(data[pos++]) << avail;
      avail += 8;
    }
  };
  const uint64_t low_mask = (uint64_t{1} << b) - 1;
  uint64_t next = 0;  // smallest value the next position may take
  for (size_t j = 0; j < k; ++j) {
    refill();
    // Unary part: count one-bits up to the terminating zero, across refills for long runs.
    uint64_t q = 0;
    while (true) {
      const unsigned ones = static_cast<unsigned>(std::countr_one(buf));
      if (ones < avail) {
        q += ones;
        buf = ones + 1 < 64 ? buf >> (ones + 1) : 0;  // ones <= 63: avail <= 64
        avail -= ones + 1;
        break;
      }
      q += avail;
      buf = 0;
      avail = 0;
      if (pos >= bytes) return "Golomb stream ends inside a unary run";
      if (q > limit) return "Golomb position beyond the key range";
      refill();
    }
    if (avail < b) {
      refill();
      if (avail < b) return "Golomb stream ends inside a remainder";
    }
    if (q > (limit >> b)) return "Golomb position beyond the key range";
    const uint64_t gap = (q << b) | (buf & low_mask);
    if (b > 0) {
      buf >>= b;
      avail -= b;
    }
    if (next + gap >= limit) return "Golomb position beyond the key range";
    const uint64_t position = next + gap;
    idx_out[j] = static_cast<uint32_t>(position);
    next = position + 1;
  }
  // Only the zero padding of the last byte may remain.
  if (pos < bytes || avail >= 8) return "Golomb stream has bytes after the last position";
  if ((buf & ((uint64_t{1} << avail) - 1)) != 0) return "Golomb padding bits are not zero";
  return nullptr;
}

}  // namespace sparseps::kernels
