"""python -m attnkit.examples.dsa at a small size: the whole DSA layer (prefill past top-2048,
then paged decode steps) runs and passes its own float64 verification."""

import re

import pytest

pytest.importorskip("ml_dtypes")


def test_dsa_example_runs_and_verifies(capsys):
    from attnkit.examples import dsa
    assert dsa.main(["--prompt", "2100", "--decode", "3", "--heads", "8", "--check-rows", "3", "--chunk", "700"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"verified against float64 on \d+ rows \(\d+ prompt, 3 decode\)", text), text


def test_dsa_example_rejects_bad_sizes():
    from attnkit.examples import dsa
    with pytest.raises(SystemExit):
        dsa.main(["--prompt", "0"])
