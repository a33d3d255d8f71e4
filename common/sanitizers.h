#pragma once

// SPARSEPS_ADDRESS_SANITIZER is 1 when this translation unit is built with AddressSanitizer
// (-fsanitize=address), by GCC (which defines __SANITIZE_ADDRESS__) or by clang (which, before
// version 17, answers only __has_feature(address_sanitizer)), and 0 otherwise. Code that depends
// on glibc's own malloc, and tests too long to run under the sanitizer, test it.
#if defined(__SANITIZE_ADDRESS__)
#define SPARSEPS_ADDRESS_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SPARSEPS_ADDRESS_SANITIZER 1
#endif
#endif
#ifndef SPARSEPS_ADDRESS_SANITIZER
#define SPARSEPS_ADDRESS_SANITIZER 0
#endif
