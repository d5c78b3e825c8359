"""Numerics stay where they were: each run of tests/data/loss_trace.json reproduced step by step, bitwise on the
torch version and CPU that wrote it, else its first steps within 1e-5 relative (tests/loss_trace.py; regenerate with
`python -m tests.loss_trace --write`)."""
import pytest

import loss_trace


def test_the_trace_holds_every_run():
    trace = loss_trace.load()
    assert set(trace["runs"]) == set(loss_trace.RUNS)
    for name, argv in loss_trace.RUNS.items():
        assert trace["runs"][name]["command"] == " ".join(["shardwise", "train", *argv]), f"{name}: regenerate"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(loss_trace.RUNS))
def test_run_reproduces_the_stored_loss_trace(name):
    trace = loss_trace.load()
    if loss_trace.machine()["corpus_sha256"] != trace["written_by"]["corpus_sha256"]:
        pytest.skip("the embedded corpus (pydoc_data.topics) differs from the one the trace was written on "
                    f"(Python {trace['written_by']['python']}): the runs train on other data")
    exact = loss_trace.bitwise_expected(trace)
    diff = loss_trace.first_difference(trace["runs"][name]["loss"], loss_trace.run(name), exact)
    assert diff is None, f"{name} ({'bitwise' if exact else f'first {loss_trace.CROSS_STEPS} steps, rtol {loss_trace.RTOL:g}'}): {diff}"


def test_first_difference_bitwise_and_relative():
    want = [5.5805583000183105, 5.222544193267822]
    assert loss_trace.first_difference(want, list(want), exact=True) is None
    nudged = [want[0], want[1] * (1 + 1e-7)]
    assert loss_trace.first_difference(want, nudged, exact=True).startswith("step 2:")
    assert loss_trace.first_difference(want, nudged, exact=False) is None
    assert loss_trace.first_difference(want, [want[0], want[1] * (1 + 1e-4)], exact=False).startswith("step 2:")
    late = [3.0] * loss_trace.CROSS_STEPS + [3.0]
    drifted = late[:-1] + [3.03]  # a 1% drift after the first steps: training's amplification, not a change
    assert loss_trace.first_difference(late, drifted, exact=False) is None
    assert loss_trace.first_difference(late, drifted, exact=True).startswith(f"step {len(late)}:")
    assert loss_trace.first_difference(want, want[:1], exact=True) == "1 steps, the trace has 2"
