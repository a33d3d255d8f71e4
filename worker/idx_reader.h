// Reader for the IDX format of (Fashion-)MNIST, gzip-compressed or plain (zlib reads both).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace sparseps {

// The input normalisation of every image: (pixel / 255 - kInputMean) / kInputStd (Fashion-MNIST's
// mean and standard deviation). Model files record it (worker/session.h SaveModel).
inline constexpr float kInputMean = 0.2860f;
inline constexpr float kInputStd = 0.3530f;

// A labelled image set, images as float rows (normalised), labels as class ids.
struct Dataset {
  size_t num_samples = 0;
  size_t num_features = 0;    // rows * cols of one image
  size_t rows = 0, cols = 0;  // image height and width (pixels); rows * cols == num_features
  size_t num_classes = 10;
  std::vector<float> images;    // num_samples x num_features, row-major
  std::vector<uint8_t> labels;  // num_samples
};

// Reads an IDX image file (magic 0x00000803) and its label file (0x00000801). Pixels p in
// [0, 255] become (p / 255 - mean) / std with Fashion-MNIST's mean 0.2860 and std 0.3530.
// max_samples > 0 keeps only the first max_samples. Errors: IoError when a file cannot be read,
// InvalidArgument naming the file when its magic, sizes or labels are wrong or it is truncated.
Result<Dataset> LoadIdx(const std::string& images_path, const std::string& labels_path,
                        size_t max_samples);

// Loads "<prefix>-images-idx3-ubyte[.gz]" and "<prefix>-labels-idx1-ubyte[.gz]" from dir, with
// prefix "train" or "t10k", preferring the .gz files.
Result<Dataset> LoadIdxSplit(const std::string& dir, const std::string& prefix, size_t max_samples);

}  // namespace sparseps
