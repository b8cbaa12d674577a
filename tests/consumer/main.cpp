// Calls attnkit's public C++ API from outside the tree: one attention call checked against
// a direct computation, and one invalid call that must throw attnkit::Error.
#include <attnkit/attnkit.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const int S = 5, D = 4;  // B = 1, H = 1
  std::vector<float> q(S * D), k(S * D), v(S * D), out(S * D, NAN);
  for (int i = 0; i < S * D; ++i) {
    q[i] = std::sin(0.3f * i), k[i] = std::cos(0.2f * i), v[i] = 0.1f * i - 1.0f;
  }
  attnkit::AttentionArgs args;
  args.q = attnkit::TensorView(q.data(), attnkit::DType::float32, {1, 1, S, D});
  args.k = attnkit::TensorView(k.data(), attnkit::DType::float32, {1, 1, S, D});
  args.v = attnkit::TensorView(v.data(), attnkit::DType::float32, {1, 1, S, D});
  args.out = attnkit::TensorView(out.data(), attnkit::DType::float32, {1, 1, S, D});
  args.causal = attnkit::Causal::top_left;
  attnkit::attention(args);

  double worst = 0;
  for (int i = 0; i < S; ++i) {
    std::vector<double> p(i + 1);
    double sum = 0;
    for (int j = 0; j <= i; ++j) {
      double s = 0;
      for (int d = 0; d < D; ++d) s += double(q[i * D + d]) * k[j * D + d];
      sum += p[j] = std::exp(s / std::sqrt(double(D)));
    }
    for (int d = 0; d < D; ++d) {
      double o = 0;
      for (int j = 0; j <= i; ++j) o += p[j] / sum * v[j * D + d];
      worst = std::fmax(worst, std::fabs(o - out[i * D + d]));
    }
  }
  if (!(worst < 1e-5)) {
    std::printf("consumer: max error %g\n", worst);
    return 1;
  }
  args.k = attnkit::TensorView(k.data(), attnkit::DType::float32, {1, 1, S, D - 1});
  try {
    attnkit::attention(args);
    std::printf("consumer: invalid call did not throw\n");
    return 1;
  } catch (const attnkit::Error& e) {
    std::printf("consumer: ok (attnkit %s, isa %s; error seen: %s)\n", attnkit::version().c_str(),
                attnkit::active_isa().c_str(), e.what());
  }
  return 0;
}
