"""torchrun's elastic agents as nodes: two agents (c10d rendezvous, --max-restarts 1) of two ranks each train
dp2×tp2 with a memory copy every step; one agent and its ranks are SIGKILLed mid-run (a lost node: its memory goes
with it) and a replacement agent joins. The surviving agent restarts its worker group, the new group resumes from
the memory copies (the lost node's ranks from their peers on the surviving node) and finishes with the loss trace of
an uninterrupted run of the built-in launcher, bitwise.

The rendezvous store is this test's (`TCPStore`), standing in for a cluster's rendezvous service, so that it
outlives whichever agent dies. The agent lost is the rendezvous's rank 0 (the lowest pid: c10d ranks its nodes
sorted): torch 2.13's agent publishes the workers' store address once, so a surviving rank-0 agent would leave a
replacement agent waiting for it in the next round (`DynamicRendezvousHandler._bootstrap_store_info` is cached);
a surviving rank-1 agent that becomes rank 0 publishes it."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from shardwise.resilience.store import shm_root

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10
TRAIN = ["train", "--no-progress", "--no-report", "--seq-len", "32", "--steps", str(STEPS), "--dropout", "0.1",
         "--dp", "2", "--tp", "2", "--save-every", "5", "--collective-timeout", "60"]


def _env() -> dict:
    return os.environ | {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _agent(port: int, job: str, out, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=false",
           "--rdzv-id", job, "--max-restarts", "1",
           "--monitor-interval", "0.5", "-m", "shardwise", *TRAIN, "--mem-ckpt-every", "1", "--save-on-signal", "none",
           "--auto-resume", "--out", str(out)]
    return subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def _steps_done(out) -> int:
    try:
        return max((json.loads(x).get("step", 0) for x in (out / "metrics.jsonl").read_text().splitlines() if x),
                   default=0)
    except (OSError, ValueError):
        return 0


def test_two_agents_lose_one_and_finish_bitwise(tmp_path):
    base = subprocess.Popen([sys.executable, "-m", "shardwise", *TRAIN, "--out", str(tmp_path / "base")], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "base.log", "w"), cwd=ROOT)
    job, out = f"chaos-{uuid.uuid4().hex[:8]}", tmp_path / "elastic"
    from datetime import timedelta

    from torch.distributed import TCPStore

    # bound on a port the kernel picks: one picked free and released first could be taken by another test worker
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=900))
    port = store.port
    logs = {n: open(tmp_path / f"agent_{n}.log", "w") for n in ("a", "b", "c")}
    agents = [_agent(port, job, out, logs["a"]), _agent(port, job, out, logs["b"])]
    deadline = time.monotonic() + 600
    while _steps_done(out) < 3:
        assert time.monotonic() < deadline and all(p.poll() is None for p in agents), \
            (tmp_path / "agent_a.log").read_text()[-3000:]
        time.sleep(0.2)
    lost, a = sorted(agents, key=lambda p: p.pid)  # the rendezvous's rank 0 goes; `a` survives
    lost.send_signal(signal.SIGKILL)  # the node is gone: its ranks follow (PDEATHSIG), its memory copies with it
    lost.wait()
    c = _agent(port, job, out, logs["c"])  # the replacement node
    try:
        log = "agent_a.log" if a is agents[0] else "agent_b.log"
        assert a.wait(timeout=600) == 0, (tmp_path / log).read_text()[-5000:]
        assert c.wait(timeout=120) == 0, (tmp_path / "agent_c.log").read_text()[-5000:]
        assert base.wait(timeout=600) == 0, (tmp_path / "base.log").read_text()[-3000:]
    finally:
        for p in (a, c, base):
            if p.poll() is None:
                p.kill()
        shutil.rmtree(os.path.join(shm_root(), f"shardwise-mem-{job}"), ignore_errors=True)  # the lost agent's
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    expect = [json.loads(x)["loss"] for x in (tmp_path / "base" / "metrics.jsonl").read_text().splitlines() if x]
    assert len(losses) == STEPS and losses == expect
    (rec,) = [json.loads(x) for x in (out / "recoveries.jsonl").read_text().splitlines()]
    print(json.dumps(rec))
    assert rec["restored_from"] == "memory" and rec["steps_lost"] <= 1, rec
    assert rec["from_peer"], rec  # the lost node's ranks got their state from the surviving node
    assert "lost a peer" in (tmp_path / log).read_text()  # the survivors said where they were
    del store
