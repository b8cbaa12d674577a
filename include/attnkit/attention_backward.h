// The backward of dense attention (attnkit::attention): dq, dk, dv from the forward's inputs,
// its out and lse, and the gradient of out. P is recomputed tile by tile from q, k and lse
// (FlashAttention-2); the dropout mask is regenerated from the forward's seed. Gradients are
// accumulated in float32 and are bit-identical for any thread count.
#pragma once

#include <cstdint>
#include <optional>

#include "attnkit/attention.h"
#include "attnkit/tensor.h"

namespace attnkit {

struct AttentionBackwardArgs {
  TensorView q, k, v;              // the forward's inputs (float32, float16 or bfloat16)
  TensorView out;                  // the forward's output, q's dtype
  TensorView lse;                  // the forward's float32 lse [B, Hq, Sq]
  TensorView dout;                 // gradient of out: out's shape and dtype, any strides
  TensorView dq, dk, dv;           // caller-owned, q's dtype, the shapes of q, k and v
  std::optional<TensorView> dlse;  // gradient of lse, float32 [B, Hq, Sq], any strides; none = 0
  // The forward's other arguments, unchanged (see AttentionArgs).
  std::optional<TensorView> attn_mask;
  Causal causal = Causal::none;
  std::optional<double> scale;
  double dropout_p = 0.0;
  std::optional<uint64_t> seed;    // required when dropout_p > 0: the forward's seed
  bool enable_gqa = false;
  Layout layout = Layout::BHSD;
  // The forward's score modifiers (see AttentionArgs); ALiBi slopes get no gradient.
  int64_t window_left = -1, window_right = -1;
  std::optional<double> softcap;
  std::optional<TensorView> alibi_slopes, sinks;
  std::optional<TensorView> dsinks;  // caller-owned float32 [Hq], the sinks' gradient: required with sinks
};

// Writes every element of dq, dk and dv; throws attnkit::Error on invalid arguments. The
// mask gets no gradient. Never modifies an input.
void attention_backward(const AttentionBackwardArgs& args);

}  // namespace attnkit
