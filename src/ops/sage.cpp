// The quantized-attention contract: attention's own checks (shapes, dtypes, GQA, score
// modifiers, mask, outputs), no dropout, key lengths checked here, then the quantized
// kernel of the requested mode (fp4 refuses the score modifiers, masks and key lengths).
#include "attnkit/sage.h"

#include <vector>

#include "attnkit/error.h"
#include "core/dispatch.h"
#include "cpu/sage_fp4.h"
#include "ops/checks.h"
#include "ops/attention_params.h"

namespace attnkit {

void sage_attention(const SageArgs& a) {
  AttentionArgs args;
  args.q = a.q, args.k = a.k, args.v = a.v, args.out = a.out, args.lse = a.lse;
  args.causal = a.causal;
  args.scale = a.scale;
  args.layout = a.layout;
  args.enable_gqa = true;  // quantized attention serves GQA/MQA natively
  args.window_left = a.window_left, args.window_right = a.window_right;
  args.softcap = a.softcap;
  args.alibi_slopes = a.alibi_slopes, args.sinks = a.sinks;
  args.attn_mask = a.attn_mask;
  AttentionParams p = detail::attention_params(args);
  if (a.mode == SageMode::fp4) {  // SageAttention3's emulation has none of them
    const char* given = a.window_left != -1 || a.window_right != -1 ? "window"
                        : a.softcap                                  ? "softcap"
                        : a.alibi_slopes                             ? "alibi_slopes"
                        : a.sinks                                    ? "sinks"
                        : a.attn_mask                                ? "attn_mask"
                        : a.kv_lens                                  ? "kv_lens"
                                                                     : nullptr;
    if (given) {
      detail::fail("sage_attention mode \"fp4\" does not support ", given,
                   " (SageAttention3's numerics have no score modifiers or masks); use mode \"int8\" or attention");
    }
  }
  if (a.mode == SageMode::fp4 && (p.D % 16 != 0 || p.Dv != p.D)) {
    detail::fail("sage_attention mode \"fp4\" needs D a multiple of 16 and Dv == D (NVFP4 blocks of 16), got D=",
                 p.D, " and Dv=", p.Dv);
  }
  std::vector<int32_t> kv_lens;  // copied, so out may not alias them
  if (a.kv_lens) {
    const TensorView& t = *a.kv_lens;
    detail::check_rank(t, "kv_lens", 1, "[B]");
    if (t.dtype != DType::int32) detail::fail("kv_lens must be int32, got ", dtype_name(t.dtype));
    if (t.shape[0] != p.B) detail::fail("kv_lens must have B=", p.B, " elements, got ", t.shape[0]);
    kv_lens.resize(p.B);
    for (int64_t b = 0; b < p.B; ++b) {
      kv_lens[b] = static_cast<const int32_t*>(t.data)[b * t.strides[0]];
      if (kv_lens[b] < 0 || kv_lens[b] > p.Skv) {
        detail::fail("kv_lens[", b, "] must be in [0, Skv=", p.Skv, "], got ", kv_lens[b]);
      }
    }
    p.kv_len = kv_lens.data();
  }
  if (p.B == 0 || p.Hq == 0 || p.Sq == 0) return;
  if (a.mode == SageMode::fp4) return cpu::sage_fp4_fwd(p);
  detail::kernels().sage_int8_fwd(p, a.mode == SageMode::int8_pv_int8);
}

}  // namespace attnkit
