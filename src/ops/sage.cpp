// The quantized-attention contract: attention's own checks (shapes, dtypes, GQA, score
// modifiers, outputs), with no mask and no dropout, then the quantized kernel of the
// requested mode (fp4 refuses the score modifiers).
#include "attnkit/sage.h"

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
  const AttentionParams p = detail::attention_params(args);
  if (a.mode == SageMode::fp4) {  // SageAttention3's emulation has none of them
    const char* given = a.window_left != -1 || a.window_right != -1 ? "window"
                        : a.softcap                                  ? "softcap"
                        : a.alibi_slopes                             ? "alibi_slopes"
                        : a.sinks                                    ? "sinks"
                                                                     : nullptr;
    if (given) {
      detail::fail("sage_attention mode \"fp4\" does not support ", given,
                   " (SageAttention3's numerics have no score modifiers); use mode \"int8\" or attention");
    }
  }
  if (a.mode == SageMode::fp4 && (p.D % 16 != 0 || p.Dv != p.D)) {
    detail::fail("sage_attention mode \"fp4\" needs D a multiple of 16 and Dv == D (NVFP4 blocks of 16), got D=",
                 p.D, " and Dv=", p.Dv);
  }
  if (p.B == 0 || p.Hq == 0 || p.Sq == 0) return;
  if (a.mode == SageMode::fp4) return cpu::sage_fp4_fwd(p);
  detail::kernels().sage_int8_fwd(p);
}

}  // namespace attnkit
