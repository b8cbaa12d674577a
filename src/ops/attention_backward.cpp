// The dense-attention backward contract: the forward's checks (detail::attention_params on
// the same arguments, score modifiers included), then dout and the gradients (rank, dtype, shape, no self-overlap, no
// aliasing with any input or each other), then the params block for the kernel.
#include "attnkit/attention_backward.h"

#include <algorithm>

#include <string>
#include <utility>
#include <vector>

#include "attnkit/error.h"
#include "core/dispatch.h"
#include "ops/attention_backward_params.h"
#include "ops/checks.h"

namespace attnkit {
namespace {

using detail::fail;

// t's strides in BHSD order (BSHD stores the head and sequence dims swapped).
void bhsd_strides(const TensorView& t, Layout layout, int64_t* stride) {
  static constexpr int kBshd[4] = {0, 2, 1, 3};
  for (int d = 0; d < 4; ++d) stride[d] = t.strides[layout == Layout::BHSD ? d : kBshd[d]];
}

}  // namespace

void attention_backward(const AttentionBackwardArgs& a) {
  AttentionArgs fa;
  fa.q = a.q, fa.k = a.k, fa.v = a.v, fa.out = a.out, fa.lse = a.lse, fa.attn_mask = a.attn_mask;
  fa.causal = a.causal, fa.scale = a.scale, fa.dropout_p = a.dropout_p, fa.seed = a.seed;
  fa.enable_gqa = a.enable_gqa, fa.layout = a.layout;
  fa.window_left = a.window_left, fa.window_right = a.window_right, fa.softcap = a.softcap;
  fa.alibi_slopes = a.alibi_slopes, fa.sinks = a.sinks;
  AttentionBackwardParams p{};
  p.fwd = detail::attention_params(fa, false);  // every forward check, in the forward's words (out, lse read)

  if (a.dropout_p > 0.0 && !a.seed) {
    fail("seed must be the forward's dropout seed when dropout_p > 0, got None");
  }
  detail::check_like(a.dout, "dout", a.out, "out");
  detail::check_like(a.dq, "dq", a.q, "q");
  detail::check_like(a.dk, "dk", a.k, "k");
  detail::check_like(a.dv, "dv", a.v, "v");
  if (a.dlse) {
    const TensorView& l = *a.dlse;
    if (l.rank != 3 || l.shape[0] != p.fwd.B || l.shape[1] != p.fwd.Hq || l.shape[2] != p.fwd.Sq) {
      fail("dlse must have lse's shape ", a.lse.shape_str(), ", got ", l.shape_str());
    }
    if (l.dtype != DType::float32) fail("dlse must be float32, got ", dtype_name(l.dtype));
  }
  detail::check_dsinks(a.sinks, a.dsinks, p.fwd.Hq);
  detail::NamedViews grads = {{&a.dq, "dq"}, {&a.dk, "dk"}, {&a.dv, "dv"}};
  if (a.dsinks) grads.push_back({&*a.dsinks, "dsinks"});
  detail::NamedViews inputs = {{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}, {&a.lse, "lse"}, {&a.dout, "dout"}};
  if (a.attn_mask) inputs.push_back({&*a.attn_mask, "attn_mask"});
  if (a.dlse) inputs.push_back({&*a.dlse, "dlse"});
  if (a.alibi_slopes) inputs.push_back({&*a.alibi_slopes, "alibi_slopes"});
  if (a.sinks) inputs.push_back({&*a.sinks, "sinks"});
  detail::check_gradients(grads, inputs);

  p.dout = a.dout.data, p.dq = a.dq.data, p.dk = a.dk.data, p.dv = a.dv.data;
  bhsd_strides(a.dout, a.layout, p.dout_stride);
  bhsd_strides(a.dq, a.layout, p.dq_stride);
  bhsd_strides(a.dk, a.layout, p.dk_stride);
  bhsd_strides(a.dv, a.layout, p.dv_stride);
  if (a.dlse) {
    p.dlse = static_cast<const float*>(a.dlse->data);
    for (int d = 0; d < 3; ++d) p.dlse_stride[d] = a.dlse->strides[d];
  }
  if (a.dsinks) p.dsinks = static_cast<float*>(a.dsinks->data), p.dsinks_stride = a.dsinks->strides[0];
  // Empty queries (Sq = 0) or keys (Skv = 0) are never read or written, and their data may
  // be null (an empty torch tensor's is): zero strides keep the kernel from forming offsets
  // from it, as the forward does for empty K/V.
  if (p.fwd.Sq == 0) {
    for (int64_t* s : {p.fwd.q_stride, p.fwd.out_stride, p.dout_stride, p.dq_stride}) std::fill(s, s + 4, 0);
    std::fill(p.fwd.lse_stride, p.fwd.lse_stride + 3, 0);
    std::fill(p.dlse_stride, p.dlse_stride + 3, 0);
  }
  if (p.fwd.Skv == 0) {
    for (int64_t* s : {p.dk_stride, p.dv_stride}) std::fill(s, s + 4, 0);
  }
  const AttentionParams& f = p.fwd;
  if (f.B == 0 || (f.Hq == 0 && f.Hkv == 0)) {  // nothing to write but the sinks' zero gradient
    for (int64_t h = 0; p.dsinks && h < f.Hq; ++h) p.dsinks[h * p.dsinks_stride] = 0.0f;
    return;
  }
  detail::kernels().attention_bwd({&p, 1});
}

}  // namespace attnkit
