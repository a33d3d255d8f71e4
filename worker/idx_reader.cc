#include "worker/idx_reader.h"

#include <zlib.h>

#include <filesystem>
#include <memory>

namespace sparseps {
namespace {

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

Status ReadExact(gzFile f, void* buf, size_t n, const std::string& path) {
  size_t done = 0;
  auto* p = static_cast<unsigned char*>(buf);
  while (done < n) {
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
    const int got = gzread(f, p + done, chunk);
    if (got <= 0) {
      return Status::InvalidArgument(path + ": truncated (read " + std::to_string(done) + " of " +
                                     std::to_string(n) + " bytes)");
    }
    done += static_cast<size_t>(got);
  }
  return Status::OK();
}

Result<uint32_t> ReadBigEndian32(gzFile f, const std::string& path) {
  unsigned char b[4];
  SPARSEPS_RETURN_IF_ERROR(ReadExact(f, b, 4, path));
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

Result<GzFile> Open(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return Status::IoError(path + ": cannot open");
  return GzFile(f);
}

}  // namespace

Result<Dataset> LoadIdx(const std::string& images_path, const std::string& labels_path,
                        size_t max_samples) {
  auto img = Open(images_path);
  if (!img.ok()) return img.status();
  auto lab = Open(labels_path);
  if (!lab.ok()) return lab.status();

  auto magic = ReadBigEndian32(img->get(), images_path);
  if (!magic.ok()) return magic.status();
  if (*magic != 0x00000803) {
    return Status::InvalidArgument(images_path + ": not an IDX image file (magic " +
                                   std::to_string(*magic) + ", expected 2051)");
  }
  auto n = ReadBigEndian32(img->get(), images_path);
  auto rows = ReadBigEndian32(img->get(), images_path);
  auto cols = ReadBigEndian32(img->get(), images_path);
  if (!n.ok() || !rows.ok() || !cols.ok()) {
    return Status::InvalidArgument(images_path + ": truncated header");
  }
  if (*rows == 0 || *cols == 0 || *rows > 4096 || *cols > 4096) {
    return Status::InvalidArgument(images_path + ": implausible image size " +
                                   std::to_string(*rows) + "x" + std::to_string(*cols));
  }
  auto lmagic = ReadBigEndian32(lab->get(), labels_path);
  if (!lmagic.ok()) return lmagic.status();
  if (*lmagic != 0x00000801) {
    return Status::InvalidArgument(labels_path + ": not an IDX label file (magic " +
                                   std::to_string(*lmagic) + ", expected 2049)");
  }
  auto ln = ReadBigEndian32(lab->get(), labels_path);
  if (!ln.ok()) return ln.status();
  if (*ln != *n) {
    return Status::InvalidArgument(labels_path + ": " + std::to_string(*ln) + " labels for " +
                                   std::to_string(*n) + " images in " + images_path);
  }

  Dataset d;
  d.num_samples = max_samples > 0 ? std::min<size_t>(max_samples, *n) : *n;
  d.num_features = size_t{*rows} * *cols;
  d.rows = *rows;
  d.cols = *cols;
  std::vector<uint8_t> pixels(d.num_samples * d.num_features);
  SPARSEPS_RETURN_IF_ERROR(ReadExact(img->get(), pixels.data(), pixels.size(), images_path));
  d.labels.resize(d.num_samples);
  SPARSEPS_RETURN_IF_ERROR(ReadExact(lab->get(), d.labels.data(), d.labels.size(), labels_path));
  for (size_t i = 0; i < d.num_samples; ++i) {
    if (d.labels[i] >= d.num_classes) {
      return Status::InvalidArgument(labels_path + ": label " + std::to_string(d.labels[i]) +
                                     " of sample " + std::to_string(i) + " is not in [0, 10)");
    }
  }
  d.images.resize(pixels.size());
  for (size_t i = 0; i < pixels.size(); ++i) {
    d.images[i] = (static_cast<float>(pixels[i]) / 255.0f - kInputMean) / kInputStd;
  }
  return d;
}

Result<Dataset> LoadIdxSplit(const std::string& dir, const std::string& prefix,
                             size_t max_samples) {
  auto pick = [&](const std::string& stem) {
    const std::string gz = dir + "/" + stem + ".gz";
    return std::filesystem::exists(gz) ? gz : dir + "/" + stem;
  };
  const std::string images = pick(prefix + "-images-idx3-ubyte");
  const std::string labels = pick(prefix + "-labels-idx1-ubyte");
  if (!std::filesystem::exists(images)) {
    return Status::InvalidArgument(
        images + ": no such file (data.dir = " + dir +
        "; the Debian package dataset-fashion-mnist installs /usr/share/datasets/fashion-mnist)");
  }
  return LoadIdx(images, labels, max_samples);
}

}  // namespace sparseps
