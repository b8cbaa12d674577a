"""Property tests of the public Python API (issue 12): for every public op, with numpy and
torch inputs, any argument replaced by something wrong (lists, None, strings, bytes, 0-d
arrays, Python and numpy scalars, wrong dtypes and ranks, read-only or overlapping outputs,
non-finite or overflowing scalars, non-bool flags) gives a ValueError or TypeError with a
message, or a result; never a crash, never another exception class, and the inputs are
never modified. Read-only inputs and non-contiguous / reversed input views must work.

The cases are generated from a fixed seed and run in one worker subprocess per array kind
(so a crash fails the case in flight, which the worker names, instead of killing pytest);
each case is then its own test item, so that any the Python layer gets wrong can be marked
xfail(strict=True) with the fix it needs (KNOWN_WRONG).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("numpy", "torch")


# ---- the cases (built identically in pytest and in the worker)

def _ml():
    import ml_dtypes
    return ml_dtypes


def _rng():
    return np.random.default_rng(12)


def _arr(rng, shape, dtype="float32"):
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":
        return x.astype(_ml().bfloat16)
    if dtype == "float8_e4m3fn":
        return (x * 0.5).astype(_ml().float8_e4m3fn)
    return x.astype(dtype)


_TORCH_MEMO = {}


def _to_kind(x, kind):
    """x (numpy) as a torch tensor for kind "torch": sharing x's memory and strides where
    torch.from_numpy can (so views stay views and aliases stay aliases), else a copy."""
    if kind == "numpy" or not isinstance(x, np.ndarray):
        return x
    if id(x) in _TORCH_MEMO:
        return _TORCH_MEMO[id(x)][1]
    import torch
    ml = _ml()
    if x.dtype == ml.bfloat16:
        t = torch.from_numpy(np.ascontiguousarray(x).view(np.uint16).copy()).view(torch.bfloat16)
    elif x.dtype == ml.float8_e4m3fn:
        t = torch.from_numpy(np.ascontiguousarray(x).view(np.uint8).copy()).view(torch.float8_e4m3fn)
    elif not x.flags.writeable or any(st < 0 for st in x.strides):
        t = torch.from_numpy(x.copy())
    else:
        t = torch.from_numpy(x)
    _TORCH_MEMO[id(x)] = (x, t)  # keeps x alive so its id stays unique
    return t


def _bad_arrays(rng, x):
    """Wrong things in place of array x (numpy), keyed by a short label."""
    return {
        "list": x.astype(np.float32).tolist(),
        "None": None,
        "str": "abc",
        "bytes": b"\x00" * 16,
        "int": 3,
        "float": 1.5,
        "np_float32": np.float32(1.0),
        "zero_d": np.array(1.0, dtype=np.float32),
        "float64": x.astype(np.float64),
        "int64": np.ones(x.shape, dtype=np.int64),
        "rank_minus_1": np.ones(x.shape[:-1], dtype=np.float32),
        "dict": {"a": 1},
    }


def _bad_scalars():
    """Wrong (or odd) values for a float scalar argument."""
    return {"str": "0.5", "list": [0.5], "nan": float("nan"), "inf": float("inf"), "huge_int": 10**400,
            "1e39": 1e39, "np_float64": np.float64(0.5), "np_float32": np.float32(0.5), "bool": True,
            "complex": 1j, "np_array1": np.array([0.5]), "None": None}


def _bad_flags():
    return {"str_yes": "yes", "int_1": 1, "int_2": 2, "np_bool": np.bool_(True), "None": None, "list": [True],
            "float": 1.0}


def attention_cases(kind):
    rng = _rng()
    q, k, v = _arr(rng, (1, 4, 5, 8)), _arr(rng, (1, 2, 7, 8)), _arr(rng, (1, 2, 7, 8))
    base = dict(q=q, k=k, v=v, enable_gqa=True)
    cases = {"valid": base}
    for name, x in (("q", q), ("k", k), ("v", v)):
        for label, bad in _bad_arrays(rng, x).items():
            cases[f"{name}={label}"] = {**base, name: bad}
        ro = x.copy()
        ro.setflags(write=False)
        cases[f"{name}=read_only"] = {**base, name: ro}
        big = np.zeros((x.shape[0], x.shape[1], x.shape[2] * 2 + 1, x.shape[3] + 3), dtype=x.dtype)
        view = big[:, :, 1::2, 2:-1]
        view[...] = x
        cases[f"{name}=strided_view"] = {**base, name: view}
        if kind == "numpy":
            cases[f"{name}=reversed_view"] = {**base, name: x[:, :, ::-1]}
    for label, bad in _bad_arrays(rng, np.ones((1, 4, 5, 7), np.float32)).items():
        cases[f"attn_mask={label}"] = {**base, "attn_mask": bad} if label != "None" else None
    cases["attn_mask=int32"] = {**base, "attn_mask": np.ones((5, 7), dtype=np.int32)}
    out = np.zeros((1, 4, 5, 8), np.float32)
    ro_out = out.copy()
    ro_out.setflags(write=False)
    cases["out=read_only"] = {**base, "out": ro_out}
    cases["out=wrong_dtype"] = {**base, "out": np.zeros((1, 4, 5, 8), np.float16)}
    cases["out=wrong_shape"] = {**base, "out": np.zeros((1, 4, 5, 9), np.float32)}
    cases["out=list"] = {**base, "out": out.tolist()}
    cases["out=broadcast"] = {**base, "out": np.broadcast_to(np.zeros(8, np.float32), (1, 4, 5, 8))}
    cases["out=aliases_q"] = {**base, "out": q}
    for label, bad in _bad_scalars().items():
        cases[f"scale={label}"] = {**base, "scale": bad}
    for label, bad in {"neg": -0.1, "one": 1.0, "str": "0.1", "nan": float("nan"), "None": None,
                       "np_float64": np.float64(0.1), "huge_int": 10**400}.items():
        cases[f"dropout_p={label}"] = {**base, "dropout_p": bad}
    for label, bad in {"neg": -1, "2**64": 2**64, "float": 1.5, "str": "1", "np_int64": np.int64(3)}.items():
        cases[f"seed={label}"] = {**base, "dropout_p": 0.1, "seed": bad}
    for label, bad in {"str": "yes", "int_2": 2, "np_bool": np.bool_(True), "list": [True]}.items():
        cases[f"causal={label}"] = {**base, "causal": bad}
    for label, bad in _bad_flags().items():
        cases[f"enable_gqa={label}"] = {**base, "enable_gqa": bad}
        cases[f"return_lse={label}"] = {**base, "return_lse": bad}
    for label, bad in {"lower": "bhsd", "None": None, "int": 1}.items():
        cases[f"layout={label}"] = {**base, "layout": bad}
    return {k: v for k, v in cases.items() if v is not None}


def sage_cases(kind):
    rng = _rng()
    q, k, v = _arr(rng, (1, 2, 5, 16)), _arr(rng, (1, 2, 9, 16)), _arr(rng, (1, 2, 9, 16))
    base = dict(q=q, k=k, v=v)
    cases = {"valid": base, "valid_fp4": {**base, "mode": "fp4"}}
    for name, x in (("q", q), ("k", k), ("v", v)):
        for label, bad in _bad_arrays(rng, x).items():
            cases[f"{name}={label}"] = {**base, name: bad}
        ro = x.copy()
        ro.setflags(write=False)
        cases[f"{name}=read_only"] = {**base, name: ro}
    cases["q=nan"] = {**base, "q": np.full_like(q, np.nan)}
    cases["k=inf"] = {**base, "k": np.full_like(k, np.inf)}
    for label, bad in _bad_scalars().items():
        cases[f"scale={label}"] = {**base, "scale": bad}
    for label, bad in {"int4": "int4", "None": None, "int": 8}.items():
        cases[f"mode={label}"] = {**base, "mode": bad}
    for label, bad in {"str": "yes", "int_2": 2}.items():
        cases[f"causal={label}"] = {**base, "causal": bad}
    for label, bad in _bad_flags().items():
        cases[f"return_lse={label}"] = {**base, "return_lse": bad}
    return cases


def sparse_cases(kind, strict):
    rng = _rng()
    if strict:
        s_q, h_q, d_qk, topk, dtype = 2, 64, 512, 128, "float8_e4m3fn"
    else:
        s_q, h_q, d_qk, topk, dtype = 2, 3, 16, 4, "bfloat16"
    s_kv = 9
    q, kv = _arr(rng, (s_q, h_q, d_qk), dtype), _arr(rng, (s_kv, 1, d_qk), dtype)
    indices = rng.integers(-1, s_kv, size=(s_q, 1, topk)).astype(np.int32)
    q_scale, kv_scale = np.array([0.5], np.float32), np.array([0.25], np.float32)
    d_v = 512 if strict else 8
    base = dict(q=q, kv=kv, indices=indices, sm_scale=0.1, d_v=d_v, q_scale=q_scale, kv_scale=kv_scale)
    cases = {"valid": base}
    cases["valid_sink"] = {**base, "attn_sink": _arr(rng, (h_q,)),
                           "topk_length": np.array([topk, 1], np.int32)}
    for name, x in (("q", q), ("kv", kv), ("indices", indices), ("q_scale", q_scale), ("kv_scale", kv_scale)):
        for label, bad in _bad_arrays(rng, x.astype(np.float32)).items():
            if label == "None" and name in ("q_scale", "kv_scale") and not strict:
                continue  # optional for bf16
            cases[f"{name}={label}"] = {**base, name: bad}
        ro = x.copy()
        ro.setflags(write=False)
        cases[f"{name}=read_only"] = {**base, name: ro}
    bad_idx = indices.copy()
    bad_idx[0, 0, :2] = [np.iinfo(np.int32).min, np.iinfo(np.int32).max]
    cases["indices=int_extremes"] = {**base, "indices": bad_idx}
    cases["indices=int64"] = {**base, "indices": indices.astype(np.int64)}
    for label, bad in {"nan": np.array([np.nan], np.float32), "inf": np.array([np.inf], np.float32),
                       "zero": np.array([0.0], np.float32), "neg": np.array([-1.0], np.float32),
                       "two_elems": np.array([1.0, 2.0], np.float32), "float64": np.array([0.5])}.items():
        cases[f"q_scale={label}_array"] = {**base, "q_scale": bad}
    for label, bad in _bad_scalars().items():
        cases[f"sm_scale={label}"] = {**base, "sm_scale": bad}
    for label, bad in {"zero": 0, "too_big": d_qk + 1, "float": 8.0, "str": "8", "None": None,
                       "np_int64": np.int64(d_v), "huge": 10**400}.items():
        cases[f"d_v={label}"] = {**base, "d_v": bad}
    for label, bad in {"neg": np.array([-1, 0], np.int32), "too_long": np.array([topk + 1, 0], np.int32),
                       "int_min": np.array([np.iinfo(np.int32).min, 0], np.int32), "list": [1, 1],
                       "float": np.array([1.0, 1.0], np.float32)}.items():
        cases[f"topk_length={label}"] = {**base, "topk_length": bad}
    for label, bad in {"nan": np.full(h_q, np.nan, np.float32), "wrong_len": np.zeros(h_q + 1, np.float32),
                       "list": [0.0] * h_q}.items():
        cases[f"attn_sink={label}"] = {**base, "attn_sink": bad, "topk_length": np.array([1, 1], np.int32)}
    ro_out = np.zeros((s_q, h_q, d_v), _ml().bfloat16)
    ro_out.setflags(write=False)
    cases["out=read_only"] = {**base, "out": ro_out}
    cases["out=wrong_dtype"] = {**base, "out": np.zeros((s_q, h_q, d_v), np.float32)}
    cases["lse=strided"] = {**base, "lse": np.zeros((s_q, 2 * h_q), np.float32)[:, ::2]}
    return cases


def pad_cases(kind):
    rng = _rng()
    x = _arr(rng, (2, 3, 4))
    cases = {"pad_valid": ("pad", dict(x=x, multiple=4)), "unpad_valid": ("unpad", dict(x=x, h=2))}
    for label, bad in _bad_arrays(rng, x).items():
        cases[f"pad_x={label}"] = ("pad", dict(x=bad, multiple=4))
        cases[f"unpad_x={label}"] = ("unpad", dict(x=bad, h=2))
    for label, bad in {"zero": 0, "neg": -1, "float": 4.0, "str": "4", "None": None, "np_int": np.int64(4)}.items():
        cases[f"pad_multiple={label}"] = ("pad", dict(x=x, multiple=bad))
        cases[f"unpad_h={label}"] = ("unpad", dict(x=x, h=bad))
    for label, bad in {"out_of_range": 3, "str": "1", "float": 1.0}.items():
        cases[f"pad_dim={label}"] = ("pad", dict(x=x, multiple=4, dim=bad))
    return cases


def runtime_cases(kind):
    cases = {}
    for label, bad in {"str": "2", "float": 2.0, "None": None, "zero": 0, "neg": -1, "bool": True,
                       "huge": 10**20, "np_int": np.int64(2)}.items():
        cases[f"set_num_threads={label}"] = ("set_num_threads", bad)
    for label, bad in {"unknown": "avx9", "None": None, "int": 3, "empty": ""}.items():
        cases[f"set_isa={label}"] = ("set_isa", bad)
    return cases


def all_cases(kind):
    """{case id: (op name, payload)}."""
    out = {}
    for cid, kw in attention_cases(kind).items():
        out[f"attention[{cid}]"] = ("attention", kw)
    for cid, kw in sage_cases(kind).items():
        out[f"sage_attention[{cid}]"] = ("sage_attention", kw)
    for strict in (False, True):
        op = "sparse_mla_q8kv8_prefill_fwd" if strict else "sparse_mla_prefill_fwd"
        for cid, kw in sparse_cases(kind, strict).items():
            out[f"{op}[{cid}]"] = (op, kw)
    for cid, (op, kw) in pad_cases(kind).items():
        out[f"{op}_heads[{cid}]"] = (op + "_heads", kw)
    if kind == "numpy":  # no arrays: once is enough
        for cid, (op, arg) in runtime_cases(kind).items():
            out[cid] = (op, arg)
    return out


# ---- the worker: runs every case of one kind, one JSON line per case

def _snapshot(x):
    if isinstance(x, np.ndarray):
        return ("np", x.dtype.str, x.shape, x.tobytes())
    if type(x).__module__.startswith("torch"):
        return ("torch", str(x.dtype), tuple(x.shape), x.detach().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return None


def _run_case(kind, op, payload):
    import attnkit
    if op in ("set_num_threads", "set_isa"):
        saved = (attnkit.get_num_threads(), attnkit.get_isa())
        try:
            getattr(attnkit, op)(payload)
        finally:
            attnkit.set_num_threads(saved[0])
            attnkit.set_isa(saved[1])
        return []
    kw = {name: _to_kind(x, kind) for name, x in payload.items()}
    args = []
    if op == "pad_heads" or op == "unpad_heads":
        x = kw.pop("x")
        args = [x]
    before = {name: _snapshot(x) for name, x in kw.items() if name != "out"}
    before.update({f"arg{i}": _snapshot(x) for i, x in enumerate(args)})
    try:
        if op == "sparse_mla_q8kv8_prefill_fwd":
            q, kv, idx, sm, qs, ks = (kw.pop(n) for n in ("q", "kv", "indices", "sm_scale", "q_scale", "kv_scale"))
            getattr(attnkit, op)(q, kv, idx, sm, qs, ks, **kw)
            kw.update(q=q, kv=kv, indices=idx, sm_scale=sm, q_scale=qs, kv_scale=ks)
        elif op == "sparse_mla_prefill_fwd":
            q, kv, idx, sm = (kw.pop(n) for n in ("q", "kv", "indices", "sm_scale"))
            getattr(attnkit, op)(q, kv, idx, sm, **kw)
            kw.update(q=q, kv=kv, indices=idx, sm_scale=sm)
        elif op in ("pad_heads", "unpad_heads"):
            getattr(attnkit, op)(*args, **kw)
        else:
            q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
            getattr(attnkit, op)(q, k, v, **kw)
            kw.update(q=q, k=k, v=v)
    finally:
        pass
    return [name for name, snap in before.items() if snap is not None and
            _snapshot(kw.get(name, args[int(name[3:])] if name.startswith("arg") else None)) != snap]


def _worker(kind):
    if kind == "torch":
        import torch  # noqa: F401  (before attnkit sees a tensor)
    for cid, (op, payload) in all_cases(kind).items():
        print(json.dumps({"start": cid}), flush=True)
        result = {"case": cid}
        try:
            mutated = _run_case(kind, op, payload)
            result["outcome"] = "ok"
            result["mutated"] = mutated
        except (ValueError, TypeError) as e:
            result["outcome"] = type(e).__name__
            result["message"] = str(e)
            result["mutated"] = []
        except BaseException as e:  # noqa: BLE001  (the class is what is checked)
            result["outcome"] = "other:" + type(e).__name__
            result["message"] = str(e)[:300]
            result["mutated"] = []
        print(json.dumps(result), flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2])


# ---- pytest side

_results = {}


def _results_for(kind):
    if kind not in _results:
        if kind == "torch":
            pytest.importorskip("torch")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", kind], capture_output=True,
                              text=True, timeout=600, cwd="/")
        got, in_flight = {}, None
        for line in proc.stdout.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "start" in rec:
                in_flight = rec["start"]
            else:
                got[rec["case"]] = rec
                in_flight = None
        if in_flight is not None or proc.returncode != 0:
            crash = {"outcome": f"crash (exit code {proc.returncode}) in this case",
                     "message": proc.stderr[-2000:], "mutated": []}
            if in_flight is not None:
                got[in_flight] = {"case": in_flight, **crash}
        _results[kind] = got
    return _results[kind]


# Cases the Python layer gets wrong today, with the Python-side fix each needs (owned by
# the argument-parsing work in python/attnkit/ops.py, _arrays.py, _torch_ops.py).
# Empty since the merge of the Python argument-parsing fixes (integ): before them, 10**400
# as scale/dropout_p/sm_scale raised OverflowError and non-bool enable_gqa/return_lse were
# taken by truthiness (torch: RuntimeError from the op schema), 32 cases in all.
KNOWN_WRONG = {}


def _case_params():
    params = []
    for kind in KINDS:
        for cid in all_cases(kind):
            marks = []
            reason = KNOWN_WRONG.get((kind, cid))
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            params.append(pytest.param(kind, cid, id=f"{kind}-{cid}", marks=marks))
    return params


def _expected_ok(kind, cid):
    """Cases that must succeed (any other case may also raise a ValueError/TypeError)."""
    valid = ("[valid]", "[valid_fp4]", "[valid_sink]", "_valid]", "indices=int_extremes]")
    views = ("=strided_view]", "=reversed_view]")
    return (any(cid.endswith(v) for v in valid) or any(v in cid for v in views)
            or ("=read_only]" in cid and "out=" not in cid))


def _expected_error(kind, cid):
    """Cases that must raise (a ValueError or TypeError)."""
    op, _, rest = cid.partition("[")
    arg, _, label = rest.rstrip("]").partition("=")
    if kind == "torch" and arg == "out" and label in ("read_only", "broadcast"):
        return False  # torch has no read-only tensors; the broadcast view became a copy
    data = arg in ("q", "k", "v", "kv", "indices")
    scalar_scale = arg in ("q_scale", "kv_scale") and op == "sparse_mla_prefill_fwd"
    if (arg, label) in (("attn_mask", "None"), ("attn_mask", "zero_d"), ("d_v", "None"), ("mode", "None")):
        return False
    if arg == "scale" and label == "None" or scalar_scale and label in ("None", "int", "float", "zero_d",
                                                                         "rank_minus_1"):
        return False  # optional, or documented forms of a scale
    if label in ("nan", "inf") and (op == "sage_attention" or arg == "attn_sink"):
        return False  # non-finite data is valid input
    always = ("list", "None", "str", "bytes", "dict", "nan", "inf", "huge_int", "1e39", "str_yes", "complex",
              "too_big", "wrong_len", "unknown", "empty", "out_of_range")
    if label in always:
        return True
    if data and label in ("zero_d", "rank_minus_1", "int64", "float64", "int", "float", "np_float32"):
        return True
    if arg == "attn_mask" and label in ("int64", "float64", "int32", "rank_minus_1"):
        return True
    if arg in ("q_scale", "kv_scale") and label in ("int64", "float64", "nan_array", "inf_array", "two_elems_array",
                                                    "float64_array"):
        return True
    if arg == "out" or arg == "lse":
        return True  # every out= / lse= case here is invalid
    if arg in ("layout",) or (arg, label) in (("mode", "int4"), ("mode", "int"), ("dropout_p", "neg"),
                                              ("dropout_p", "one"), ("seed", "neg"), ("seed", "2**64"),
                                              ("seed", "float"), ("d_v", "zero"), ("d_v", "float"),
                                              ("pad_multiple", "zero"), ("pad_multiple", "neg"),
                                              ("pad_multiple", "float"), ("unpad_h", "neg"), ("unpad_h", "float"),
                                              ("pad_dim", "float"), ("attn_sink", "list")):
        return True
    if arg in ("enable_gqa", "return_lse") and label in ("list", "float", "None", "int_1", "int_2"):
        return True  # non-bool flags
    if op == "sparse_mla_q8kv8_prefill_fwd" and arg == "topk_length" and label in ("neg", "too_long", "int_min"):
        return True
    if op == "sparse_mla_q8kv8_prefill_fwd" and arg in ("q_scale", "kv_scale") and label in ("int", "float"):
        return True
    return False


@pytest.mark.parametrize("kind, cid", _case_params())
def test_bad_arguments_raise_cleanly(kind, cid):
    rec = _results_for(kind).get(cid)
    assert rec is not None, f"{cid}: not run (the worker stopped before it)"
    outcome, message = rec["outcome"], rec.get("message", "")
    assert not outcome.startswith("crash"), f"{cid}: {outcome}\n{message}"
    assert not rec["mutated"], f"{cid}: modified input(s) {rec['mutated']}"
    assert outcome in ("ok", "ValueError", "TypeError"), f"{cid}: raised {outcome}: {message}"
    if outcome != "ok":
        assert message.strip(), f"{cid}: {outcome} without a message"
    if _expected_ok(kind, cid):
        assert outcome == "ok", f"{cid}: a valid call raised {outcome}: {message}"
    if _expected_error(kind, cid):
        assert outcome != "ok", f"{cid}: accepted"
