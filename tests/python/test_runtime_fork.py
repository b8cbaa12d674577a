"""fork() after the thread pool has started: the child's calls must complete (under a
timeout, since the failure mode is a hang) and match the parent's results bitwise."""

import multiprocessing
import os
import pickle
import select
import signal
import time

import numpy as np
import pytest

import attnkit
from conftest import randn
from reference import attention_ref

TIMEOUT_S = 60  # a hang is the failure; a healthy child answers in well under a second


def compute(threads=None):
    """A small causal GQA attention on fixed inputs, as raw bytes (compared bitwise)."""
    if threads is not None:
        attnkit.set_num_threads(threads)
    rng = np.random.default_rng(7)
    q, k, v = randn(rng, (2, 4, 97, 64)), randn(rng, (2, 2, 131, 64)), randn(rng, (2, 2, 131, 48))
    return attnkit.attention(q, k, v, causal=True, enable_gqa=True).tobytes()


@pytest.fixture
def pool_started():
    """Starts the pool with several threads in this process; yields the parent's result."""
    saved = attnkit.get_num_threads()
    attnkit.set_num_threads(max(3, saved))
    result = compute()  # the workers now exist in the parent
    rng = np.random.default_rng(7)
    q, k, v = randn(rng, (2, 4, 97, 64)), randn(rng, (2, 2, 131, 64)), randn(rng, (2, 2, 131, 48))
    np.testing.assert_allclose(np.frombuffer(result, np.float32).reshape(2, 4, 97, 48),
                               attention_ref(q, k, v, causal=True, enable_gqa=True)[0], atol=2e-5, rtol=0)
    yield result
    attnkit.set_num_threads(saved)


def run_in_fork(fn):
    """Runs fn() in an os.fork() child; returns its result or fails on a hang or a crash."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            os.close(read_fd)
            os.write(write_fd, pickle.dumps(fn()))
            os._exit(0)
        except BaseException:
            os._exit(1)
    os.close(write_fd)
    chunks, deadline = [], time.monotonic() + TIMEOUT_S
    while True:
        ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_fd)
            pytest.fail(f"the forked child hung (killed after {TIMEOUT_S} s)")
        chunk = os.read(read_fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child failed"
    return pickle.loads(b"".join(chunks))


def test_os_fork_child_computes_like_the_parent(pool_started):
    assert run_in_fork(compute) == pool_started


def test_set_num_threads_in_the_child(pool_started):
    # The child's pool is gone; changing its size must not wait for the parent's workers.
    assert run_in_fork(lambda: compute(threads=2)) == pool_started
    assert run_in_fork(lambda: compute(threads=1)) == pool_started


def test_fork_of_a_fork(pool_started):
    assert run_in_fork(lambda: run_in_fork(compute)) == pool_started


def test_multiprocessing_fork_pool(pool_started):
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        results = pool.map_async(compute, [None, 2, None, 1]).get(timeout=TIMEOUT_S)
    assert results == [pool_started] * 4
