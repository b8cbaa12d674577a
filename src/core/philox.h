// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"), a
// counter-based generator: the random bits of an element are a pure function of (seed,
// coordinates), so dropout masks do not depend on thread count, tiling or ISA.
#pragma once

#include <array>
#include <cstdint>

namespace attnkit::detail {

static inline std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> ctr, uint64_t seed) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t key0 = static_cast<uint32_t>(seed), key1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{kMul0} * ctr[0], p1 = uint64_t{kMul1} * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ key0, static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ key1, static_cast<uint32_t>(p0)};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return ctr;
}

// Dropout draws for attention element (b, h, i, j): four consecutive keys share one Philox
// call. Element j's word is the (j % 4)-th. Kept iff word >= threshold.
static inline std::array<uint32_t, 4> dropout_bits(uint64_t seed, int64_t b, int64_t h, int64_t i,
                                                   int64_t j) {
  return philox4x32({static_cast<uint32_t>(j >> 2), static_cast<uint32_t>(i),
                     static_cast<uint32_t>(h), static_cast<uint32_t>(b)},
                    seed);
}

// The keep threshold for drop probability p in [0, 1): P(word >= t) = 1 - p.
static inline uint32_t dropout_threshold(float p) {
  const double t = static_cast<double>(p) * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

}  // namespace attnkit::detail
