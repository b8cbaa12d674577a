"""ATTNKIT_NUM_THREADS and ATTNKIT_ISA, each in a fresh interpreter: a bad value is reported
once on stderr (naming the variable, the value and what is used instead) and attnkit keeps
working with that fallback; a good value (or an empty one, meaning unset) is taken silently."""

import os
import subprocess
import sys

import pytest

import attnkit

# Imports attnkit, runs a few ops, prints the settings in use.
PROBE = """
import numpy as np, attnkit
x = np.random.default_rng(0).standard_normal((1, 2, 33, 16)).astype(np.float32)
for _ in range(3):
    out = attnkit.attention(x, x, x, causal=True)
assert np.isfinite(out).all()
attnkit.set_num_threads(attnkit.get_num_threads())
print(attnkit.get_num_threads(), attnkit.get_isa())
"""


def probe(**env):
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("ATTNKIT_NUM_THREADS", "ATTNKIT_ISA", "ATTNKIT_READ_AHEAD")}
    full_env.update(env)
    r = subprocess.run([sys.executable, "-c", PROBE], env=full_env, capture_output=True, text=True,
                       timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    threads, isa = r.stdout.split()
    return int(threads), isa, r.stderr


@pytest.fixture(scope="module")
def defaults():
    threads, isa, err = probe()
    assert err == ""
    return threads, isa


@pytest.mark.parametrize("value", ["abc", "0", "-5", "4x", " ", "1e3", "2000", "99999999999999999999"])
def test_bad_num_threads_warns_once_and_uses_the_default(value, defaults):
    threads, isa, err = probe(ATTNKIT_NUM_THREADS=value)
    assert (threads, isa) == defaults
    assert err.count("ATTNKIT_NUM_THREADS") == 1, err
    assert f'ATTNKIT_NUM_THREADS="{value}"' in err and "[1, 1024]" in err, err
    assert f"using {defaults[0]}" in err, err


def test_empty_values_mean_unset(defaults):
    threads, isa, err = probe(ATTNKIT_NUM_THREADS="", ATTNKIT_ISA="")
    assert (threads, isa) == defaults and err == ""


def test_good_num_threads_is_taken_silently():
    threads, _, err = probe(ATTNKIT_NUM_THREADS="3")
    assert threads == 3 and err == ""


@pytest.mark.parametrize("value", ["avx9", "AVX2 ", " "])
def test_unknown_isa_warns_once_and_uses_the_best(value, defaults):
    threads, isa, err = probe(ATTNKIT_ISA=value)
    assert (threads, isa) == defaults
    assert err.count("ATTNKIT_ISA") == 1, err
    assert f'ATTNKIT_ISA="{value}"' in err and f"using {defaults[1]}" in err, err
    for name in attnkit.supported_isas():  # the message lists the choices
        assert name in err


@pytest.mark.parametrize("isa", attnkit.supported_isas())
def test_good_isa_is_taken_silently(isa):
    _, got, err = probe(ATTNKIT_ISA=isa)
    assert got == isa and err == ""


@pytest.mark.parametrize("value", ["l3", "L2", " "])
def test_bad_read_ahead_warns_once_and_uses_the_rule(value, defaults):
    threads, isa, err = probe(ATTNKIT_READ_AHEAD=value)
    assert (threads, isa) == defaults
    assert err.count("ATTNKIT_READ_AHEAD") == 1, err
    assert f'ATTNKIT_READ_AHEAD="{value}"' in err and "l2 or next" in err, err
    assert "using l2" in err or "using next" in err, err


@pytest.mark.parametrize("value", ["l2", "next", ""])
def test_good_read_ahead_is_taken_silently(value, defaults):
    assert probe(ATTNKIT_READ_AHEAD=value) == (*defaults, "")
