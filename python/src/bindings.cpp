// attnkit._C: the binding layer. It only turns Python arguments into attnkit views and
// calls the C++ API with the GIL released; every check lives in the op layer (src/ops).
// Arrays arrive through DLPack/the buffer protocol (numpy, torch) as (array, dtype name)
// pairs: the Python layer names the element type, since numpy cannot express bf16/fp8.
// torch tensors arrive as (address, shape, strides, dtype name) instead: exporting a tensor
// through DLPack costs microseconds per tensor, a large share of a decode step's call.
// Ops run with the GIL released and, on the main thread, stop at Ctrl-C (run_op).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cxxabi.h>
#include <pthread.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "attnkit/attnkit.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// A strided CPU tensor described by the caller (strides in elements), which keeps it
// alive for the call; only attnkit's Python layer builds these, from torch tensors.
using RawArray = std::tuple<uintptr_t, std::vector<int64_t>, std::vector<int64_t>, std::string>;
// Inputs may be read-only (nb::ro); outputs must be writable.
using InArray = std::variant<RawArray, std::tuple<nb::ndarray<nb::ro, nb::device::cpu>, std::string>>;
using OutArray = std::variant<RawArray, std::tuple<nb::ndarray<nb::device::cpu>, std::string>>;

attnkit::TensorView to_view(const RawArray& raw, const char* name) {
  const auto& [address, shape, strides, dtype_name] = raw;
  if (shape.size() != strides.size() || shape.size() > static_cast<size_t>(attnkit::kMaxRank)) {
    throw attnkit::Error(std::string(name) + " must have at most " + std::to_string(attnkit::kMaxRank) +
                         " dimensions, got " + std::to_string(shape.size()));
  }
  attnkit::TensorView view;
  view.dtype = attnkit::dtype_from_name(dtype_name);
  view.data = reinterpret_cast<void*>(address);
  view.rank = static_cast<int>(shape.size());
  for (int d = 0; d < view.rank; ++d) {
    view.shape[d] = shape[d];
    view.strides[d] = strides[d];
  }
  return view;
}

template <class Array>
attnkit::TensorView to_view(const std::tuple<Array, std::string>& typed, const char* name) {
  const auto& [array, dtype_name] = typed;
  attnkit::TensorView view;
  view.dtype = attnkit::dtype_from_name(dtype_name);
  if (array.itemsize() != attnkit::dtype_size(view.dtype)) {
    throw attnkit::Error(std::string(name) + ": element size " + std::to_string(array.itemsize()) +
                         " does not match dtype " + dtype_name);
  }
  if (array.ndim() > static_cast<size_t>(attnkit::kMaxRank)) {
    throw attnkit::Error(std::string(name) + " must have at most " +
                         std::to_string(attnkit::kMaxRank) + " dimensions, got " +
                         std::to_string(array.ndim()));
  }
  view.data = const_cast<void*>(static_cast<const void*>(array.data()));
  view.rank = static_cast<int>(array.ndim());
  for (int d = 0; d < view.rank; ++d) {
    view.shape[d] = static_cast<int64_t>(array.shape(d));
    view.strides[d] = static_cast<int64_t>(array.stride(d));
  }
  return view;
}

template <class... Forms>
attnkit::TensorView to_view(const std::variant<Forms...>& typed, const char* name) {
  return std::visit([name](const auto& form) { return to_view(form, name); }, typed);
}

template <class TypedArray>
std::optional<attnkit::TensorView> to_view(const std::optional<TypedArray>& typed,
                                           const char* name) {
  if (!typed) return std::nullopt;
  return to_view(*typed, name);
}

// Ctrl-C while an op runs with the GIL released: Python's handler cannot run until the call
// returns, so the op polls (runtime.h, on its calling thread, about every 50 ms) and the poll
// takes the GIL and runs the pending signal handlers. If one raised (KeyboardInterrupt), the
// op stops and that exception is raised from the call. Only the main thread runs signal
// handlers, so calls on other threads install no poll.
unsigned long main_thread_ident = 0;

// A fork() child's only thread is its main thread, as os.fork tells Python (without this a
// child forked from another thread installed no poll, and Ctrl-C waited for the call).
void main_thread_is_forking_thread() { main_thread_ident = PyThread_get_thread_ident(); }

// The GIL released around an op. A daemon thread that takes the GIL back while the
// interpreter finalizes is ended by pthread_exit (Python 3.11), whose unwinding through a
// destructor (noexcept) aborted the process at exit (torch's ops do the same): such a thread
// parks instead, as later Pythons do themselves; the exiting process ends it.
class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  ~GilReleased() {
    try {
      PyEval_RestoreThread(state_);
    } catch (abi::__forced_unwind&) {
      for (;;) pause();
    }
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

bool run_signal_handlers(void*) {
  nb::gil_scoped_acquire gil;
  return PyErr_CheckSignals() != 0;  // the exception stays set on this thread until run_op raises it
}

template <class F>
void run_op(const F& op) {
  const bool main_thread = PyThread_get_thread_ident() == main_thread_ident;
  bool interrupted = false;
  {
    const GilReleased released;
    attnkit::ScopedInterruptPoll poll(main_thread ? run_signal_handlers : nullptr, nullptr);
    try {
      op();
    } catch (const attnkit::Interrupted&) {
      interrupted = true;
    }
  }
  if (interrupted) throw nb::python_error();
}

attnkit::Layout parse_layout(const std::string& layout) {
  if (layout == "BHSD") return attnkit::Layout::BHSD;
  if (layout == "BSHD") return attnkit::Layout::BSHD;
  throw attnkit::Error("layout must be \"BHSD\" or \"BSHD\", got \"" + layout + "\"");
}

attnkit::Causal parse_causal(int causal) {
  if (causal < 0 || causal > 2) throw attnkit::Error("causal: expected 0, 1 or 2");
  return static_cast<attnkit::Causal>(causal);
}

void attention(const InArray& q, const InArray& k, const InArray& v, const OutArray& out,
               const std::optional<OutArray>& lse, const std::optional<InArray>& attn_mask, int causal,
               std::optional<double> scale, double dropout_p, std::optional<uint64_t> seed,
               bool enable_gqa, const std::string& layout, int64_t window_left, int64_t window_right,
               std::optional<double> softcap, const std::optional<InArray>& alibi_slopes,
               const std::optional<InArray>& sinks) {
  attnkit::AttentionArgs args;
  args.q = to_view(q, "q");
  args.k = to_view(k, "k");
  args.v = to_view(v, "v");
  args.out = to_view(out, "out");
  args.lse = to_view(lse, "lse");
  args.attn_mask = to_view(attn_mask, "attn_mask");
  args.causal = parse_causal(causal);
  args.scale = scale;
  args.dropout_p = dropout_p;
  args.seed = seed;
  args.enable_gqa = enable_gqa;
  args.layout = parse_layout(layout);
  args.window_left = window_left, args.window_right = window_right;
  args.softcap = softcap;
  args.alibi_slopes = to_view(alibi_slopes, "alibi_slopes");
  args.sinks = to_view(sinks, "sinks");
  run_op([&] { attnkit::attention(args); });
}

void attention_backward(const InArray& q, const InArray& k, const InArray& v, const InArray& out,
                        const InArray& lse, const InArray& dout, const OutArray& dq, const OutArray& dk,
                        const OutArray& dv, const std::optional<InArray>& dlse,
                        const std::optional<InArray>& attn_mask, int causal,
                        std::optional<double> scale, double dropout_p, std::optional<uint64_t> seed,
                        bool enable_gqa, const std::string& layout, int64_t window_left, int64_t window_right,
                        std::optional<double> softcap, const std::optional<InArray>& alibi_slopes,
                        const std::optional<InArray>& sinks, const std::optional<OutArray>& dsinks) {
  attnkit::AttentionBackwardArgs args;
  args.q = to_view(q, "q");
  args.k = to_view(k, "k");
  args.v = to_view(v, "v");
  args.out = to_view(out, "out");
  args.lse = to_view(lse, "lse");
  args.dout = to_view(dout, "dout");
  args.dq = to_view(dq, "dq");
  args.dk = to_view(dk, "dk");
  args.dv = to_view(dv, "dv");
  args.dlse = to_view(dlse, "dlse");
  args.attn_mask = to_view(attn_mask, "attn_mask");
  args.causal = parse_causal(causal);
  args.scale = scale;
  args.dropout_p = dropout_p;
  args.seed = seed;
  args.enable_gqa = enable_gqa;
  args.layout = parse_layout(layout);
  args.window_left = window_left, args.window_right = window_right;
  args.softcap = softcap;
  args.alibi_slopes = to_view(alibi_slopes, "alibi_slopes");
  args.sinks = to_view(sinks, "sinks");
  args.dsinks = to_view(dsinks, "dsinks");
  run_op([&] { attnkit::attention_backward(args); });
}

attnkit::SparseMlaArgs sparse_mla_args(const InArray& q, const InArray& kv, const InArray& indices,
                                        double sm_scale, int64_t d_v, const std::optional<InArray>& q_scale,
                                        const std::optional<InArray>& kv_scale,
                                        const std::optional<InArray>& attn_sink,
                                        const std::optional<InArray>& topk_length, const OutArray& out,
                                        const OutArray& max_logits, const OutArray& lse) {
  attnkit::SparseMlaArgs args;
  args.q = to_view(q, "q");
  args.kv = to_view(kv, "kv");
  args.indices = to_view(indices, "indices");
  args.sm_scale = sm_scale;
  args.d_v = d_v;
  args.q_scale = to_view(q_scale, "q_scale");
  args.kv_scale = to_view(kv_scale, "kv_scale");
  args.attn_sink = to_view(attn_sink, "attn_sink");
  args.topk_length = to_view(topk_length, "topk_length");
  args.out = to_view(out, "out");
  args.max_logits = to_view(max_logits, "max_logits");
  args.lse = to_view(lse, "lse");
  return args;
}

template <void (*Op)(const attnkit::SparseMlaArgs&)>
void sparse_mla(const InArray& q, const InArray& kv, const InArray& indices, double sm_scale, int64_t d_v,
                const std::optional<InArray>& q_scale, const std::optional<InArray>& kv_scale,
                const std::optional<InArray>& attn_sink, const std::optional<InArray>& topk_length,
                const OutArray& out, const OutArray& max_logits, const OutArray& lse) {
  const attnkit::SparseMlaArgs args = sparse_mla_args(q, kv, indices, sm_scale, d_v, q_scale, kv_scale, attn_sink,
                                                      topk_length, out, max_logits, lse);
  run_op([&] { Op(args); });
}

void sage_attention(const InArray& q, const InArray& k, const InArray& v, const OutArray& out,
                    const std::optional<OutArray>& lse, int causal, std::optional<double> scale,
                    const std::string& layout, const std::string& mode, int64_t window_left,
                    int64_t window_right, std::optional<double> softcap,
                    const std::optional<InArray>& alibi_slopes, const std::optional<InArray>& sinks,
                    const std::optional<InArray>& attn_mask, const std::optional<InArray>& kv_lens) {
  attnkit::SageArgs args;
  args.q = to_view(q, "q");
  args.k = to_view(k, "k");
  args.v = to_view(v, "v");
  args.out = to_view(out, "out");
  args.lse = to_view(lse, "lse");
  args.causal = parse_causal(causal);
  args.scale = scale;
  args.layout = parse_layout(layout);
  args.window_left = window_left, args.window_right = window_right;
  args.softcap = softcap;
  args.alibi_slopes = to_view(alibi_slopes, "alibi_slopes");
  args.sinks = to_view(sinks, "sinks");
  args.attn_mask = to_view(attn_mask, "attn_mask");
  args.kv_lens = to_view(kv_lens, "kv_lens");
  if (mode == "int8") {
    args.mode = attnkit::SageMode::int8;
  } else if (mode == "int8_pv_int8") {
    args.mode = attnkit::SageMode::int8_pv_int8;
  } else if (mode == "fp4") {
    args.mode = attnkit::SageMode::fp4;
  } else {
    throw attnkit::Error("mode must be \"int8\", \"int8_pv_int8\" or \"fp4\", got \"" + mode + "\"");
  }
  run_op([&] { attnkit::sage_attention(args); });
}

void varlen_attention(const InArray& q, const InArray& k, const InArray& v, const InArray& cu_seqlens_q,
                      const InArray& cu_seqlens_k, const OutArray& out, const std::optional<OutArray>& lse,
                      std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k, bool causal,
                      std::optional<double> scale, int64_t window_left, int64_t window_right,
                      std::optional<double> softcap, const std::optional<InArray>& alibi_slopes,
                      const std::optional<InArray>& sinks) {
  attnkit::VarlenAttentionArgs args;
  args.q = to_view(q, "q");
  args.k = to_view(k, "k");
  args.v = to_view(v, "v");
  args.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q");
  args.cu_seqlens_k = to_view(cu_seqlens_k, "cu_seqlens_k");
  args.out = to_view(out, "out");
  args.lse = to_view(lse, "lse");
  args.max_seqlen_q = max_seqlen_q;
  args.max_seqlen_k = max_seqlen_k;
  args.causal = causal;
  args.scale = scale;
  args.window_left = window_left, args.window_right = window_right;
  args.softcap = softcap;
  args.alibi_slopes = to_view(alibi_slopes, "alibi_slopes");
  args.sinks = to_view(sinks, "sinks");
  run_op([&] { attnkit::varlen_attention(args); });
}

void varlen_attention_backward(const InArray& q, const InArray& k, const InArray& v, const InArray& cu_seqlens_q,
                               const InArray& cu_seqlens_k, const InArray& out, const InArray& lse,
                               const InArray& dout, const OutArray& dq, const OutArray& dk, const OutArray& dv,
                               const std::optional<InArray>& dlse, std::optional<int64_t> max_seqlen_q,
                               std::optional<int64_t> max_seqlen_k, bool causal, std::optional<double> scale,
                               int64_t window_left, int64_t window_right, std::optional<double> softcap,
                               const std::optional<InArray>& alibi_slopes, const std::optional<InArray>& sinks,
                               const std::optional<OutArray>& dsinks) {
  attnkit::VarlenAttentionBackwardArgs args;
  args.q = to_view(q, "q");
  args.k = to_view(k, "k");
  args.v = to_view(v, "v");
  args.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q");
  args.cu_seqlens_k = to_view(cu_seqlens_k, "cu_seqlens_k");
  args.out = to_view(out, "out");
  args.lse = to_view(lse, "lse");
  args.dout = to_view(dout, "dout");
  args.dq = to_view(dq, "dq");
  args.dk = to_view(dk, "dk");
  args.dv = to_view(dv, "dv");
  args.dlse = to_view(dlse, "dlse");
  args.max_seqlen_q = max_seqlen_q;
  args.max_seqlen_k = max_seqlen_k;
  args.causal = causal;
  args.scale = scale;
  args.window_left = window_left, args.window_right = window_right;
  args.softcap = softcap;
  args.alibi_slopes = to_view(alibi_slopes, "alibi_slopes");
  args.sinks = to_view(sinks, "sinks");
  args.dsinks = to_view(dsinks, "dsinks");
  run_op([&] { attnkit::varlen_attention_backward(args); });
}

void paged_attention(const InArray& q, const InArray& k_cache, const InArray& v_cache, const InArray& block_table,
                     const InArray& seq_lens, const InArray& cu_seqlens_q, const OutArray& out,
                     const std::optional<OutArray>& lse, const std::optional<InArray>& k_scale,
                     const std::optional<InArray>& v_scale, bool causal, std::optional<double> scale,
                     int64_t window_left, int64_t window_right, std::optional<double> softcap,
                     const std::optional<InArray>& alibi_slopes, const std::optional<InArray>& sinks) {
  attnkit::PagedAttentionArgs args;
  args.q = to_view(q, "q");
  args.k_cache = to_view(k_cache, "k_cache");
  args.v_cache = to_view(v_cache, "v_cache");
  args.block_table = to_view(block_table, "block_table");
  args.seq_lens = to_view(seq_lens, "seq_lens");
  args.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q");
  args.out = to_view(out, "out");
  args.lse = to_view(lse, "lse");
  args.k_scale = to_view(k_scale, "k_scale");
  args.v_scale = to_view(v_scale, "v_scale");
  args.causal = causal;
  args.scale = scale;
  args.window_left = window_left, args.window_right = window_right;
  args.softcap = softcap;
  args.alibi_slopes = to_view(alibi_slopes, "alibi_slopes");
  args.sinks = to_view(sinks, "sinks");
  run_op([&] { attnkit::paged_attention(args); });
}

void append_kv_cache(const InArray& k, const InArray& v, const OutArray& k_cache, const OutArray& v_cache,
                     const InArray& slot_mapping, const std::optional<InArray>& k_scale,
                     const std::optional<InArray>& v_scale) {
  attnkit::AppendKvCacheArgs args;
  args.k = to_view(k, "k");
  args.v = to_view(v, "v");
  args.k_cache = to_view(k_cache, "k_cache");
  args.v_cache = to_view(v_cache, "v_cache");
  args.slot_mapping = to_view(slot_mapping, "slot_mapping");
  args.k_scale = to_view(k_scale, "k_scale");
  args.v_scale = to_view(v_scale, "v_scale");
  run_op([&] { attnkit::append_kv_cache(args); });
}

void cast(const InArray& src, const OutArray& dst) {
  attnkit::TensorView s = to_view(src, "src"), d = to_view(dst, "dst");
  if (!s.is_contiguous() || !d.is_contiguous() || s.numel() != d.numel()) {
    throw attnkit::Error("cast: src and dst must be contiguous with the same number of elements");
  }
  attnkit::cast(s.data, s.dtype, d.data, d.dtype, static_cast<size_t>(s.numel()));
}

void merge_attention_states(const InArray& out_a, const InArray& lse_a, const InArray& out_b, const InArray& lse_b,
                            const OutArray& out, const OutArray& lse_out) {
  attnkit::MergeStatesArgs args;
  args.out_a = to_view(out_a, "out_a");
  args.lse_a = to_view(lse_a, "lse_a");
  args.out_b = to_view(out_b, "out_b");
  args.lse_b = to_view(lse_b, "lse_b");
  args.out = to_view(out, "out");
  args.lse_out = to_view(lse_out, "lse_out");
  run_op([&] { attnkit::merge_attention_states(args); });
}

// DSA (include/attnkit/dsa.h).
void flash_mla_with_kvcache(const InArray& q, const InArray& k_cache, const std::optional<InArray>& block_table,
                            const std::optional<InArray>& cache_seqlens, int64_t head_dim_v,
                            std::optional<double> softmax_scale, bool causal, bool is_fp8_kvcache,
                            const std::optional<InArray>& indices, const std::optional<InArray>& attn_sink,
                            const std::optional<InArray>& topk_length, const OutArray& out, const OutArray& lse) {
  attnkit::MlaDecodeArgs args;
  args.q = to_view(q, "q");
  args.k_cache = to_view(k_cache, "k_cache");
  args.block_table = to_view(block_table, "block_table");
  args.cache_seqlens = to_view(cache_seqlens, "cache_seqlens");
  args.head_dim_v = head_dim_v;
  args.softmax_scale = softmax_scale;
  args.causal = causal;
  args.is_fp8_kvcache = is_fp8_kvcache;
  args.indices = to_view(indices, "indices");
  args.attn_sink = to_view(attn_sink, "attn_sink");
  args.topk_length = to_view(topk_length, "topk_length");
  args.out = to_view(out, "out");
  args.lse = to_view(lse, "lse");
  run_op([&] { attnkit::flash_mla_with_kvcache(args); });
}

void quantize_v32_kv(const InArray& kv, const OutArray& dst) {
  const attnkit::TensorView s = to_view(kv, "kv"), d = to_view(dst, "dst");
  run_op([&] { attnkit::quantize_v32_kv(s, d); });
}

void fp8_mqa_logits(const InArray& q, const InArray& kv, const InArray& kv_scale, const InArray& weights,
                    const InArray& ks, const InArray& ke, bool clean_logits, int64_t max_seqlen_k,
                    const std::optional<OutArray>& logits, const std::optional<OutArray>& topk_indices) {
  attnkit::IndexerLogitsArgs args;
  args.q = to_view(q, "q");
  args.kv = to_view(kv, "kv");
  args.kv_scale = to_view(kv_scale, "kv_scale");
  args.weights = to_view(weights, "weights");
  args.ks = to_view(ks, "cu_seq_len_k_start");
  args.ke = to_view(ke, "cu_seq_len_k_end");
  args.clean_logits = clean_logits;
  args.max_seqlen_k = max_seqlen_k;
  args.logits = to_view(logits, "logits");
  args.topk_indices = to_view(topk_indices, "topk_indices");
  run_op([&] { attnkit::fp8_mqa_logits(args); });
}

void fp8_paged_mqa_logits(const InArray& q, const InArray& kv_cache, const InArray& weights, const InArray& context_lens,
                          const InArray& block_table, int64_t max_context_len, bool clean_logits, const OutArray& logits) {
  attnkit::PagedIndexerLogitsArgs args;
  args.q = to_view(q, "q");
  args.kv_cache = to_view(kv_cache, "kv_cache");
  args.weights = to_view(weights, "weights");
  args.context_lens = to_view(context_lens, "context_lens");
  args.block_table = to_view(block_table, "block_table");
  args.max_context_len = max_context_len;
  args.clean_logits = clean_logits;
  args.logits = to_view(logits, "logits");
  run_op([&] { attnkit::fp8_paged_mqa_logits(args); });
}

void topk_transform(const InArray& logits, const InArray& lengths, int64_t topk, const std::optional<InArray>& row_starts,
                    const std::optional<InArray>& offsets, const std::optional<InArray>& page_table, int64_t page_size,
                    const std::optional<InArray>& row_to_batch, const OutArray& out) {
  attnkit::TopkArgs args;
  args.logits = to_view(logits, "logits");
  args.lengths = to_view(lengths, "lengths");
  args.topk = topk;
  args.row_starts = to_view(row_starts, "row_starts");
  args.offsets = to_view(offsets, "offsets");
  args.page_table = to_view(page_table, "page_table");
  args.page_size = page_size;
  args.row_to_batch = to_view(row_to_batch, "row_to_batch");
  args.out = to_view(out, "out");
  run_op([&] { attnkit::topk_transform(args); });
}

}  // namespace

NB_MODULE(_C, m) {
  main_thread_ident = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  pthread_atfork(nullptr, nullptr, main_thread_is_forking_thread);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const attnkit::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("attention", &attention, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(),
        "attn_mask"_a.none(), "causal"_a, "scale"_a.none(), "dropout_p"_a, "seed"_a.none(),
        "enable_gqa"_a, "layout"_a, "window_left"_a = -1, "window_right"_a = -1, "softcap"_a.none() = nb::none(),
        "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none());
  m.def("attention_backward", &attention_backward, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "dout"_a, "dq"_a,
        "dk"_a, "dv"_a, "dlse"_a.none(), "attn_mask"_a.none(), "causal"_a, "scale"_a.none(), "dropout_p"_a,
        "seed"_a.none(), "enable_gqa"_a, "layout"_a, "window_left"_a = -1, "window_right"_a = -1,
        "softcap"_a.none() = nb::none(), "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none(),
        "dsinks"_a.none() = nb::none());
  m.def("cast", &cast, "src"_a, "dst"_a);
  m.def("sage_attention", &sage_attention, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(), "causal"_a,
        "scale"_a.none(), "layout"_a, "mode"_a, "window_left"_a = -1, "window_right"_a = -1,
        "softcap"_a.none() = nb::none(), "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none(),
        "attn_mask"_a.none() = nb::none(), "kv_lens"_a.none() = nb::none());
  m.def("sparse_mla_prefill_fwd", &sparse_mla<&attnkit::sparse_mla_prefill_fwd>, "q"_a, "kv"_a, "indices"_a,
        "sm_scale"_a, "d_v"_a, "q_scale"_a.none(), "kv_scale"_a.none(), "attn_sink"_a.none(),
        "topk_length"_a.none(), "out"_a, "max_logits"_a, "lse"_a);
  m.def("sparse_mla_q8kv8_prefill_fwd", &sparse_mla<&attnkit::sparse_mla_q8kv8_prefill_fwd>, "q"_a, "kv"_a,
        "indices"_a, "sm_scale"_a, "d_v"_a, "q_scale"_a.none(), "kv_scale"_a.none(), "attn_sink"_a.none(),
        "topk_length"_a.none(), "out"_a, "max_logits"_a, "lse"_a);
  m.def("varlen_attention", &varlen_attention, "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "out"_a,
        "lse"_a.none(), "max_seqlen_q"_a.none(), "max_seqlen_k"_a.none(), "causal"_a, "scale"_a.none(),
        "window_left"_a, "window_right"_a, "softcap"_a.none(), "alibi_slopes"_a.none(), "sinks"_a.none());
  m.def("varlen_attention_backward", &varlen_attention_backward, "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a,
        "cu_seqlens_k"_a, "out"_a, "lse"_a, "dout"_a, "dq"_a, "dk"_a, "dv"_a, "dlse"_a.none(), "max_seqlen_q"_a.none(),
        "max_seqlen_k"_a.none(), "causal"_a, "scale"_a.none(), "window_left"_a, "window_right"_a,
        "softcap"_a.none(), "alibi_slopes"_a.none(), "sinks"_a.none(), "dsinks"_a.none());
  m.def("paged_attention", &paged_attention, "q"_a, "k_cache"_a, "v_cache"_a, "block_table"_a, "seq_lens"_a,
        "cu_seqlens_q"_a, "out"_a, "lse"_a.none(), "k_scale"_a.none(), "v_scale"_a.none(), "causal"_a,
        "scale"_a.none(), "window_left"_a, "window_right"_a, "softcap"_a.none(), "alibi_slopes"_a.none(),
        "sinks"_a.none());
  m.def("append_kv_cache", &append_kv_cache, "k"_a, "v"_a, "k_cache"_a, "v_cache"_a, "slot_mapping"_a,
        "k_scale"_a.none(), "v_scale"_a.none());
  m.def("set_num_threads", &attnkit::set_num_threads, "n"_a);
  m.def("get_num_threads", &attnkit::get_num_threads);
  m.def("active_isa", &attnkit::active_isa);
  m.def("supported_isas", &attnkit::supported_isas);
  m.def("set_isa", &attnkit::set_isa, "name"_a);
  m.def("isa_rule", &attnkit::isa_rule);
  m.def("peak_instructions", &attnkit::peak_instructions);
  m.def("measure_peak_gflops", &attnkit::measure_peak_gflops, "instruction"_a, "threads"_a,
        nb::call_guard<nb::gil_scoped_release>());
  m.def("measure_fma_peak_gflops", &attnkit::measure_fma_peak_gflops, "threads"_a,
        nb::call_guard<nb::gil_scoped_release>());
  m.def("measure_read_bandwidth_gbs", &attnkit::measure_read_bandwidth_gbs, "threads"_a,
        nb::call_guard<nb::gil_scoped_release>());
  m.def("version", &attnkit::version);
  m.def("build_info", &attnkit::build_info);
  m.def("cpu_features", &attnkit::cpu_features);
  m.def("merge_attention_states", &merge_attention_states, "out_a"_a, "lse_a"_a, "out_b"_a, "lse_b"_a, "out"_a,
        "lse_out"_a);
  m.def("flash_mla_with_kvcache", &flash_mla_with_kvcache, "q"_a, "k_cache"_a, "block_table"_a.none(),
        "cache_seqlens"_a.none(), "head_dim_v"_a, "softmax_scale"_a.none(), "causal"_a, "is_fp8_kvcache"_a,
        "indices"_a.none(), "attn_sink"_a.none(), "topk_length"_a.none(), "out"_a, "lse"_a);
  m.def("quantize_v32_kv", &quantize_v32_kv, "kv"_a, "dst"_a);
  m.def("fp8_mqa_logits", &fp8_mqa_logits, "q"_a, "kv"_a, "kv_scale"_a, "weights"_a, "ks"_a, "ke"_a,
        "clean_logits"_a, "max_seqlen_k"_a, "logits"_a.none(), "topk_indices"_a.none());
  m.def("fp8_paged_mqa_logits", &fp8_paged_mqa_logits, "q"_a, "kv_cache"_a, "weights"_a, "context_lens"_a,
        "block_table"_a, "max_context_len"_a, "clean_logits"_a, "logits"_a);
  m.def("topk_transform", &topk_transform, "logits"_a, "lengths"_a, "topk"_a, "row_starts"_a.none(),
        "offsets"_a.none(), "page_table"_a.none(), "page_size"_a, "row_to_batch"_a.none(), "out"_a);
}
