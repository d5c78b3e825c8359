"""Launching on real clusters, proven with mocks: device per process, gloo's interface, the last-op record
that names where ranks stopped, and the refusal to fork after CUDA was initialised."""
import os
import time

import pytest
import torch

from shardwise.training import launch as launch
from shardwise.config import ConfigError
from shardwise.training.launch import (ForkAfterCudaError, LastOp, RankError, choose_gloo_ifname, interface_towards,
                              local_cuda_index, run_local)


@pytest.mark.parametrize("local_rank, visible, index", [(0, 8, 0), (5, 8, 5), (3, 1, 0), (7, 1, 0)])
def test_local_cuda_index(local_rank, visible, index):
    assert local_cuda_index(local_rank, visible) == index


def test_local_cuda_index_refuses_a_rank_without_its_gpu():
    with pytest.raises(ConfigError, match="LOCAL_RANK 3 but this process sees 2 GPUs"):
        local_cuda_index(3, 2, "4,5")


@pytest.mark.parametrize("visible_devices, local_rank, expect", [
    ("3", "3", 0),              # SLURM: each process sees only its own GPU
    ("0,1,2,3", "2", 2),        # the node's GPUs, one per local rank
    (None, "1", 1),
])
def test_pick_device_under_torchrun_with_mocked_gpus(monkeypatch, visible_devices, local_rank, expect):
    env = {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": local_rank}
    if visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    for k in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    count = len(visible_devices.split(",")) if visible_devices else 4
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert launch.pick_device("auto") == torch.device("cuda", expect)
    assert chosen == [expect]
    assert launch.pick_device("cpu") == torch.device("cpu")


def _towards(table):
    return lambda host: table.get(host)


def test_gloo_interface_choice():
    route = _towards({"10.0.0.5": ("ib0", "10.0.0.7"), "127.0.0.1": ("lo", "127.0.0.1"),
                      "node0": ("lo", "127.0.1.1"), "192.0.2.1": ("eth0", "172.16.0.3")})
    nics = ["lo", "eth0", "ib0"]
    assert choose_gloo_ifname("eth0", {"GLOO_SOCKET_IFNAME": "ib0"}, nics, route) == "eth0"  # flag first
    assert choose_gloo_ifname(None, {"GLOO_SOCKET_IFNAME": "ib0"}, nics, route) == "ib0"
    assert choose_gloo_ifname(None, {"MASTER_ADDR": "10.0.0.5"}, nics, route) == "ib0"  # the route to it
    assert choose_gloo_ifname(None, {"MASTER_ADDR": "127.0.0.1"}, nics, route) == "lo"
    # on the rendezvous host of a 2-node job the route is loopback: take the default route's interface
    env = {"MASTER_ADDR": "node0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert choose_gloo_ifname(None, env, nics, route) == "eth0"
    assert choose_gloo_ifname(None, env | {"LOCAL_WORLD_SIZE": "16"}, nics, route) == "lo"  # one node
    assert choose_gloo_ifname(None, {}, nics, route) is None
    with pytest.raises(ConfigError, match=r"--gloo-ifname 'eth9' names no network interface on this host "
                                          r"\('eth9'\); available: lo, eth0, ib0"):
        choose_gloo_ifname("eth9", {}, nics, route)
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME 'lo,eth7'"):
        choose_gloo_ifname(None, {"GLOO_SOCKET_IFNAME": "lo,eth7"}, nics, route)


def test_interface_towards_loopback_on_this_host():
    assert interface_towards("127.0.0.1") == ("lo", "127.0.0.1")


def test_last_op_record_round_trip(tmp_path):
    rec = LastOp(str(tmp_path), 3)
    assert LastOp.read(str(tmp_path), 3) is None
    rec.note("all_reduce", "dp")
    rec.note("reduce_scatter", "dp_shard")
    assert LastOp.read(str(tmp_path), 3) == (2, "reduce_scatter", "dp_shard")
    assert LastOp.read(str(tmp_path), 4) is None


def test_last_op_record_keeps_an_op_in_words_apart_from_its_axis(tmp_path):
    rec = LastOp(str(tmp_path), 0)
    rec.note("recv of act for microbatch 0, stage 1", "pp")
    assert LastOp.read(str(tmp_path), 0) == (1, "recv of act for microbatch 0, stage 1", "pp")
    rec.note("send of grad " + "x" * 200, "dp_cp")
    n, op, axis = LastOp.read(str(tmp_path), 0)
    assert (n, axis) == (2, "dp_cp") and op.startswith("send of grad x")


def _stall_then_abort():
    """Rank 1 stops after one all-reduce (a stuck kernel); rank 0 posts the next and, when it times out,
    aborts as NCCL's watchdog would: no exception reaches the launcher."""
    import torch.distributed as dist

    from shardwise import comm
    from _dist import make_mesh

    tp = make_mesh(timeout_s=3.0, tp=2)["tp"]
    comm.all_reduce(torch.ones(4), tp)
    if dist.get_rank() == 1:
        time.sleep(120)
    try:
        comm.all_reduce(torch.ones(4), tp)
    except comm.CollectiveError:
        import faulthandler

        faulthandler.disable()  # the watchdog's abort, without a Python stack dump on the test's stderr
        os.abort()


def test_launcher_names_the_rank_and_op_where_ranks_stopped():
    with pytest.raises(RankError) as e:
        run_local(_stall_then_abort, 2, timeout_s=3.0, wall_timeout_s=60, grace_s=1.0)
    msg = str(e.value)
    assert "rank 0 died with exit code -6 (last collective call #2: all_reduce on axis 'tp')" in msg, msg
    assert "rank 1 hung" in msg and "rank 1 stopped earliest, at collective call #1 (all_reduce on axis 'tp')" in msg


def test_run_local_refuses_to_fork_after_cuda_init(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ForkAfterCudaError, match="already initialised CUDA.*before any CUDA call"):
        run_local(os.getpid, 2)


def test_flight_recorder_dumps_go_to_the_run_directory(monkeypatch, tmp_path):
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
             "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT")
    for k in names:  # registered with monkeypatch, so whatever the call sets is undone afterwards
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    launch._apply_nccl_env(str(tmp_path / "run"))
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "flight_recorder" / "rank_")
    assert (tmp_path / "run" / "flight_recorder").is_dir()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
