// Exact dense attention with the semantics of torch.nn.functional.scaled_dot_product_attention.
// Softmax and accumulation run in float32; for bfloat16, P may be rounded to bfloat16 before
// P·V (on CPUs with AVX512-BF16, as FlashAttention and torch do), at most 2^-8 · Σp|v| / Σp
// per output on top.
#pragma once

#include <cstdint>
#include <optional>

#include "attnkit/tensor.h"

namespace attnkit {

enum class Causal : uint8_t {
  none,
  top_left,      // query i sees keys j <= i (torch's is_causal=True)
  bottom_right,  // query i sees keys j <= i + s_kv - s_q (FlashAttention's KV-prefix convention)
};

enum class Layout : uint8_t {
  BHSD,  // q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv], out [B, Hq, Sq, Dv]
  BSHD,  // q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv], out [B, Sq, Hq, Dv]
};

struct AttentionArgs {
  TensorView q, k, v;              // float32, float16 or bfloat16, all the same; any strides
  TensorView out;                  // caller-owned, q's dtype, shape per layout; any strides
  std::optional<TensorView> lse;   // caller-owned float32 [B, Hq, Sq] (natural log), optional
  // bool (true = attend) or additive float; broadcastable to [B, Hq, Sq, Skv] (BHSD order
  // for both layouts) through shape-1 dims, missing leading dims or zero strides.
  std::optional<TensorView> attn_mask;
  Causal causal = Causal::none;
  std::optional<double> scale;     // default 1/sqrt(D)
  double dropout_p = 0.0;          // in [0, 1)
  std::optional<uint64_t> seed;    // dropout seed; none draws a fresh one
  bool enable_gqa = false;         // allow Hq != Hkv (Hq a multiple of Hkv)
  Layout layout = Layout::BHSD;

  // Score modifiers (FlashAttention's conventions). They combine with each other, attn_mask,
  // causal and GQA. Query i is aligned to key position i + Skv - Sq (bottom-right), or to i
  // with causal top_left, as the causal limit aligns it.
  int64_t window_left = -1, window_right = -1;  // aligned query a sees keys a-left <= j <= a+right; -1: unbounded
  std::optional<double> softcap;           // c > 0, finite: s -> c·tanh(s / c) after the scale, before masks
  std::optional<TensorView> alibi_slopes;  // float32 [Hq] or [B, Hq]: adds -slope·|a - j| to the scores
  std::optional<TensorView> sinks;         // float32 [Hq]: a logit in the softmax denominator only (not in lse)
};

// Computes out (and lse) for args; throws attnkit::Error on invalid arguments. Never
// modifies an input; writes every element of out and lse.
void attention(const AttentionArgs& args);

}  // namespace attnkit
