"""Indicative timing of attnkit.attention_backward at BENCH.md's shape A (B=1, Hq=32, Hkv=8,
S=2048, D=Dv=128, causal): the forward, the backward, and torch's CPU SDPA backward, medians.
Usage: python scripts/bench_attention_backward.py fp32,bf16 [noncausal]. A quick look without
verification: the verified, interleaved row is python -m attnkit.bench --op backward."""

import sys
import time

import numpy as np
import torch

import attnkit


def median_time(f, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main():
    B, Hq, Hkv, S, D = 1, 32, 8, 2048, 128
    causal = not (len(sys.argv) > 2 and sys.argv[2] == "noncausal")
    for name in (sys.argv[1] if len(sys.argv) > 1 else "fp32,bf16").split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(*shape, generator=g).to(dtype)
                   for shape in ((B, Hq, S, D), (B, Hkv, S, D), (B, Hkv, S, D)))
        out, lse = attnkit.attention(q, k, v, causal=causal, enable_gqa=True, return_lse=True)
        dout = torch.randn(out.shape, generator=g).to(dtype)
        fwd = median_time(lambda: attnkit.attention(q, k, v, causal=causal, enable_gqa=True), 3)
        bwd = median_time(lambda: attnkit.attention_backward(q, k, v, out, lse, dout, causal=causal,
                                                              enable_gqa=True), 3)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]

        def torch_backward():
            o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
            t = time.perf_counter()
            o.backward(dout)
            return time.perf_counter() - t

        peer = float(np.median([torch_backward() for _ in range(2)]))
        print(f"A {'causal' if causal else 'non-causal'} {name}: forward {fwd * 1e3:.0f} ms, backward "
              f"{bwd * 1e3:.0f} ms ({bwd / fwd:.2f}x forward), torch SDPA backward {peer * 1e3:.0f} ms "
              f"({peer / bwd:.2f}x attnkit's); threads {attnkit.get_num_threads()}", flush=True)


if __name__ == "__main__":
    main()
