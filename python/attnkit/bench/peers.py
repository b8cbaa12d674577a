"""Optional dense-attention peers: OpenVINO's ScaledDotProductAttention and ONNX Runtime's
Attention (opset 23), each when installed (``pip install attnkit[peers]``), verified like
every contender before it is timed.

- OpenVINO: the opset-13 SDPA op on the CPU plugin, one compiled model per thread count
  (INFERENCE_NUM_THREADS), f32 or bf16 tensors in and out (INFERENCE_PRECISION_HINT to match).
  Its SDPA takes K and V with as many heads as Q, so for GQA they are repeated per query
  head once per input set, before timing (not timed).
- ONNX Runtime: the ai.onnx Attention op (opset 23: q_num_heads / kv_num_heads take GQA
  as is), CPU execution provider, one session per thread count (intra_op_num_threads, no
  spinning between calls: spinning threads would take the cores from the next contender).
  It has no bf16 kernels on the CPU: bf16 cases run it on float16 copies of the inputs (made
  once per input set, not timed; exact for these values), named "onnxruntime-fp16".
Inputs are converted in Contender.prepare_inputs, which the runner calls for every input set
before timing.
"""

from __future__ import annotations

import numpy as np

from .registry import Contender

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None


def _module(name):
    """The module if it imports, else None (a broken install counts as none)."""
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001
        return None


def openvino_contender(s, dtype: str, notes: list) -> list:
    """OpenVINO SDPA on the case (a list of 0 or 1); appends why it is skipped to `notes`."""
    ov = _module("openvino")
    if ov is None:
        notes.append("openvino: skipped (not installed; pip install attnkit[peers])")
        return []
    if dtype not in ("float32", "bfloat16"):
        notes.append(f"openvino: skipped for {dtype} (run for float32 and bfloat16)")
        return []
    if s.causal and s.Sq != s.Skv:
        notes.append("openvino: skipped (causal with Sq != Skv: its mask alignment is not torch's top-left)")
        return []
    from openvino import opset13

    et = ov.Type.f32 if dtype == "float32" else ov.Type.bf16
    params = [opset13.parameter([s.B, s.Hq, sq, d], et) for sq, d in ((s.Sq, s.D), (s.Skv, s.D), (s.Skv, s.Dv))]
    model = ov.Model([opset13.scaled_dot_product_attention(*params, causal=s.causal)], params)
    core = ov.Core()
    state = {}
    group = s.Hq // s.Hkv

    def set_threads(n):
        compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": n,
                                                     "INFERENCE_PRECISION_HINT": "f32" if dtype == "float32" else "bf16"})
        state["request"] = compiled.create_infer_request()

    def tensor(a):
        if dtype == "float32":
            return ov.Tensor(np.ascontiguousarray(a))
        t = ov.Tensor(ov.Type.bf16, list(a.shape))
        t.data.view(np.uint16)[...] = np.ascontiguousarray(a).view(np.uint16)
        return t

    def prepare_inputs(x):
        if not hasattr(x, "openvino"):
            x.openvino = [tensor(x.q), tensor(np.repeat(x.k, group, axis=1)), tensor(np.repeat(x.v, group, axis=1))]

    def run(x):
        request = state["request"]
        request.infer(x.openvino)
        out = request.get_output_tensor(0).data
        return out if dtype == "float32" else out.view(np.uint16).view(ml_dtypes.bfloat16)

    note = f"openvino {ov.__version__.split('-')[0]} SDPA" + (", K/V repeated for GQA (untimed)" if s.gqa else "")
    if dtype == "bfloat16":
        # Its bf16 SDPA errs up to ~1.5x torch's against float64 (max and 99.99th percentile,
        # measured on A): it passes the float64 check, but the full-output comparison with
        # attnkit at the peers' tolerance fails on a few values in a million.
        notes.append("openvino bfloat16: checked against the float64 reference only (not against attnkit's "
                     "full output: its bf16 SDPA errs ~1.5x more than torch's)")
    return [Contender("openvino", "peer", run, set_threads=set_threads, note=note, prepare_inputs=prepare_inputs,
                      compare_to="" if dtype == "bfloat16" else None)]


def onnxruntime_contender(s, dtype: str, notes: list) -> list:
    """ONNX Runtime Attention-23 on the case (a list of 0 or 1); appends why it is skipped."""
    ort, onnx = _module("onnxruntime"), _module("onnx")
    if ort is None or onnx is None:
        notes.append("onnxruntime: skipped (onnxruntime and onnx not installed; pip install attnkit[peers])")
        return []
    if s.causal and s.Sq != s.Skv:
        notes.append("onnxruntime: skipped (causal with Sq != Skv: its mask alignment is not torch's top-left)")
        return []
    from onnx import TensorProto, helper

    run_dtype = np.float32 if dtype == "float32" else np.float16  # float16 for bfloat16 and float16
    elem = TensorProto.FLOAT if dtype == "float32" else TensorProto.FLOAT16
    shapes = {"Q": [s.B, s.Hq, s.Sq, s.D], "K": [s.B, s.Hkv, s.Skv, s.D], "V": [s.B, s.Hkv, s.Skv, s.Dv]}
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=int(s.causal), q_num_heads=s.Hq,
                            kv_num_heads=s.Hkv)
    graph = helper.make_graph([node], "attention", [helper.make_tensor_value_info(n, elem, d) for n, d in shapes.items()],
                              [helper.make_tensor_value_info("Y", elem, [s.B, s.Hq, s.Sq, s.Dv])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    serialized = model.SerializeToString()
    state = {}

    def set_threads(n):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = n, 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        state["session"] = ort.InferenceSession(serialized, opts, providers=["CPUExecutionProvider"])

    def prepare_inputs(x):
        if not hasattr(x, "onnxruntime"):
            x.onnxruntime = {n: np.ascontiguousarray(a.astype(run_dtype)) for n, a in zip("QKV", (x.q, x.k, x.v))}

    def run(x):
        return state["session"].run(None, x.onnxruntime)[0]

    cast = dtype == "bfloat16"
    name = "onnxruntime-fp16" if cast else "onnxruntime"
    note = f"onnxruntime {ort.__version__} Attention-23" + (", float16 copies (no bf16 CPU kernels)" if cast else "")
    return [Contender(name, "peer", run, set_threads=set_threads, note=note, prepare_inputs=prepare_inputs)]
