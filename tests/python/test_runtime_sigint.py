"""Ctrl-C during a long call: SIGINT sent 0.5 s into a call of several seconds must raise
KeyboardInterrupt within 0.3 s, and the process must keep computing correctly afterwards.
Each case runs in a fresh interpreter (the test sends it a real SIGINT)."""

import os
import signal
import subprocess
import sys
import time

import pytest

import attnkit

HERE = os.path.dirname(os.path.abspath(__file__))

# Sizes a call to take about 4 s here (Sq calibrated on a short call), makes its inputs,
# prints "ready", then runs it (no Python code that would see SIGINT is left around it);
# or ("waiting") runs it on another thread and a short call on the main thread.
# Prints the CLOCK_MONOTONIC times (comparable across processes on Linux) of the start and
# the end of the call, then checks a fresh call against the float64 reference.
CHILD = r"""
import sys, time
import numpy as np
sys.path.insert(0, HERE)
import attnkit
from reference import attention_ref
kind, threads = sys.argv[1], int(sys.argv[2])
attnkit.set_num_threads(threads)
rng = np.random.default_rng(0)
H, Skv, D = 4, 8192, 64
k = rng.standard_normal((1, H, Skv, D)).astype(np.float32)
v = rng.standard_normal((1, H, Skv, D)).astype(np.float32)
def call(q, out=None):
    if kind == "torch":
        import torch
        o = torch.from_numpy(out) if out is not None else None
        return attnkit.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), out=o)
    return attnkit.attention(q, k, v, out=out)
def queries(sq):
    return rng.standard_normal((1, H, sq, D)).astype(np.float32)
call(queries(96))  # warm-up, then calibration
q = queries(192)
t0 = time.monotonic(); call(q); t_cal = time.monotonic() - t0
q = queries(int(min(192 * 4.0 / t_cal, 400000)))
if kind == "waiting":  # the long call runs on another thread; this one waits for it
    import threading
    threading.Thread(target=call, args=(q,)).start()
    time.sleep(0.2)
    q = queries(5)
out = np.full(q.shape, np.nan, np.float32)
print("ready", flush=True)
t0 = time.monotonic()
try:
    call(q, out)
    print("finished", t0, time.monotonic(), flush=True)
except KeyboardInterrupt:
    print("interrupted", t0, time.monotonic(), np.isnan(out).any(), flush=True)
q = rng.standard_normal((1, H, 77, D)).astype(np.float32)
np.testing.assert_allclose(attnkit.attention(q, k[:, :, :300], v[:, :, :300]),
                           attention_ref(q, k[:, :, :300], v[:, :, :300])[0], atol=2e-5, rtol=0)
print("ok", flush=True)
""".replace("HERE", repr(HERE))


@pytest.mark.parametrize("kind", ["numpy", "torch", "waiting"])
@pytest.mark.parametrize("threads", [1, 2])
def test_sigint_interrupts_a_long_call(kind, threads):
    """kind "waiting": the main thread's call waits for another thread's long call."""
    if kind == "torch":
        pytest.importorskip("torch")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, kind, str(threads)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "ready", proc.stderr.read()
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    lines = [ln.split() for ln in rest.splitlines()]
    start, end = float(lines[0][1]), float(lines[0][2])
    assert lines[0][0] == "interrupted", f"the call ran to the end ({end - start:.2f} s) instead of stopping"
    latency = end - sent
    assert latency < 0.3, f"KeyboardInterrupt came {latency:.3f} s after SIGINT ({end - start:.2f} s into the call)"
    assert lines[0][3] == "True", "an interrupted call cannot have written all of out"
    assert lines[-1] == ["ok"]


FORKED_FROM_A_THREAD = r"""
import os, signal, threading, time
import numpy as np
import attnkit
big = np.random.default_rng(0).standard_normal((1, 8, 6144, 64)).astype(np.float32)
attnkit.attention(big[:, :, :64], big[:, :, :64], big[:, :, :64])
t0 = time.monotonic(); attnkit.attention(big, big, big); whole = time.monotonic() - t0
def child():
    threading.Thread(target=lambda: (time.sleep(0.05), os.kill(os.getpid(), signal.SIGINT)), daemon=True).start()
    t0 = time.monotonic()
    try:
        attnkit.attention(big, big, big)
        os.write(1, b"completed\n")
    except KeyboardInterrupt:
        os.write(1, f"interrupted {time.monotonic() - t0:.3f} of {whole:.3f}\n".encode())
    os._exit(0)
def fork_and_wait():
    pid = os.fork()
    if pid == 0:
        child()
    os.waitpid(pid, 0)
thread = threading.Thread(target=fork_and_wait)
thread.start()
thread.join()
"""


def test_sigint_in_a_child_forked_from_another_thread():
    """The forking thread is the child's main thread (as os.fork tells Python): its calls
    stop at Ctrl-C too (the binding kept the parent's main thread and installed no poll)."""
    res = subprocess.run([sys.executable, "-c", FORKED_FROM_A_THREAD], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    words = res.stdout.split()
    assert words[0] == "interrupted", res.stdout + res.stderr
    latency, whole = float(words[1]), float(words[3])
    assert latency < 0.05 + 0.3 and latency < whole, res.stdout
