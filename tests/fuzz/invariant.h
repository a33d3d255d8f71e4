// What the state-machine fuzz targets (tests/fuzz/*_fuzz.cc) do when an invariant breaks: name it
// on stderr and trap, so that libFuzzer saves the input and CI's log says which rule failed.
#pragma once

#include <cstdio>

namespace sparseps::fuzz {

[[noreturn]] inline void Fail(const char* what) {
  std::fprintf(stderr, "invariant broken: %s\n", what);
  __builtin_trap();
}

}  // namespace sparseps::fuzz
