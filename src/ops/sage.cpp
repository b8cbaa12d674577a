// The quantized-attention contract: attention's own checks (shapes, dtypes, GQA, outputs),
// with no mask and no dropout, then the quantized kernel of the requested mode.
#include "attnkit/sage.h"

#include "attnkit/error.h"
#include "core/dispatch.h"
#include "ops/attention_params.h"

namespace attnkit {

void sage_attention(const SageArgs& a) {
  if (a.mode != SageMode::int8) {
    throw Error("sage_attention: mode \"fp4\" is not built yet (SageAttention3 numerics); use mode \"int8\"");
  }
  AttentionArgs args;
  args.q = a.q, args.k = a.k, args.v = a.v, args.out = a.out, args.lse = a.lse;
  args.causal = a.causal;
  args.scale = a.scale;
  args.layout = a.layout;
  args.enable_gqa = true;  // quantized attention serves GQA/MQA natively
  const AttentionParams p = detail::attention_params(args);
  if (p.B == 0 || p.Hq == 0 || p.Sq == 0) return;
  detail::kernels().sage_int8_fwd(p);
}

}  // namespace attnkit
