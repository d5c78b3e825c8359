"""The chaos test: ranks killed (SIGKILL), hung or lost with their whole node at chosen steps and phases of 4-rank
dp×tp and dp×pp runs under the built-in launcher (--max-restarts, --mem-ckpt-every, two nodes of two ranks), and
every run finishes with the loss trace of the uninterrupted run, bitwise, the same final parameters and every
checkpoint intact, its recovery time and steps lost in recoveries.jsonl. Recovery that leaves out the RNG streams or
the data position is caught (`_recovery_skipping`).

The jobs mostly wait (for ranks to start, for a timeout), so a module fixture starts them all at once, each the
CLI's `main` forked from this warm process (tests/_dist.py ForkedCli), and each test reads its own job's result.
"""
import contextlib
import json
import os
import threading
import time

import pytest
import torch

from _dist import ForkedCli, warm_parent

pytestmark = pytest.mark.slow

TIMEOUT = 30  # --collective-timeout of the hang job: its peers give up after this long
STEPS = 5
COMMON = ["train", "--no-progress", "--no-report", "--seq-len", "32", "--steps", str(STEPS), "--dropout", "0.1",
          "--save-every", "2"]
TP = ["--dp", "2", "--tp", "2"]
PP = ["--dp", "2", "--pp", "2", "--microbatches", "2"]
RECOVER = ["--max-restarts", "1", "--ranks-per-node", "2"]
JOBS = {  # name: (layout, extra flags, what _recovery_skipping leaves out)
    "base_tp": (TP, [], None),
    "base_pp": (PP, [], None),
    # SIGKILL mid-backward; a copy every step: nothing lost
    "kill_tp": (TP, [*RECOVER, "--mem-ckpt-every", "1", "--fault-inject", "1:3:kill:backward"], None),
    # node 1 (ranks 2, 3) and its memory are lost mid-forward: ranks 2 and 3 get their state from node 0
    "node_pp": (PP, [*RECOVER, "--mem-ckpt-every", "1", "--fault-inject", "2:4:node:forward"], None),
    # rank 3 hangs after keeping its copy of step 3, before sending it: its peers time out; step 2's copy is whole
    "hang_pp": (PP, [*RECOVER, "--mem-ckpt-every", "1", "--fault-inject", "3:3:hang:mem-ckpt",
                     "--collective-timeout", str(TIMEOUT)], None),
    # a copy every 2 steps, killed before step 4's optimizer step: step 2's copy, one step lost
    "every2_tp": (TP, [*RECOVER, "--mem-ckpt-every", "2", "--fault-inject", "0:4:kill:optimizer"], None),
    # no memory copies: the disk checkpoint of step 2
    "disk_tp": (TP, [*RECOVER, "--fault-inject", "3:4:crash"], None),
    # recovery that forgets a piece of state must be caught
    "skip_rng_tp": (TP, [*RECOVER, "--mem-ckpt-every", "1", "--fault-inject", "1:3:kill:backward"], "rng"),
    "skip_data_tp": (TP, [*RECOVER, "--mem-ckpt-every", "1", "--fault-inject", "1:3:kill:backward"], "data"),
}


@contextlib.contextmanager
def _recovery_skipping(skip: str | None):
    """Recovery broken on purpose: 'rng' keeps the restarted rank's fresh RNG streams instead of the copy's, 'data'
    restarts the data position at step 0 over the restored weights."""
    from shardwise.resilience import recover
    from shardwise.training import loop

    restore, start = recover.restore, loop.recover

    def restore_without_rng(trainer, blob):
        streams = torch.get_rng_state(), {k: g.get_state() for k, g in trainer.model.rng_tracker.generators.items()}
        step = restore(trainer, blob)
        torch.set_rng_state(streams[0])
        for k, g in trainer.model.rng_tracker.generators.items():
            g.set_state(streams[1][k])
        return step

    def recover_from_the_start(*args, **kwargs):
        event = start(*args, **kwargs)
        return event if event is None or event["source"] != "memory" else event | {"start": 0}

    recover.restore = restore_without_rng if skip == "rng" else restore
    loop.recover = recover_from_the_start if skip == "data" else start
    try:
        yield
    finally:
        recover.restore, loop.recover = restore, start


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("chaos")
    warm_parent()
    procs = {}
    for name, (layout, extra, skip) in JOBS.items():
        with _recovery_skipping(skip):  # the forked CLI, its ranks and their restarts inherit the patch
            procs[name] = ForkedCli([*COMMON, *layout, *extra, "--out", str(out / name)])
    return _wait_jobs(procs, out, "chaos")


def _wait_jobs(procs: dict, out, label: str, beside: tuple = ()) -> dict:
    """Read every forked job's stderr while it runs (`beside`: threads that act on the jobs meanwhile), wait for
    all: {name: exit code, stderr, run directory}."""
    lines = {name: [] for name in procs}
    readers = [threading.Thread(target=lambda p=p, ls=lines[n]: ls.extend(p.stderr)) for n, p in procs.items()]
    for t in (*readers, *beside):
        t.start()
    t0 = time.monotonic()
    done = {}
    for (name, p), reader in zip(procs.items(), readers):
        code = p.wait(timeout=900)
        reader.join(timeout=30)
        done[name] = dict(code=code, err="".join(lines[name]), dir=out / name)
    for t in beside:
        t.join(timeout=30)
    print(f"{label} jobs took {time.monotonic() - t0:.0f} s")
    return done


def _losses(run) -> list[float]:
    return [json.loads(x)["loss"] for x in (run["dir"] / "metrics.jsonl").read_text().splitlines() if x.strip()
            and "loss" in json.loads(x)]


def _recoveries(run) -> list[dict]:
    path = run["dir"] / "recoveries.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _final_params(run) -> dict:
    from shardwise.checkpoint import load_global_tensors

    return load_global_tensors(str(run["dir"] / "checkpoints" / f"step-{STEPS}"))


def _same_run(run, base, bitwise: bool = True) -> None:
    """Exit 0, the base run's loss trace and final parameters (bitwise, else within verify's bounds: the loss's, and
    the value bound without the update budget verify adds to it), every checkpoint it has, intact."""
    from shardwise.checkpoint import checkpoint_problems, list_checkpoints
    from shardwise.verify.checks import Loss, Values

    assert run["code"] == 0, run["err"]
    ours, theirs = _losses(run), _losses(base)
    if bitwise:
        assert ours == theirs, (ours, theirs)
    else:
        assert len(ours) == len(theirs), (ours, theirs)
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= Loss.bound * max(1, abs(theirs[0])), (ours, theirs)
    mine, theirs = _final_params(run), _final_params(base)
    assert mine.keys() == theirs.keys()
    for k in mine:
        if bitwise:
            assert torch.equal(mine[k], theirs[k]), k
        else:
            assert (mine[k] - theirs[k]).norm() <= Values.bound * theirs[k].norm(), k
    ours = list_checkpoints(str(run["dir"] / "checkpoints"))
    assert [s for s, _ in ours] == [s for s, _ in list_checkpoints(str(base["dir"] / "checkpoints"))]
    for _, path in ours:
        assert checkpoint_problems(path) == [], path


def _one_recovery(run, source: str, step: int, lost: int, lost_ranks: list[int]) -> dict:
    (rec,) = _recoveries(run)
    print(json.dumps(rec))
    assert (rec["restored_from"], rec["restored_step"], rec["steps_lost"]) == (source, step, lost), rec
    assert rec["lost_ranks"] == lost_ranks, rec
    assert 0 < rec["recovery_s"] < 120 and rec["restore_s"] >= 0, rec
    return rec


def test_killed_rank_recovers_from_memory_with_no_step_lost(jobs):
    run = jobs["kill_tp"]
    _same_run(run, jobs["base_tp"])
    rec = _one_recovery(run, "memory", 2, 0, [1])
    assert "train step" in rec["phase"], rec
    survivors = [r for r in (0, 2, 3) if f"rank {r} lost a peer in step 3 (train step)" in run["err"]]
    assert survivors == [0, 2, 3], run["err"]  # every survivor detected it and said where it was
    assert "lost rank 1 (exit code -9) after step 2" in run["err"], run["err"]


def test_lost_node_recovers_from_its_peers_memory(jobs):
    run = jobs["node_pp"]
    _same_run(run, jobs["base_pp"])
    rec = _one_recovery(run, "memory", 3, 0, [2, 3])
    assert rec["why"] == {"2": "exit code -9", "3": "exit code -9"}, rec


def test_hang_during_the_copy_is_detected_and_recovered(jobs):
    run = jobs["hang_pp"]
    _same_run(run, jobs["base_pp"])
    (rec,) = _recoveries(run)
    print(json.dumps(rec))
    assert rec["restored_from"] == "memory" and rec["lost_ranks"] == [3] and rec["why"]["3"] == "hung", rec
    # the copy of step 3 never reached rank 3's holder: step 2's is the newest whole one (or step 3, if the hung
    # rank's peers got theirs across before they timed out — every owner's copy of 3 must exist for that)
    assert rec["restored_step"] in (2, 3) and rec["steps_lost"] == 3 - rec["restored_step"], rec


def test_copy_every_two_steps_loses_at_most_one(jobs):
    run = jobs["every2_tp"]
    _same_run(run, jobs["base_tp"])
    _one_recovery(run, "memory", 2, 1, [0])


def test_without_memory_copies_recovers_from_disk(jobs):
    run = jobs["disk_tp"]
    _same_run(run, jobs["base_tp"])
    _one_recovery(run, "disk", 2, 1, [3])


@pytest.mark.parametrize("name", ["skip_rng_tp", "skip_data_tp"])
def test_recovery_that_skips_state_is_caught(jobs, name):
    """Dropout draws from the RNG streams and each step's batch from its position: leaving either out changes the
    trace, so the equality above would fail."""
    run = jobs[name]
    assert run["code"] == 0, run["err"]
    assert _losses(run) != _losses(jobs["base_tp"])


def test_memory_copy_bytes_are_in_the_ledger(jobs):
    """The copy travels on the ckpt axis as `send:mem_ckpt`: this rank's whole state, once per copy."""
    comm = json.loads((jobs["kill_tp"]["dir"] / "comm.json").read_text())
    sent = [s["axes"].get("ckpt", {}).get("send:mem_ckpt", {}).get("bytes", 0) for s in comm["per_step"]]
    assert min(sent[1:]) > 1e6, sent  # tiny model: ~2 MB of parameters and AdamW moments per rank
    base = json.loads((jobs["base_tp"]["dir"] / "comm.json").read_text())
    assert all("send:mem_ckpt" not in s["axes"].get("ckpt", {}) for s in base["per_step"])
