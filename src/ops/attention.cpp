// The dense-attention contract: every argument check, in one fixed order (ranks, dtypes,
// sizes, head counts, mask, scalars, score modifiers, outputs and aliasing), then a plain AttentionParams
// for the kernels. Nothing below this file validates user input again.
#include "attnkit/attention.h"

#include <cmath>
#include <random>
#include <string>

#include "attnkit/error.h"
#include "core/dispatch.h"
#include "ops/attention_params.h"
#include "ops/checks.h"
#include "ops/score_mods.h"

namespace attnkit {
namespace {

using detail::check_no_overlap;
using detail::fail;
using detail::is_attention_dtype;
using detail::kMaxHeadDim;

// Logical BHSD dims of a 4-d view in the given layout, and its strides in that order.
struct Bhsd {
  int64_t size[4];
  int64_t stride[4];
};

Bhsd as_bhsd(const TensorView& t, Layout layout) {
  // BSHD stores (B, S, H, D): swap the middle two dims to read it as BHSD.
  static constexpr int kBshd[4] = {0, 2, 1, 3};
  Bhsd r;
  for (int d = 0; d < 4; ++d) {
    int src = layout == Layout::BHSD ? d : kBshd[d];
    r.size[d] = t.shape[src];
    r.stride[d] = t.strides[src];
  }
  return r;
}

std::string layout_dims(Layout layout, const char* h, const char* s, const char* d) {
  return layout == Layout::BHSD ? std::string("[B, ") + h + ", " + s + ", " + d + "] (layout BHSD)"
                                : std::string("[B, ") + s + ", " + h + ", " + d + "] (layout BSHD)";
}

std::string dims_str(int64_t b, int64_t h, int64_t s, int64_t d, Layout layout) {
  auto str = [](int64_t x) { return std::to_string(x); };
  return layout == Layout::BHSD ? "[" + str(b) + ", " + str(h) + ", " + str(s) + ", " + str(d) + "]"
                                : "[" + str(b) + ", " + str(s) + ", " + str(h) + ", " + str(d) + "]";
}


}  // namespace

AttentionParams detail::attention_params(const AttentionArgs& a, bool writes_out) {
  const Layout layout = a.layout;

  // 1. Ranks.
  detail::check_rank(a.q, "q", 4, layout_dims(layout, "Hq", "Sq", "D"));
  detail::check_rank(a.k, "k", 4, layout_dims(layout, "Hkv", "Skv", "D"));
  detail::check_rank(a.v, "v", 4, layout_dims(layout, "Hkv", "Skv", "Dv"));
  detail::check_rank(a.out, "out", 4, layout_dims(layout, "Hq", "Sq", "Dv"));
  for (const auto& [t, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}}) {
    detail::check_sizes_nonnegative(*t, name);
  }

  // 2. Dtypes.
  if (!is_attention_dtype(a.q.dtype)) {
    fail("q must be float32, float16 or bfloat16, got ", dtype_name(a.q.dtype));
  }
  if (a.k.dtype != a.q.dtype) fail("k must have q's dtype ", dtype_name(a.q.dtype), ", got ", dtype_name(a.k.dtype));
  if (a.v.dtype != a.q.dtype) fail("v must have q's dtype ", dtype_name(a.q.dtype), ", got ", dtype_name(a.v.dtype));
  if (a.out.dtype != a.q.dtype) fail("out must have q's dtype ", dtype_name(a.q.dtype), ", got ", dtype_name(a.out.dtype));

  // 3. Sizes against the symbolic shapes.
  const Bhsd q = as_bhsd(a.q, layout), k = as_bhsd(a.k, layout), v = as_bhsd(a.v, layout),
             out = as_bhsd(a.out, layout);
  const int64_t B = q.size[0], Hq = q.size[1], Sq = q.size[2], D = q.size[3];
  const int64_t Hkv = k.size[1], Skv = k.size[2], Dv = v.size[3];
  if (D < 1 || D > kMaxHeadDim) fail("q head dim D must be in [1, 512], got ", D);
  if (k.size[0] != B) fail("k batch size must equal q's B=", B, ", got ", k.size[0]);
  if (k.size[3] != D) fail("k head dim must equal q's D=", D, ", got ", k.size[3]);
  if (Dv < 1 || Dv > kMaxHeadDim) fail("v head dim Dv must be in [1, 512], got ", Dv);
  if (v.size[0] != B || v.size[1] != Hkv || v.size[2] != Skv) {
    fail("v must have shape ", dims_str(B, Hkv, Skv, Dv, layout), " (B, Hkv, Skv from q and k), got ",
         a.v.shape_str());
  }

  // 4. Head counts: GQA/MQA maps query head h to kv head h / (Hq / Hkv).
  if (Hq != Hkv) {
    if (!a.enable_gqa) {
      fail("q and k must have the same number of heads unless enable_gqa=True, got q_heads=", Hq,
           " and kv_heads=", Hkv);
    }
    if (Hkv == 0 || Hq % Hkv != 0) {
      fail("GQA/MQA requires query heads to be a multiple of KV heads, got q_heads=", Hq,
           " and kv_heads=", Hkv);
    }
  }

  // 5. Mask: bool or additive float, broadcastable to [B, Hq, Sq, Skv].
  AttentionParams p{};
  if (a.attn_mask) {
    const TensorView& m = *a.attn_mask;
    if (m.dtype != DType::boolean && !is_attention_dtype(m.dtype)) {
      fail("attn_mask must be bool or float32/float16/bfloat16, got ", dtype_name(m.dtype));
    }
    detail::broadcast_strides(m, "attn_mask", {B, Hq, Sq, Skv}, "[B, Hq, Sq, Skv]", p.mask_stride);
    p.mask = m.data;
    p.mask_dtype = m.dtype;
  }

  // 6. Scalars.
  const double scale = a.scale ? *a.scale : 1.0 / std::sqrt(static_cast<double>(D));
  detail::check_float32_scale(scale, "scale");
  if (!(a.dropout_p >= 0.0 && a.dropout_p < 1.0)) fail("dropout_p must be in [0, 1), got ", a.dropout_p);

  // 7. Outputs: shapes, dtypes, no self-overlap, no aliasing with any input or each other.
  if (out.size[0] != B || out.size[1] != Hq || out.size[2] != Sq || out.size[3] != Dv) {
    fail("out must have shape ", dims_str(B, Hq, Sq, Dv, layout), ", got ", a.out.shape_str());
  }
  if (a.lse) {
    const TensorView& l = *a.lse;
    if (l.rank != 3 || l.shape[0] != B || l.shape[1] != Hq || l.shape[2] != Sq) {
      fail("lse must have shape [", B, ", ", Hq, ", ", Sq, "] ([B, Hq, Sq]), got ", l.shape_str());
    }
    if (l.dtype != DType::float32) fail("lse must be float32, got ", dtype_name(l.dtype));
  }
  if (writes_out) {
    detail::check_writable_layout(a.out, "out");
    if (a.lse) detail::check_writable_layout(*a.lse, "lse");
    for (const auto& [input, name] : {std::pair{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}}) {
      check_no_overlap(a.out, "out", *input, name);
      if (a.lse) check_no_overlap(*a.lse, "lse", *input, name);
    }
    if (a.attn_mask) {
      check_no_overlap(a.out, "out", *a.attn_mask, "attn_mask");
      if (a.lse) check_no_overlap(*a.lse, "lse", *a.attn_mask, "attn_mask");
    }
    if (a.lse) check_no_overlap(a.out, "out", *a.lse, "lse");
  }

  // Everything is valid: fill the params block.
  p.dtype = a.q.dtype;
  p.kv_dtype = a.q.dtype;
  p.q = a.q.data;
  p.k = a.k.data;
  p.v = a.v.data;
  p.out = a.out.data;
  // An empty K/V (Skv = 0) is never read, and its data pointer may be null (an empty torch
  // tensor's is): zero strides keep the kernels from forming offsets from it.
  const bool no_keys = Skv == 0;
  for (int d = 0; d < 4; ++d) {
    p.q_stride[d] = q.stride[d];
    p.k_stride[d] = no_keys ? 0 : k.stride[d];
    p.v_stride[d] = no_keys ? 0 : v.stride[d];
    p.out_stride[d] = out.stride[d];
  }
  if (a.lse) {
    p.lse = static_cast<float*>(a.lse->data);
    for (int d = 0; d < 3; ++d) p.lse_stride[d] = a.lse->strides[d];
  }
  p.B = B, p.Hq = Hq, p.Hkv = Hkv, p.Sq = Sq, p.Skv = Skv, p.D = D, p.Dv = Dv;
  p.group = Hkv > 0 ? Hq / Hkv : 1;
  p.causal = a.causal != Causal::none;
  // Bottom-right alignment (FlashAttention's) unless causal is top_left: the window and ALiBi
  // of a non-causal call follow it too, so a KV-cache query sits at the end of its keys.
  p.causal_offset = a.causal == Causal::top_left ? 0 : Skv - Sq;
  p.scale = static_cast<float>(scale);
  p.dropout_p = static_cast<float>(a.dropout_p);
  if (a.seed) {
    p.seed = *a.seed;
  } else if (a.dropout_p > 0.0) {  // a fresh seed; drawing one costs microseconds, so only when used
    p.seed = (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  }

  // 8. Score modifiers (window, softcap, ALiBi slopes, sinks).
  detail::check_score_mods({a.window_left, a.window_right, a.softcap, a.alibi_slopes, a.sinks}, B, Hq, Sq + Skv,
                           a.out, a.lse, p);

  p.l2_read_ahead = detail::l2_read_ahead();
  return p;
}

void attention(const AttentionArgs& args) {
  const AttentionParams p = detail::attention_params(args);
  if (p.B == 0 || p.Hq == 0 || p.Sq == 0) return;  // empty result: nothing to write
  detail::kernels().attention_fwd(p);
}

}  // namespace attnkit
