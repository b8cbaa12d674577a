"""One DeepSeek-V3.2 sparse attention (DSA) layer on the CPU, end to end, verified:
python -m attnkit.examples.dsa [--prompt 8192] [--decode 32] [--heads 128] [--check-rows 16]

Random projection weights from a small hidden state produce, per token, the indexer's query
(64 heads × 128) and key (128) and its head weights, and MLA's absorbed query (heads × 576)
and latent KV (576 = 512 + 64 rope). RoPE, the norms, the Hadamard rotation and the output
projection are left out: they do not change what the kernels compute. The layer then runs
as SGLang does with an fp8 cache on Hopper:
  prefill: index K and latent KV written to paged caches (page 64; the latent as 656-byte
           V3.2 tokens, quantize_v32_kv); the indexer fused with top-2048 (fp8_mqa_topk,
           causal ranges); the row-relative picks mapped to cache slots through the page
           table; flash_mla_with_kvcache with every prompt token a batch row of s_q = 1;
  decode:  per step the new token's caches are written, fp8_paged_mqa_logits over the
           index-K cache, topk_page_table_transform (page size 64) to slots,
           flash_mla_with_kvcache on the fp8 cache.
Verification, in float64 numpy on the same quantised inputs for --check-rows sampled prompt
rows and every decode step: the indexer logits; the selection (each picked key's float64
logit must be >= every unpicked key's minus the logit tolerance, so only near-ties may
differ from an exact top-k); and the attention over the picked slots (out and lse).
"""

import argparse
import sys
import time

import numpy as np

import attnkit
from attnkit import dsa

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

PAGE, TOPK, IDX_HEADS, IDX_DIM, D_QK, D_V = 64, 2048, 64, 128, 576, 512
HIDDEN = 128
# Tolerances (checked as |got - ref| <= atol + rtol·|ref|): indexer logits float32 sums of
# exact products, 1e-5 relative to their magnitude; out bf16 rounded once (rtol 1e-2,
# atol 1e-4·max|V| + 2^-8·Σp|V|/Σp for P rounded to bf16 before P·V); lse float32, 1e-5
# relative to its logit magnitude.
LOGIT_TOL, OUT_RTOL, OUT_ATOL, LSE_TOL, PV_ROUNDING = 1e-5, 1e-2, 1e-4, 1e-5, 2.0 ** -8


def fp8_quant_rows(x):
    """Per-row fp8 e4m3 quantisation with scale amax/448 (DeepGEMM's test quantiser)."""
    scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True) / np.float32(448.0), np.float32(1e-4)).astype(np.float32)
    return (x / scale).astype(ml_dtypes.float8_e4m3fn), scale[..., 0]


class Layer:
    """Random weights and the per-token projections of one DSA layer."""

    def __init__(self, rng, heads):
        self.heads = heads
        f = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
        self.w_qidx, self.w_kidx, self.w_wts = f(HIDDEN, IDX_HEADS * IDX_DIM), f(HIDDEN, IDX_DIM), f(HIDDEN, IDX_HEADS)
        self.w_q, self.w_kv = f(HIDDEN, heads * D_QK), f(HIDDEN, D_QK)

    def queries(self, x):
        """For tokens x [n, HIDDEN]: indexer q fp8 [n, 64, 128] (its scale folded into the
        weights, as SGLang does), weights [n, 64] float32, MLA q bf16 [n, heads, 576]."""
        n = x.shape[0]
        qi = (x @ self.w_qidx).reshape(n, IDX_HEADS, IDX_DIM)
        qi_fp8, qi_scale = fp8_quant_rows(qi)
        weights = (x @ self.w_wts) * IDX_HEADS ** -0.5 * IDX_DIM ** -0.5 * qi_scale
        q = (x @ self.w_q).reshape(n, self.heads, D_QK).astype(ml_dtypes.bfloat16)
        return qi_fp8, weights.astype(np.float32), q

    def keys(self, x):
        """Index k [n, 128] float32 and latent kv [n, 576] float32."""
        return x @ self.w_kidx, (x @ self.w_kv) * 4.0


class Caches:
    """The index-K cache (DeepGEMM's page layout) and the V3.2 fp8 latent cache, pages in a
    shuffled order through one page table (a single request)."""

    def __init__(self, rng, max_tokens):
        self.pages = -(-max_tokens // PAGE)
        self.table = rng.permutation(self.pages).astype(np.int32)
        self.index_k = np.zeros((self.pages, PAGE, 1, IDX_DIM + 4), np.uint8)
        self.kv = np.zeros((self.pages, PAGE, 1, 656), np.uint8)
        self.k_fp8 = np.zeros((max_tokens, IDX_DIM), ml_dtypes.float8_e4m3fn)  # flat copies, for the prefill
        self.k_scale = np.zeros(max_tokens, np.float32)

    def slot(self, t):
        return self.table[t // PAGE] * PAGE + t % PAGE

    def write(self, t0, k_idx, latent):
        n = k_idx.shape[0]
        fp8, scale = fp8_quant_rows(k_idx)
        self.k_fp8[t0:t0 + n], self.k_scale[t0:t0 + n] = fp8, scale
        tokens = np.arange(t0, t0 + n)
        page, off = self.table[tokens // PAGE], tokens % PAGE
        flat = self.index_k.reshape(self.pages, -1)   # per page: the values region, then the scales
        flat[page[:, None], off[:, None] * IDX_DIM + np.arange(IDX_DIM)] = fp8.view(np.uint8)
        flat[page[:, None], PAGE * IDX_DIM + 4 * off[:, None] + np.arange(4)] = scale.view(np.uint8).reshape(n, 4)
        self.kv[page, off, 0] = dsa.quantize_v32_kv(latent.astype(np.float32).astype(ml_dtypes.bfloat16))


# --- the float64 reference ------------------------------------------------------------------

def ref_indexer(qi, w, k_fp8, k_scale, n_keys):
    qf, kf = qi.astype(np.float64), k_fp8[:n_keys].astype(np.float64)
    s = np.einsum("hd,sd->hs", qf, kf)
    logits = (w.astype(np.float64)[:, None] * np.maximum(s, 0)).sum(0) * k_scale[:n_keys]
    mag = (np.abs(w.astype(np.float64))[:, None] * np.abs(qf) @ np.abs(kf).T).sum(0) * np.abs(k_scale[:n_keys])
    return logits, mag


def check_selection(picked_tokens, logits, mag, n_keys):
    """Every picked key scores (in float64) at least every unpicked one, up to the tolerance;
    the count is min(topk, n_keys)."""
    assert len(set(picked_tokens)) == len(picked_tokens) == min(TOPK, n_keys), "wrong number of picks"
    mask = np.zeros(n_keys, bool)
    mask[picked_tokens] = True
    if mask.all():
        return 0.0
    tol = LOGIT_TOL * (mag.max() + 1.0)
    gap = logits[~mask].max() - logits[mask].min()
    assert gap <= 2 * tol, f"selection is not a top-k: an unpicked key beats a picked one by {gap}"
    return max(gap, 0.0)


def ref_attention(q, latent_deq, scale):
    """out [heads, 512], lse [heads] of q [heads, 576] over the rows latent_deq [n, 576], and
    Σp|V|/Σp (the scale of rounding P to bf16 before P·V, which the kernel does as FlashMLA)."""
    qf = q.astype(np.float64)
    logits = qf @ latent_deq.T * scale
    m = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - m)
    den = p.sum(1, keepdims=True)
    return p @ latent_deq[:, :D_V] / den, np.log(p.sum(1)) + m[:, 0], p @ np.abs(latent_deq[:, :D_V]) / den


def dequant_v32(tokens):
    t = tokens.reshape(-1, 656)
    vals = t[:, :512].view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(-1, 4, 128)
    scales = np.ascontiguousarray(t[:, 512:528]).view(np.float32).reshape(-1, 4, 1)
    nope = (vals * scales).astype(ml_dtypes.bfloat16).astype(np.float64).reshape(-1, 512)
    return np.concatenate([nope, np.ascontiguousarray(t[:, 528:]).view(ml_dtypes.bfloat16).astype(np.float64)], 1)


class Check:
    def __init__(self):
        self.logit_err = self.out_err = self.lse_err = self.gap = 0.0
        self.rows = 0

    def row(self, cache, slots, q, out, lse, scale):
        deq = dequant_v32(cache.kv.reshape(-1, 656)[slots])
        ref_out, ref_lse, pv_abs = ref_attention(q, deq, scale)
        vmax = np.abs(deq[:, :D_V]).max()
        o = out.astype(np.float64)
        excess = np.abs(o - ref_out) - (OUT_ATOL * vmax + PV_ROUNDING * pv_abs + OUT_RTOL * np.abs(ref_out))
        assert excess.max() <= 0, f"attention out off by {np.abs(o - ref_out).max()}"
        mag = (np.abs(q.astype(np.float64)) @ np.abs(deq).T).max(1) * scale
        assert (np.abs(lse - ref_lse) <= LSE_TOL * (mag + 1)).all(), "lse off"
        self.out_err = max(self.out_err, float((np.abs(o - ref_out) / (vmax + 1e-30)).max()))
        self.lse_err = max(self.lse_err, float((np.abs(lse - ref_lse) / (mag + 1)).max()))
        self.rows += 1

    def logits(self, got, ref, mag):
        err = np.abs(got.astype(np.float64) - ref)
        assert (err <= LOGIT_TOL * (mag + np.abs(ref))).all(), f"indexer logits off by {err.max()}"
        self.logit_err = max(self.logit_err, float((err / (mag + np.abs(ref) + 1e-30)).max()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=8192, help="prompt tokens (default 8192)")
    ap.add_argument("--decode", type=int, default=32, help="decode steps (default 32)")
    ap.add_argument("--heads", type=int, default=128, help="MLA query heads per rank (128; 43 at TP 3)")
    ap.add_argument("--check-rows", type=int, default=16, help="prompt rows verified in float64 (default 16)")
    ap.add_argument("--chunk", type=int, default=512, help="prompt rows per prefill call (default 512)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if ml_dtypes is None:
        print("this example needs ml_dtypes", file=sys.stderr)
        return 2
    for name in ("prompt", "decode", "heads", "chunk"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    rng = np.random.default_rng(args.seed)
    layer = Layer(rng, args.heads)
    total = args.prompt + args.decode
    caches = Caches(rng, total)
    x = rng.standard_normal((total, HIDDEN)).astype(np.float32)
    scale = D_QK ** -0.5
    check = Check()
    print(f"attnkit {attnkit.__version__}, isa {attnkit.get_isa()}, {attnkit.get_num_threads()} threads; "
          f"DSA layer: {args.heads} heads x {D_QK}/{D_V}, indexer {IDX_HEADS} x {IDX_DIM}, top-{TOPK}, page {PAGE}")

    # --- prefill --------------------------------------------------------------------------
    P = args.prompt
    t_start = time.perf_counter()
    caches.write(0, *layer.keys(x[:P]))
    t_index = t_attn = t_check = 0.0
    check_rows = set(rng.choice(P, size=min(args.check_rows, P), replace=False).tolist()) | {P - 1}
    for r0 in range(0, P, args.chunk):
        r1 = min(P, r0 + args.chunk)
        qi, wts, q = layer.queries(x[r0:r1])   # this chunk's rows: indices below are r - r0
        ks = np.zeros(r1 - r0, np.int32)
        ke = np.arange(r0 + 1, r1 + 1, dtype=np.int32)           # causal: row t sees keys 0..t
        t0 = time.perf_counter()
        picked = dsa.fp8_mqa_topk(qi, (caches.k_fp8[:P], caches.k_scale[:P]), wts, ks, ke, TOPK)
        slots = np.where(picked >= 0, caches.slot(np.maximum(picked, 0)), -1).astype(np.int32)
        t1 = time.perf_counter()
        out, lse = dsa.flash_mla_with_kvcache(q[:, None], caches.kv, None, None, D_V, softmax_scale=scale,
                                              is_fp8_kvcache=True, indices=slots[:, None])
        t2 = time.perf_counter()
        t_index, t_attn = t_index + t1 - t0, t_attn + t2 - t1
        t_check0 = time.perf_counter()
        for r in sorted(check_rows & set(range(r0, r1))):
            i = r - r0
            ref, mag = ref_indexer(qi[i], wts[i], caches.k_fp8, caches.k_scale, r + 1)
            got = dsa.fp8_mqa_logits(qi[i:i + 1], (caches.k_fp8[:P], caches.k_scale[:P]), wts[i:i + 1],
                                     ks[:1], np.array([r + 1], np.int32))[0, :r + 1]
            check.logits(got, ref, mag)
            tokens = picked[i][picked[i] >= 0]
            check.gap = max(check.gap, check_selection(tokens, ref, mag, r + 1))
            check.row(caches, slots[i][slots[i] >= 0], q[i], out[i, 0], lse[i, :, 0], scale)
        t_check += time.perf_counter() - t_check0
    t_prefill = time.perf_counter() - t_start - t_check
    print(f"prefill {P} tokens: {t_prefill:.2f} s (indexer + top-k {t_index:.2f} s, sparse MLA {t_attn:.2f} s; "
          f"the rest projections and cache writes in numpy; float64 checks not counted)")

    # --- decode ---------------------------------------------------------------------------
    step_times = []
    for step in range(args.decode):
        t = P + step
        qi1, w1, q1 = layer.queries(x[t:t + 1])
        t0 = time.perf_counter()
        caches.write(t, *layer.keys(x[t:t + 1]))
        lens = np.array([[t + 1]], np.int32)
        logits = dsa.fp8_paged_mqa_logits(qi1[None], caches.index_k, w1, lens, caches.table[None], None, t + 1, True)
        slots = dsa.topk_page_table_transform(logits, caches.table[None], lens[:, 0], TOPK, page_size=PAGE)
        out, lse = dsa.flash_mla_with_kvcache(q1[None], caches.kv, None, None, D_V, softmax_scale=scale,
                                              is_fp8_kvcache=True, indices=slots[:, None])
        step_times.append(time.perf_counter() - t0)
        ref, mag = ref_indexer(qi1[0], w1[0], caches.k_fp8, caches.k_scale, t + 1)
        check.logits(logits[0], ref, mag)
        used = slots[0][slots[0] >= 0]
        tokens = np.array([np.where(caches.slot(np.arange(t + 1)) == s)[0][0] for s in used])
        check.gap = max(check.gap, check_selection(tokens, ref, mag, t + 1))
        check.row(caches, used, q1[0], out[0, 0], lse[0, :, 0], scale)
    med = sorted(step_times)[len(step_times) // 2]
    print(f"decode {args.decode} steps: median {med * 1e3:.2f} ms/step (min {min(step_times) * 1e3:.2f}, "
          f"max {max(step_times) * 1e3:.2f}); cache writes, indexer, top-k and sparse MLA included")
    print(f"verified against float64 on {check.rows} rows ({len(check_rows)} prompt, {args.decode} decode): "
          f"indexer logits rel. err {check.logit_err:.1e}, selection gap {check.gap:.1e}, "
          f"out err {check.out_err:.1e} x max|V|, lse err {check.lse_err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
