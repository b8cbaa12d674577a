// How every register-tiled micro-kernel (gemm.h, gemm_dot.h) covers an
// m × n output: MR-row × NV-vector tiles, with the smaller tiles compiled for the edges.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "cpu/kernels/simd.h"

namespace attnkit::cpu::ATTNKIT_ISA {

// Kernel::tile<mr, nv> for every 1 <= mr <= MR, 1 <= nv <= NV, as table[mr - 1][nv - 1].
template <class Kernel, int MR, int NV>
struct TileTable {
  template <int R, int... V>
  static constexpr auto row(std::integer_sequence<int, V...>) {
    return std::array{Kernel::template tile<R, V + 1>...};
  }
  template <int... R>
  static constexpr auto all(std::integer_sequence<int, R...>) {
    return std::array{row<R + 1>(std::make_integer_sequence<int, NV>{})...};
  }
  static constexpr auto table = all(std::make_integer_sequence<int, MR>{});
};

// Calls call(tile, m0, n0) for each tile of an m × n output whose columns come in vectors
// of `lanes` (n a multiple of lanes), tile being the Kernel function of that tile's size.
template <class Kernel, int MR, int NV, class Call>
void for_each_tile(int64_t m, int64_t n, int64_t lanes, Call call) {
  for (int64_t n0 = 0; n0 < n; n0 += NV * lanes) {
    const int64_t nv = (n - n0) / lanes < NV ? (n - n0) / lanes : NV;
    for (int64_t m0 = 0; m0 < m; m0 += MR) {
      const int64_t mr = m - m0 < MR ? m - m0 : MR;
      call(TileTable<Kernel, MR, NV>::table[mr - 1][nv - 1], m0, n0);
    }
  }
}

// The range [p0, p1) of the reduction axis outside which A's rows m0 .. m1-1 are zero (a
// causal mask's triangle), as band(m0, m1) gives it; NoBand: anywhere.
struct NoBand {
  std::pair<int64_t, int64_t> operator()(int64_t, int64_t) const { return {0, INT64_MAX}; }
};

// The reduction range of the tile of rows m0 .. m0+mr-1: [0, k) narrowed by the band.
template <class Band>
std::pair<int64_t, int64_t> tile_range(const Band& band, int64_t m0, int64_t mr, int64_t k) {
  const auto [p0, p1] = band(m0, m0 + mr);
  const int64_t first = std::clamp<int64_t>(p0, 0, k);
  return {first, std::max(first, std::min(p1, k))};
}

}  // namespace attnkit::cpu::ATTNKIT_ISA
