// Per-call scratch memory for the op loops: one 64-byte-aligned block, freed on scope exit.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <new>

#include "cpu/kernels/simd.h"

namespace attnkit::cpu::ATTNKIT_ISA {

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <class T>
struct AlignedBuffer {
  T* data = nullptr;
  explicit AlignedBuffer(int64_t count) {
    if (count > 0) {
      data = static_cast<T*>(std::aligned_alloc(64, round_up(count * int64_t{sizeof(T)}, 64)));
      if (!data) throw std::bad_alloc();
    }
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

}  // namespace attnkit::cpu::ATTNKIT_ISA
