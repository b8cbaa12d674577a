// The score modifiers' contract (see score_mods.h).
#include "ops/score_mods.h"

#include <cfloat>

#include "ops/checks.h"

namespace attnkit::detail {

void check_score_mods(const ScoreMods& m, int64_t batch, int64_t hq, int64_t reach, const TensorView& out,
                      const std::optional<TensorView>& lse, AttentionParams& p) {
  for (const auto& [side, value] : {std::pair{"left", m.window_left}, {"right", m.window_right}}) {
    if (value < -1) fail("window ", side, " must be -1 (unbounded) or >= 0, got ", value);
  }
  // The kernels divide by the cap in float32 (as a multiply by 1/c): c must be a normal float.
  if (m.softcap && !(*m.softcap >= FLT_MIN && *m.softcap <= FLT_MAX)) {
    fail("softcap must be a finite number > 0 (a normal float32), got ", *m.softcap);
  }
  if (m.alibi_slopes) {
    const TensorView& s = *m.alibi_slopes;
    const bool per_head = s.rank == 1 && s.shape[0] == hq;
    const bool per_batch = s.rank == 2 && s.shape[0] == batch && s.shape[1] == hq;
    if (s.dtype != DType::float32 || !(per_head || per_batch)) {
      fail("alibi_slopes must be float32 of shape [", hq, "] ([Hq]) or [", batch, ", ", hq, "] ([B, Hq]), got ",
           dtype_name(s.dtype), " of shape ", s.shape_str());
    }
  }
  if (m.sinks) {
    const TensorView& s = *m.sinks;
    if (s.dtype != DType::float32 || s.rank != 1 || s.shape[0] != hq) {
      fail("sinks must be float32 of shape [", hq, "] ([Hq]), got ", dtype_name(s.dtype), " of shape ",
           s.shape_str());
    }
  }
  for (const auto& [input, name] : {std::pair{&m.alibi_slopes, "alibi_slopes"}, {&m.sinks, "sinks"}}) {
    if (!*input) continue;
    check_no_overlap(out, "out", **input, name);
    if (lse) check_no_overlap(*lse, "lse", **input, name);
  }

  // A window side reaching past every key (|a - j| < reach always) is unbounded, so no
  // position arithmetic can overflow; under causal the right side never binds.
  p.window_left = m.window_left >= reach ? -1 : m.window_left;
  p.window_right = m.window_right >= reach || p.causal ? -1 : m.window_right;
  p.softcap = m.softcap ? static_cast<float>(*m.softcap) : 0.0f;
  if (m.alibi_slopes) {
    const TensorView& s = *m.alibi_slopes;
    p.alibi_slopes = static_cast<const float*>(s.data);
    p.alibi_stride[0] = s.rank == 2 ? s.strides[0] : 0;
    p.alibi_stride[1] = s.strides[s.rank - 1];
  }
  if (m.sinks) {
    p.sinks = static_cast<const float*>(m.sinks->data);
    p.sinks_stride = m.sinks->strides[0];
  }
}

}  // namespace attnkit::detail
