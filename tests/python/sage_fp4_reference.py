"""Numpy reference for SageAttention3's FP4 attention numerics ("mode fp4"), per docs/sage_fp4.md.

Everything here is plain numpy; nothing needs the attnkit extension or torch. Section numbers
(§n) refer to docs/sage_fp4.md, which cites the SageAttention3 sources each rule comes from.

Public functions
  round_e2m1(x)          RNE to E2M1 (±{0, .5, 1, 1.5, 2, 3, 4, 6}), saturating at ±6   (§1.1)
  round_e4m3(x)          RNE to E4M3 (OCP e4m3fn, max 448, min subnormal 2^-9),
                         saturating at ±448, NaN stays NaN                             (§1.2)
  round_bf16(x)          RNE to bfloat16 (used only by the io_dtype emulation)
  e2m1_encode(values)    E2M1 values -> 4-bit codes (sign bit 3, magnitude index 0..7)
  quantize_nvfp4(x, axis)    -> (values, scales): NVFP4 with SageAttention3's quantiser    (§1.3)
  dequantize(values, scales, axis)
  quantize_p_tile(s, row_max, scale_log2) -> (values, scales, p_tilde): SageAttention3's
                         two-level quantisation of one softmax tile                      (§3)
  sage3_attention_ref(q, k, v, causal=False, scale=None, ...)  the whole forward       (§2-§4)
"""

import numpy as np

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BLOCK = 16            # NVFP4 micro-block: 16 consecutive elements share one E4M3 scale
TILE_M = 128          # kBlockM (query rows per CTA tile)       launch.h: Flash_fwd_kernel_traits<D,128,128,...>
TILE_N = 128          # kBlockN (keys per online-softmax step)
PAD = 128             # api.py preprocess_qkv pads the sequence dims to multiples of 128
P_SCALE = 448.0 * 6.0  # 2688: softmax_fused.h fp8_scalexfp4_scale = 1/(448*6)


# ----------------------------------------------------------------------------------------
# element formats
# ----------------------------------------------------------------------------------------

def _rne_to_grid(a, min_exp, mant_bits):
    """Round non-negative finite float64 `a` to the nearest value of a binary float format
    with `mant_bits` fraction bits and minimum normal exponent `min_exp` (subnormals below),
    ties to even, no upper limit. Exact: every step is a power-of-two scaling in float64."""
    a = np.asarray(a, dtype=np.float64)
    _, e = np.frexp(a)                      # a = m * 2^e, m in [0.5, 1)  -> floor(log2 a) = e-1
    e = np.maximum(e - 1, min_exp)
    ulp = np.ldexp(1.0, e - mant_bits)
    return np.round(a / ulp) * ulp          # np.round: round half to even


def round_e2m1(x):
    """cvt.rn.satfinite.e2m1x2.f32 on values: round to nearest, ties to even, |x| > 6 -> ±6
    (±inf too). NaN has no E2M1 encoding; PTX's result for NaN is not pinned down (§1.1,
    open question), so NaN is propagated here."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), E2M1_MAX)     # satfinite (also maps inf to 6); NaN stays NaN
    with np.errstate(invalid="ignore"):
        r = np.minimum(_rne_to_grid(np.nan_to_num(a), 0, 1), E2M1_MAX)
    r = np.where(np.isnan(x), np.nan, r)
    return np.copysign(r, x)


def round_e4m3(x):
    """__nv_fp8_e4m3(float) / cvt.rn.satfinite.e4m3x2.f32 on values: OCP E4M3FN, round to
    nearest even, |x| >= 464 (and inf) -> ±448, |x| <= 2^-10 -> ±0, NaN -> NaN (§1.2)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), E4M3_MAX * 2)
    with np.errstate(invalid="ignore"):
        r = np.minimum(_rne_to_grid(np.nan_to_num(a), -6, 3), E4M3_MAX)
    r = np.where(np.isnan(x), np.nan, r)
    return np.copysign(r, x)


def round_bf16(x):
    """float -> bfloat16 (round to nearest even) -> float64. NaN/inf pass through."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    r = np.where(np.isnan(f), u, r).astype(np.uint32)
    return r.view(np.float32).astype(np.float64)


def round_f16(x):
    return np.asarray(x, dtype=np.float16).astype(np.float64)


def e2m1_encode(values):
    """E2M1 values (outputs of round_e2m1) -> uint8 4-bit codes: bit 3 = sign, bits 0-2 =
    index into E2M1_VALUES (0,.5,1,1.5,2,3,4,6)."""
    v = np.asarray(values, dtype=np.float64)
    idx = np.searchsorted(E2M1_VALUES, np.abs(v))
    if not np.array_equal(E2M1_VALUES[np.minimum(idx, 7)], np.abs(v)):
        raise ValueError("not E2M1 values")
    return (idx | np.where(np.signbit(v), 8, 0)).astype(np.uint8)


def e2m1_decode(codes):
    c = np.asarray(codes, dtype=np.uint8)
    v = E2M1_VALUES[c & 7]
    return np.where(c & 8, -v, v)


# ----------------------------------------------------------------------------------------
# NVFP4 quantiser for Q, K, V (fp4_quantization_4d.cu, scaled_fp4_quant*_kernel)
# ----------------------------------------------------------------------------------------

def _blocked(x, axis):
    """Move `axis` last and split it into (n_blocks, 16)."""
    x = np.moveaxis(np.asarray(x), axis, -1)
    n = x.shape[-1]
    if n % BLOCK:
        raise ValueError(f"quantised axis length {n} is not a multiple of {BLOCK}")
    return x.reshape(x.shape[:-1] + (n // BLOCK, BLOCK))


def _unblocked(xb, axis):
    x = xb.reshape(xb.shape[:-2] + (xb.shape[-2] * BLOCK,))
    return np.moveaxis(x, -1, axis)


def quantize_nvfp4(x, axis=-1, fp32=True):
    """NVFP4 quantisation exactly as SageAttention3's fp4quant_cuda kernels do it (§1.3).

    Blocks of 16 consecutive elements along `axis` (which must be a multiple of 16):
      amax  = max |x| over the block
      s     = E4M3(amax / 6)                (RNE, satfinite; no per-tensor FP32 scale)
      inv   = 0 if s == 0 else 1 / s
      value = E2M1(x * inv)                 (RNE, satfinite at ±6)
    With fp32=True (default) amax/6, 1/s and x*inv are rounded to float32 like the kernel
    (whose inputs are bf16/fp16, so x itself is exact in float32; x is cast to float32
    here). fp32=False does the same steps in float64.

    Returns (values, scales): values has x's shape and holds E2M1 values (float64, in
    ±{0,.5,...,6}; e2m1_encode gives the 4-bit codes); scales has x's shape with `axis`
    divided by 16 and holds the E4M3 block scales as float64. dequantize(values, scales,
    axis) == values * scale of each element's block.
    """
    ft = np.float32 if fp32 else np.float64
    xb = _blocked(np.asarray(x, dtype=ft), axis)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # amax ignores NaN like __hmax2 (which returns the non-NaN operand)
        amax = np.nanmax(np.abs(xb), axis=-1, initial=0.0).astype(ft)
        s = round_e4m3(amax / ft(6.0)).astype(ft)          # exact in float32
        inv = np.where(s == 0, ft(0.0), ft(1.0) / np.where(s == 0, ft(1.0), s)).astype(ft)
        y = (xb * inv[..., None]).astype(ft)
    values = round_e2m1(y.astype(np.float64))
    scales = s.astype(np.float64)
    values = _unblocked(values, axis)
    return values, np.moveaxis(scales, -1, axis)


def dequantize(values, scales, axis=-1):
    """values * (E4M3 scale of each element's 16-block along `axis`), float64."""
    vb = _blocked(np.asarray(values, dtype=np.float64), axis)
    sb = np.moveaxis(np.asarray(scales, dtype=np.float64), axis, -1)
    return _unblocked(vb * sb[..., None], axis)


def fake_quant_nvfp4(x, axis=-1, fp32=True):
    return dequantize(*quantize_nvfp4(x, axis, fp32), axis=axis)


# ----------------------------------------------------------------------------------------
# two-level quantisation of P (softmax_fused.h online_softmax_with_quant, mainloop quantize)
# ----------------------------------------------------------------------------------------

def quantize_p_tile(s, row_max, scale_log2):
    """SageAttention3's two-level quantisation of one score tile (§3).

    s:         raw scores of this tile, [..., rows, n], n a multiple of 16 (-inf = masked)
    row_max:   running row max *including* this tile, [..., rows] (raw score units)
    scale_log2: softmax_scale * log2(e)

    Level 1 (per row, folded into the exponent): P~ = 448*6 * exp2((s - row_max) * scale_log2),
      i.e. P~ in [0, 2688] with 2688 at the running row max.
    Level 2 (per 16 keys): sf = 448 * exp2((blockmax(s) - row_max) * scale_log2) = max(P~)/6,
      value = E2M1(P~ / sf) using the *unrounded* sf, stored scale = E4M3(sf).
    Returns (values, scales, p_tilde): E2M1 values [..., rows, n], E4M3 scales
    [..., rows, n/16], and the unquantised P~ (the kernel's row sum adds P~, not the
    dequantised values).
    """
    s = np.asarray(s, dtype=np.float64)
    m = np.asarray(row_max, dtype=np.float64)[..., None]
    with np.errstate(invalid="ignore"):
        p = P_SCALE * np.exp2((s - m) * scale_log2)
        p = np.where(np.isneginf(s), 0.0, p)
        sb = _blocked(s, -1)
        bmax = sb.max(axis=-1)
        sf = (E4M3_MAX * np.exp2((bmax - m) * scale_log2))
        sf = np.where(np.isneginf(bmax), 0.0, sf)
        pb = _blocked(p, -1)
        y = np.where(sf[..., None] > 0, pb / np.where(sf > 0, sf, 1.0)[..., None], 0.0)
    values = _unblocked(round_e2m1(y), -1)
    return values, round_e4m3(sf), p


# ----------------------------------------------------------------------------------------
# the whole forward
# ----------------------------------------------------------------------------------------

def _pad_seq(x, mult=PAD):
    n = x.shape[-2]
    pad = (-n) % mult
    if pad == 0:
        return x
    widths = [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)]
    return np.pad(x, widths)


def sage3_attention_ref(q, k, v, causal=False, scale=None, *, per_block_mean=True,
                        quant=True, io_dtype=None, kernel_quirks=False):
    """SageAttention3 (sageattn3_blackwell) forward, float64, inputs/outputs [B, H, S, D] (§2-§4).

    q: [B, H, Sq, D], k, v: [B, H, Sk, D] (MHA only, like the kernel; D = 64 or 128 in the
    kernel, any multiple of 16 here). Returns float64 [B, H, Sq, D].

    scale:  softmax scale; None -> D**-0.5, the only value sageattn3_blackwell uses.
    causal: bottom-right aligned causal mask (key j visible to query i iff j <= i + Sk - Sq).
    per_block_mean: Q smoothing by the mean of each 128-row block (True, the default of
        sageattn3_blackwell) or by the mean over all (padded) rows.
    quant:  False replaces every FP4 quantisation by identity (the same tiled online-softmax
        machinery in exact float64) - for testing the tiling itself.
    io_dtype: None (default) keeps preprocessing in float64. "bfloat16"/"float16" emulate the
        PyTorch preprocessing of a bf16/fp16 call: inputs, smoothed K, smoothed Q, the Q means,
        delta_s and the output are rounded to that dtype where the real code materialises
        them (§2.4; the Triton reduction order/precision is an assumption).
    kernel_quirks: True reproduces two behaviours of the published kernel that look like bugs
        (§4.3): causal masks use the 128-padded lengths, and in causal mode the P·V of the
        second key tile processed (the one after the diagonal tile) is dropped from O while
        its softmax terms stay in the row sum. Default False = the intended numerics.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if q.ndim != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError("expected q [B,H,Sq,D], k and v [B,H,Sk,D] with the same B, H, D")
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    if D % BLOCK:
        raise ValueError("head dim must be a multiple of 16")
    if scale is None:
        scale = D ** -0.5                  # api.py: softmax_scale = (packed_D * 2) ** -0.5
    scale_log2 = float(np.float32(scale * np.log2(np.e)))  # params.scale_softmax_log2 (float)

    rnd = {None: lambda a: a, "bfloat16": round_bf16, "float16": round_f16}[io_dtype]
    q, k, v = rnd(q), rnd(k), rnd(v)

    # §2.1 K smoothing: mean over the real tokens, before padding
    k = rnd(k - rnd(k.mean(axis=-2, keepdims=True)))
    q, k, v = _pad_seq(q), _pad_seq(k), _pad_seq(v)
    Sqp, Skp = q.shape[2], k.shape[2]
    # §2.2 Q smoothing: mean per 128-row block of the *padded* q (zero rows count)
    if per_block_mean:
        qb = q.reshape(B, H, Sqp // TILE_M, TILE_M, D)
        qm = qb.mean(axis=3)                                   # [B,H,Sqp/128,D]
        q = rnd(qb - qm[:, :, :, None, :]).reshape(B, H, Sqp, D)
        qm = rnd(qm)
    else:
        qm = rnd(q.mean(axis=-2, keepdims=True))               # [B,H,1,D]
        q = rnd(q - qm)
    delta_s = rnd(qm @ np.swapaxes(k, -1, -2))                 # [B,H,nq or 1,Skp]

    # §1.3 / §2.3 quantisation of Q, K (along D) and V (along tokens)
    if quant:
        qd = fake_quant_nvfp4(q, axis=-1)
        kd = fake_quant_nvfp4(k, axis=-1)
        vd = fake_quant_nvfp4(v, axis=-2)
    else:
        qd, kd, vd = q, k, v

    out = np.zeros((B, H, Sqp, D))
    n_tiles_k = Skp // TILE_N
    if kernel_quirks:
        off = Skp - Sqp                      # mainloop col_limit_causal uses padded lengths
    else:
        off = Sk - Sq
    cols_all = np.arange(Skp)
    for mb in range(Sqp // TILE_M):
        r0 = mb * TILE_M
        rows = r0 + np.arange(TILE_M)
        n_max = n_tiles_k
        if causal:
            n_max = min(n_max, -(-(r0 + TILE_M + off) // TILE_N))
        if n_max <= 0:
            continue                          # kernel writes 0 (store_zero)
        qt = qd[:, :, rows, :]
        ds = delta_s[:, :, mb if per_block_mean else 0, :]
        m = np.full((B, H, TILE_M), -np.inf)
        lsum = np.zeros((B, H, TILE_M))
        o = np.zeros((B, H, TILE_M, D))
        for step, nb in enumerate(range(n_max - 1, -1, -1)):      # key tiles in reverse order
            cols = nb * TILE_N + np.arange(TILE_N)
            s = ds[:, :, None, cols] + qt @ np.swapaxes(kd[:, :, cols, :], -1, -2)
            if causal:
                shift = TILE_N if (kernel_quirks and step == 1) else 0  # n_block - 1 quirk
                lim = rows[:, None] + off + shift
                s = np.where(cols[None, :] > lim, -np.inf, s)
                if not kernel_quirks:
                    s = np.where(cols[None, :] >= Sk, -np.inf, s)
            else:
                s = np.where(cols[None, :] >= Sk, -np.inf, s)   # padded keys
            m_new = np.maximum(m, s.max(axis=-1))
            if quant:
                pv, psf, pt = quantize_p_tile(s, m_new, scale_log2)
                pdq = dequantize(pv, psf, axis=-1)
            else:
                with np.errstate(invalid="ignore"):
                    pt = P_SCALE * np.exp2((s - m_new[..., None]) * scale_log2)
                pt = np.where(np.isneginf(s), 0.0, pt)
                pdq = pt
            with np.errstate(invalid="ignore"):
                alpha = np.where(np.isneginf(m), 0.0, np.exp2((m - m_new) * scale_log2))
            lsum = lsum * alpha + pt.sum(axis=-1)
            o_tile = pdq @ vd[:, :, cols, :]
            if kernel_quirks and causal and step == 1:
                pass                          # masking_step 0: rescale_o skipped, tile dropped
            else:
                o = o * alpha[..., None] + o_tile
            m = m_new
        with np.errstate(invalid="ignore", divide="ignore"):
            inv = np.where((lsum == 0) | np.isnan(lsum), 0.0, 1.0 / lsum)
        out[:, :, rows, :] = o * inv[..., None]
    return rnd(out[:, :, :Sq, :])


def attention_exact(q, k, v, causal=False, scale=None):
    """Plain float64 softmax attention, [B,H,S,D], bottom-right causal."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if causal:
        Sq, Sk = q.shape[2], k.shape[2]
        i = np.arange(Sq)[:, None]
        j = np.arange(Sk)[None, :]
        s = np.where(j > i + Sk - Sq, -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)      # rows with no visible key -> output 0
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    return (p / np.where(den == 0, 1.0, den)) @ v


def cosine_similarity(a, b):
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def relative_l1(a, ref):
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.abs(a - ref).sum() / np.abs(ref).sum())
