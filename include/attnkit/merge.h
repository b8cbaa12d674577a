// Merging partial attentions over disjoint key sets by their log-sum-exp (FlashInfer's
// merge_state): the combine step of split-K decode, cascade/prefix attention and ring
// attention. Natural-log lse; arithmetic in float32.
#pragma once

#include "attnkit/tensor.h"

namespace attnkit {

// Shapes: out_a, out_b, out [..., Dv] (the same shape, rank 2..6) and lse_a, lse_b, lse_out
// float32 with out's shape minus its last dim: [T, H, Dv] with [T, H] (varlen), or
// attention's [B, H, S, Dv] with [B, H, S]. Any strides (a BSHD out is a transposed view).
// out_a, out_b and out may each be float32, float16 or bfloat16.
//
// Per row, with m = max(lse_a, lse_b), w_x = exp(lse_x - m) (1 where lse_x == m, so ±inf
// work):  out = (w_a·out_a + w_b·out_b) / (w_a + w_b),  lse_out = m + log(w_a + w_b).
// A part whose weight w_x / (w_a + w_b) is 0 in float32 (lse -inf, or more than ~104 below
// the other) is never read, so its out may hold anything. Both lse -inf (a row that saw no
// key): out 0 and lse_out -inf, attention's convention. A NaN lse makes its row NaN. out
// may be exactly out_a or out_b and lse_out exactly lse_a or lse_b (the same view: in-place
// merges); any other overlap is an error.
struct MergeStatesArgs {
  TensorView out_a, lse_a;
  TensorView out_b, lse_b;
  TensorView out, lse_out;
};

// Throws attnkit::Error on invalid arguments; writes every element of out and lse_out.
void merge_attention_states(const MergeStatesArgs& args);

}  // namespace attnkit
