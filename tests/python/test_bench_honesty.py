"""The benchmark tool cannot be fooled: a contender that writes nothing into the output
buffer the input set carries, or an attnkit output with NaN outside the verified subset,
fails verification; the window row counts only its visible pairs and a causal decode's
memory floor only the keys it can see."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from attnkit.bench.attention_op import AttentionOp, visible_pairs
from attnkit.bench.modifiers_op import window_pairs
from attnkit.bench.registry import Case


def run_patched(patch):
    """Runs the benchmark's CLI after `patch` (Python source) has changed a contender."""
    script = "import os\nos.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')\n" + textwrap.dedent(patch)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("contender", ["attnkit", "attnkit-loop"])
def test_contender_that_writes_nothing_fails(contender):
    res = run_patched(f"""
        from attnkit.bench import cli, serving_op
        contenders = serving_op.VarlenOp.contenders
        def patched(self, case):
            out, notes = contenders(self, case)
            for c in out:
                if c.name == {contender!r}:
                    c.run = lambda x: x.out  # the buffer the input set carries, unwritten
            return out, notes
        serving_op.VarlenOp.contenders = patched
        raise SystemExit(cli.main(["--op", "varlen", "--shape", "R,n=4,lo=16,hi=64", "--dtype", "fp32",
                                   "--threads", "1", "--budget", "0.2", "--no-progress"]))
    """)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"{contender}, 1 thread(s): FAILED" in res.stdout, res.stdout


def test_nan_outside_the_verified_subset_fails():
    res = run_patched("""
        import numpy as np
        from attnkit.bench import attention_op, cli
        contenders = attention_op.AttentionOp.contenders
        def patched(self, case):
            out, notes = contenders(self, case)
            run = out[0].run
            def with_nan(x):
                o = run(x)
                o[:, 1] = np.nan  # query head 1: not among the heads verify looks at
                return o
            out[0].run = with_nan
            return out, notes
        attention_op.AttentionOp.contenders = patched
        raise SystemExit(cli.main(["--op", "attention", "--shape", "B=1,H=4,S=64,D=64", "--dtype", "fp32",
                                   "--threads", "1", "--budget", "0.2", "--no-progress"]))
    """)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "non-finite values in the whole output" in res.stdout, res.stdout


@pytest.mark.parametrize("Sq,Skv,causal,left,right", [(64, 64, True, 10, 0), (50, 80, False, 7, 3),
                                                      (80, 50, True, 0, 0), (33, 33, False, -1, 5),
                                                      (40, 40, True, 100, 0), (40, 60, True, -1, -1),
                                                      (60, 40, False, -1, -1)])
def test_window_pairs_counts_visible_pairs(Sq, Skv, causal, left, right):
    s = AttentionOp().parse_shape(f"B=1,H=1,Sq={Sq},Skv={Skv},D=8" + (",causal" if causal else ""))
    seen = 0
    for i in range(Sq):
        a = i if causal else i + Skv - Sq  # causal=True is top-left; otherwise keys aligned bottom-right
        for j in range(Skv):
            ok = (not causal or j <= a) and (left < 0 or j >= a - left) and (right < 0 or j <= a + right)
            seen += ok
    assert window_pairs(s, left, right) == seen
    if left < 0 and right < 0:
        assert seen == visible_pairs(Sq, Skv, causal)


def test_causal_decode_floor_counts_the_keys_it_sees():
    op = AttentionOp()
    for causal, keys in ((True, 4), (False, 4096)):
        s = op.parse_shape("B=1,Hq=8,Hkv=8,Sq=4,Skv=4096,D=128" + (",causal" if causal else ""))
        counts = op.counts(Case(s, "bfloat16"))
        assert counts.mem_bytes == 8 * keys * 256 * 2
    assert np.isfinite(counts.flops)
