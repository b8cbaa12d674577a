"""Peak memory above inputs + outputs for attention at S = 32768 (issue 3's workspace bound).

Usage: python bench/workspace_peak.py prefill|decode  (ru_maxrss growth across one call)."""
import resource, sys, numpy as np, ml_dtypes, attnkit
def rss_mib(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
rng = np.random.default_rng(0)
def randn(shape):  # filled in slices: no input-sized temporaries inflate the peak before the call
    x = np.empty(shape, dtype=ml_dtypes.bfloat16)
    flat = x.reshape(-1)
    for i in range(0, flat.size, 1 << 20):
        n = min(1 << 20, flat.size - i)
        flat[i:i + n] = rng.standard_normal(n, dtype=np.float32).astype(ml_dtypes.bfloat16)
    return x
S, D = 32768, 128
case = sys.argv[1]
if case == "prefill":   # B=1, Hq=4, Hkv=1 (GQA), causal, bf16
    q = randn((1, 4, S, D))
    k = randn((1, 1, S, D))
    v = randn((1, 1, S, D))
    kw = dict(causal=True, enable_gqa=True)
else:                   # decode: Sq = 1, Skv = S, Hq=32, Hkv=8 (KV split path)
    q = randn((1, 32, 1, D))
    k = randn((1, 8, S, D))
    v = randn((1, 8, S, D))
    kw = dict(enable_gqa=True)
out = np.empty(q.shape[:3] + (D,), dtype=ml_dtypes.bfloat16); lse = None
out[...] = 0; attnkit.get_num_threads()
before = rss_mib()
attnkit.attention(q, k, v, out=out, **kw)
after = rss_mib()
print(f"{case}: S={S} inputs+outputs {(q.nbytes+k.nbytes+v.nbytes+out.nbytes)/2**20:.1f} MiB, peak RSS growth during the call {after-before:.2f} MiB (threads={attnkit.get_num_threads()})")
