// sparseps-keygen: makes a node's CURVE keypair for security.curve (security/security.h).
#include <cstdio>

#include "common/command_line.h"
#include "security/security.h"

int main(int argc, char** argv) {
  sparseps::CommandLine cli(
      "sparseps-keygen: writes a CURVE keypair into DIR: public.key (give it to the other nodes' "
      "security.authorized_keys_dir, as NAME.key) and secret.key (mode 0600, stays on this "
      "host). Set security.key_dir=DIR on this node.",
      "sparseps-keygen");
  std::string dir;
  cli.Version(std::string("sparseps-keygen ") + SPARSEPS_VERSION);
  cli.Option("DIR", &dir, "directory to write public.key and secret.key into",
             sparseps::CommandLine::kRequired);
  if (const int rc = cli.Parse(argc, argv); rc >= 0) return rc;
  auto keys = sparseps::GenerateCurveKeypair();
  if (!keys.ok()) {
    std::fprintf(stderr, "sparseps-keygen: %s\n", keys.status().message().c_str());
    return 1;
  }
  sparseps::Status s = sparseps::WriteCurveKeypair(dir, *keys);
  if (!s.ok()) {
    std::fprintf(stderr, "sparseps-keygen: %s\n", s.message().c_str());
    return 1;
  }
  std::printf("%s\n", keys->public_key.c_str());
  std::fprintf(stderr, "sparseps-keygen: wrote %s/public.key and %s/secret.key\n", dir.c_str(),
               dir.c_str());
  return 0;
}
