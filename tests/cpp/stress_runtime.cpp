// Multi-thread stress of the runtime, for ThreadSanitizer (scripts/check_tsan.sh) and as a
// plain ctest: several host threads compute attention, sage int8 and the varlen backward (a
// batch of short sequences: they run one per pool thread, side by side) at once, one of them
// with an interrupt poll that stops some calls, while another thread keeps changing the
// thread count and the ISA. Every finished call must equal, bitwise, the serial result of
// the ISA it ran on (one of the per-ISA results: an op reads the ISA once when it starts).
// Usage: attnkit_stress [rounds per thread, default 40]. Exit status 0 on success.
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attnkit/attnkit.h"

namespace {

using namespace attnkit;

enum class Op { attention, sage, varlen_backward };

struct Case {
  int64_t B, Hq, Hkv, Sq, Skv, D;
  Causal causal;
  Op op;
  std::vector<float> q, k, v;
  std::vector<std::vector<float>> expected;  // one per ISA in supported_isas()
  // varlen_backward: B sequences of lengths lens (queries and keys, causal), their packed
  // rows in q, k, v (Sq = Skv = the total), the forward's out and lse, and dout.
  std::vector<int32_t> cu_seqlens;
  std::vector<float> out, lse, dout;
};

// The varlen forward of the case's sequences (out, lse), at one thread on the current ISA.
void varlen_forward(Case& c) {
  const int64_t total = c.Sq;
  c.out.assign(total * c.Hq * c.D, 0.0f), c.lse.assign(total * c.Hq, 0.0f);
  VarlenAttentionArgs a;
  a.q = TensorView(c.q.data(), DType::float32, {total, c.Hq, c.D});
  a.k = TensorView(c.k.data(), DType::float32, {total, c.Hkv, c.D});
  a.v = TensorView(c.v.data(), DType::float32, {total, c.Hkv, c.D});
  a.cu_seqlens_q = a.cu_seqlens_k = TensorView(c.cu_seqlens.data(), DType::int32, {c.B + 1});
  a.out = TensorView(c.out.data(), DType::float32, {total, c.Hq, c.D});
  a.lse = TensorView(c.lse.data(), DType::float32, {total, c.Hq});
  a.causal = true;
  varlen_attention(a);
}

Case make_case(int seed) {
  std::mt19937 gen(seed);
  auto pick = [&](int lo, int hi) { return static_cast<int64_t>(std::uniform_int_distribution<int>(lo, hi)(gen)); };
  Case c;
  c.B = 1 + pick(0, 1), c.Hkv = 1 + pick(0, 1), c.Sq = pick(1, 60), c.Skv = pick(1, 200), c.D = 8 * pick(1, 6);
  c.causal = seed % 3 == 0 ? Causal::none : (seed % 3 == 1 ? Causal::top_left : Causal::bottom_right);
  c.op = seed % 4 == 3 ? Op::sage : (seed % 4 == 2 ? Op::varlen_backward : Op::attention);
  c.Hq = c.Hkv * (1 + pick(0, 2));
  std::normal_distribution<float> dist;
  if (c.op == Op::varlen_backward) {  // 8-12 sequences of 0-20 tokens
    c.B = 8 + pick(0, 4);
    c.cu_seqlens.assign(1, 0);
    for (int64_t b = 0; b < c.B; ++b) c.cu_seqlens.push_back(c.cu_seqlens.back() + static_cast<int32_t>(pick(0, 20)));
    c.Sq = c.Skv = c.cu_seqlens.back();
    c.q.resize(c.Sq * c.Hq * c.D);
    c.k.resize(c.Skv * c.Hkv * c.D);
    c.v.resize(c.Skv * c.Hkv * c.D);
    c.dout.resize(c.Sq * c.Hq * c.D);
    for (auto* t : {&c.q, &c.k, &c.v, &c.dout})
      for (float& x : *t) x = dist(gen);
    varlen_forward(c);
    return c;
  }
  c.q.resize(c.B * c.Hq * c.Sq * c.D);
  c.k.resize(c.B * c.Hkv * c.Skv * c.D);
  c.v.resize(c.B * c.Hkv * c.Skv * c.D);
  for (auto* t : {&c.q, &c.k, &c.v})
    for (float& x : *t) x = dist(gen);
  return c;
}

// The varlen backward's dq, dk and dv, one after the other.
std::vector<float> varlen_backward(const Case& c) {
  const int64_t total = c.Sq, q_size = total * c.Hq * c.D, kv_size = total * c.Hkv * c.D;
  std::vector<float> grads(q_size + 2 * kv_size, NAN);
  auto view = [&](const float* data, int64_t heads) {
    return TensorView(const_cast<float*>(data), DType::float32, {total, heads, c.D});
  };
  VarlenAttentionBackwardArgs a;
  a.q = view(c.q.data(), c.Hq), a.k = view(c.k.data(), c.Hkv), a.v = view(c.v.data(), c.Hkv);
  a.cu_seqlens_q = a.cu_seqlens_k = TensorView(const_cast<int32_t*>(c.cu_seqlens.data()), DType::int32, {c.B + 1});
  a.out = view(c.out.data(), c.Hq), a.dout = view(c.dout.data(), c.Hq);
  a.lse = TensorView(const_cast<float*>(c.lse.data()), DType::float32, {total, c.Hq});
  a.dq = view(grads.data(), c.Hq), a.dk = view(grads.data() + q_size, c.Hkv);
  a.dv = view(grads.data() + q_size + kv_size, c.Hkv);
  a.causal = true;
  varlen_attention_backward(a);
  return grads;
}

// Runs the case; returns the output (NaN-poisoned first, so an unwritten element shows).
std::vector<float> compute(const Case& c) {
  if (c.op == Op::varlen_backward) return varlen_backward(c);
  std::vector<float> out(c.B * c.Hq * c.Sq * c.D, NAN);
  const TensorView q(const_cast<float*>(c.q.data()), DType::float32, {c.B, c.Hq, c.Sq, c.D});
  const TensorView k(const_cast<float*>(c.k.data()), DType::float32, {c.B, c.Hkv, c.Skv, c.D});
  const TensorView v(const_cast<float*>(c.v.data()), DType::float32, {c.B, c.Hkv, c.Skv, c.D});
  const TensorView o(out.data(), DType::float32, {c.B, c.Hq, c.Sq, c.D});
  if (c.op == Op::sage) {
    SageArgs a;
    a.q = q, a.k = k, a.v = v, a.out = o, a.causal = c.causal;
    sage_attention(a);
  } else {
    AttentionArgs a;
    a.q = q, a.k = k, a.v = v, a.out = o, a.causal = c.causal, a.enable_gqa = true;
    attention(a);
  }
  return out;
}

bool matches_one(const Case& c, const std::vector<float>& got) {
  for (const auto& e : c.expected) {
    if (std::memcmp(e.data(), got.data(), sizeof(float) * e.size()) == 0) return true;
  }
  return false;
}

// Stops a call at a pseudo-random poll (about one in three).
bool sometimes_stop(void* state) {
  auto& x = *static_cast<uint32_t*>(state);
  x = x * 1664525u + 1013904223u;
  return (x >> 16) % 3 == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 40;
  const std::vector<std::string> isas = supported_isas();
  const std::string initial_isa = active_isa();
  std::vector<Case> cases;
  for (int seed = 0; seed < 8; ++seed) cases.push_back(make_case(seed));
  set_num_threads(1);
  for (const std::string& isa : isas) {
    set_isa(isa);
    for (Case& c : cases) c.expected.push_back(compute(c));
  }
  set_num_threads(3);

  std::atomic<int> failures{0}, done{0}, interrupted{0};
  std::atomic<bool> stop{false};
  auto host = [&](int id) {
    uint32_t poll_state = 12345u + id;
    // Host thread 0 makes slow calls with a poll that stops some of them.
    ScopedInterruptPoll poll(id == 0 ? sometimes_stop : nullptr, &poll_state);
    for (int r = 0; r < rounds; ++r) {
      const Case& c = cases[(id * 5 + r) % cases.size()];
      try {
        if (!matches_one(c, compute(c))) {
          std::fprintf(stderr, "host thread %d round %d: result differs from every ISA's serial result\n", id, r);
          failures.fetch_add(1);
        }
      } catch (const Interrupted&) {
        interrupted.fetch_add(1);
      }
    }
    done.fetch_add(1);
  };
  auto changer = [&] {
    for (unsigned n = 0; !stop.load(); ++n) {
      set_num_threads(1 + n % 4);
      set_isa(isas[n % isas.size()]);
      if (get_num_threads() < 1 || active_isa().empty()) failures.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  };
  const int hosts = 4;
  std::thread change(changer);
  std::vector<std::thread> threads;
  for (int id = 0; id < hosts; ++id) threads.emplace_back(host, id);
  for (auto& t : threads) t.join();
  stop.store(true);
  change.join();
  set_isa(initial_isa);
  std::printf("attnkit_stress: %d host threads x %d calls, %d interrupted, %d failures\n", hosts, rounds,
              interrupted.load(), failures.load());
  return failures.load() == 0 && done.load() == hosts ? 0 : 1;
}
