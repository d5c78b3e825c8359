"""Launch misuse on the command line: exit 2 and one line before any rank starts."""
from unittest import mock

import pytest
import torch

from test_cli import Launched, main_without_ranks


@pytest.mark.parametrize("args, gpus, message", [
    (["train", "--device", "cuda"], 0, "--device cuda: no CUDA device is visible"),
    (["verify", "--tp", "2", "--dp", "2"], 2, "the layout needs 4 ranks but this machine has 2 GPUs; use torchrun"),
    (["train", "--gloo-ifname", "nosuchif0"], 0, "--gloo-ifname 'nosuchif0' names no network interface on this host"),
])
def test_launch_misuse_exits_2_with_one_line(args, gpus, message, capsys):
    with mock.patch.object(torch.cuda, "device_count", lambda: gpus):
        assert main_without_ranks(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shardwise {args[0]}: error: ") and message in lines[0], lines


def test_a_real_interface_passes(monkeypatch):
    import os

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # restored (removed) after the test: the CLI exports it
    with pytest.raises(Launched):
        main_without_ranks(["verify", "--gloo-ifname", "lo"])
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
