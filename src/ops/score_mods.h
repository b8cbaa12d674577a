// The score modifiers' contract (window, soft-cap, ALiBi, sinks), shared by every op built on
// the dense kernel: attention and sage_attention (src/ops/attention.cpp), varlen and paged
// attention (src/ops/serving.cpp).
#pragma once

#include <cstdint>
#include <optional>

#include "attnkit/tensor.h"
#include "ops/attention_params.h"

namespace attnkit::detail {

struct ScoreMods {
  int64_t window_left = -1, window_right = -1;
  std::optional<double> softcap;
  std::optional<TensorView> alibi_slopes, sinks;
};

// Checks the modifiers of a call with `batch` sequences of Hq query heads whose positions
// stay below `reach` (the longest Sq plus the longest Skv), that none overlaps out or lse,
// and fills them into p (p.causal set already). Throws Error.
void check_score_mods(const ScoreMods& m, int64_t batch, int64_t hq, int64_t reach, const TensorView& out,
                      const std::optional<TensorView>& lse, AttentionParams& p);

}  // namespace attnkit::detail
