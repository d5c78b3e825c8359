"""The launch decision (device, backend, start method) with faked GPU counts, and the NCCL env defaults."""
import pytest

from shardwise.config import ConfigError
from shardwise.training.launch import LaunchPlan, nccl_env_defaults, plan_launch


@pytest.mark.parametrize("world, device, gpus, torchrun, plan", [
    (4, "auto", 0, False, LaunchPlan("cpu", "gloo", "fork")),
    (4, "auto", 8, False, LaunchPlan("cuda", "nccl", "spawn")),
    (8, "cuda", 8, False, LaunchPlan("cuda", "nccl", "spawn")),
    (1, "auto", 1, False, LaunchPlan("cuda", "nccl", None)),
    (4, "cpu", 8, False, LaunchPlan("cpu", "gloo", "fork")),
    (1, "cpu", 0, False, LaunchPlan("cpu", "gloo", None)),
    (64, "auto", 8, True, LaunchPlan("cuda", "nccl", None)),  # torchrun: the world spans nodes
    (16, "auto", 0, True, LaunchPlan("cpu", "gloo", None)),
])
def test_plan_launch(world, device, gpus, torchrun, plan):
    assert plan_launch(world, device, gpus, torchrun) == plan


@pytest.mark.parametrize("world, device, gpus, message", [
    (2, "cuda", 0, "--device cuda: no CUDA device is visible"),
    (16, "auto", 8, "needs 16 ranks but this machine has 8 GPUs; use torchrun"),
    (2, "tpu", 0, "--device 'tpu' is unknown; valid: auto, cpu, cuda"),
])
def test_plan_launch_refuses(world, device, gpus, message):
    with pytest.raises(ConfigError, match=message):
        plan_launch(world, device, gpus, False)


def test_nccl_flight_recorder_defaults_never_override_the_user():
    assert nccl_env_defaults({}) == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert nccl_env_defaults({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}) == {"TORCH_FR_BUFFER_SIZE": "2000"}
    # the pre-2.9 names still count as the user's choice
    assert nccl_env_defaults({"TORCH_NCCL_TRACE_BUFFER_SIZE": "10", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/"},
                             "/runs/a") == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert nccl_env_defaults({}, "/runs/a")["TORCH_FR_DUMP_TEMP_FILE"] == "/runs/a/flight_recorder/rank_"
