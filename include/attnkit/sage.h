// SageAttention-style quantized attention: int8 Q·Kᵀ (K smoothed by its per-head mean over
// tokens), fp32 online softmax, reduced-precision P·V. Same shapes as attnkit::attention.
#pragma once

#include <cstdint>
#include <optional>

#include "attnkit/attention.h"
#include "attnkit/tensor.h"

namespace attnkit {

enum class SageMode : uint8_t {
  int8,          // SageAttention2's recipe on this CPU (see python/attnkit/sage.py)
  int8_pv_int8,  // int8 too for P·V: u8 P per row and key tile × s8 V per key tile and channel (vpdpbusd)
  fp4,   // SageAttention3's NVFP4 numerics, emulated exactly (slow; docs/sage_fp4.md)
};

struct SageArgs {
  TensorView q, k, v, out;        // as AttentionArgs; GQA allowed (Hq a multiple of Hkv)
  std::optional<TensorView> lse;  // float32 [B, Hq, Sq], of the unquantised-equivalent logits
  Causal causal = Causal::none;
  std::optional<double> scale;
  Layout layout = Layout::BHSD;
  SageMode mode = SageMode::int8;
  // Score modifiers as in AttentionArgs, honoured by mode int8; mode fp4 refuses them.
  int64_t window_left = -1, window_right = -1;
  std::optional<double> softcap;
  std::optional<TensorView> alibi_slopes, sinks;
  // Modes int8 and int8_pv_int8 only: a mask as AttentionArgs::attn_mask, and key lengths
  // (int32 [B], each in [0, Skv]): batch b sees keys j < kv_lens[b] only, as a key-padding
  // mask would (the causal alignment stays Skv's); keys past it are never read.
  std::optional<TensorView> attn_mask, kv_lens;
};

void sage_attention(const SageArgs& args);

}  // namespace attnkit
