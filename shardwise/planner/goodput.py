"""Goodput under failures: the fraction of a job's time that trains, with disk checkpoints at the Young–Daly interval
and with in-memory peer copies (`--mem-ckpt-every`, docs/fault-tolerance.md).

A job of G GPUs fails every M = MTBF_gpu / G seconds. Saving every τ seconds at a cost of δ seconds (the training
blocked for it) and losing, per failure, the restart R, the reload L and on average τ/2 of recomputed work wastes

    waste(τ) = δ/τ + (τ/2 + R + L) / M

which is least at Young's τ* = sqrt(2 δ M) (Daly's higher-order terms matter only when δ nears M). Disk: δ = L =
the checkpoint's bytes over the storage bandwidth. Memory copies: δ = L = a rank's state over its NIC (every rank
sends one copy to its peer at once, and reads it back from there), so τ* is far shorter and the copies can be taken
every step or few. The step time rounds τ* to whole steps. Memory copies cover the loss of any one node; the rarer
loss of the whole job still needs disk checkpoints, which are not counted here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

LLAMA3_MTBF_GPU_HOURS = 16_384 * 54 * 24 / 419
"""GPU-hours between interruptions in Meta's Llama 3 405B run: 419 unexpected interruptions in 54 days on 16,384
GPUs (The Llama 3 Herd of Models, 2024, section 3.3.4) — about 50,700."""

STATE_BYTES_PER_PARAM = {"adamw": 12, "muon": 8}
"""A checkpoint's bytes per parameter: fp32 weights and AdamW's two moments (Muon: one momentum buffer)."""


@dataclass(frozen=True)
class FailureModel:
    mtbf_gpu_hours: float = LLAMA3_MTBF_GPU_HOURS
    storage_bytes_per_s: float = 100e9
    """The job's share of the checkpoint storage's bandwidth, reading or writing."""
    restart_s: float = 180.0
    """From a failure to a restarted worker group: detection, rescheduling, process start, rendezvous (no state)."""


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that wastes least: sqrt(2 δ M)."""
    return math.sqrt(2 * cost_s * mtbf_s)


def waste(interval_s: float, cost_s: float, reload_s: float, restart_s: float, mtbf_s: float) -> float:
    """Fraction of the job's time lost to saving every `interval_s` and to failures every `mtbf_s`."""
    return cost_s / interval_s + (interval_s / 2 + restart_s + reload_s) / mtbf_s


def _every(cost_s: float, mtbf_s: float, step_s: float) -> int:
    return max(1, round(young_daly(cost_s, mtbf_s) / step_s))


def peer_copy_host_bytes(static: dict) -> float:
    """Host memory per rank under --mem-ckpt-every: its own copy and its ward's, each the rank's weights and
    optimizer state (`static`: the planner's per-rank static breakdown)."""
    return 2 * (static["weights"] + static["optimizer"])


def goodput(gpus: int, step_s: float, params_total: int, state_bytes_per_rank: float, nic_bytes_per_s: float,
            optimizer: str = "adamw", fm: FailureModel = FailureModel()) -> dict:
    """Per plan row: the job's MTBF, disk checkpoints' cost and the `--save-every` Young–Daly recommends, the memory
    copies' cost, host memory and the `--mem-ckpt-every` it recommends, and the goodput of each."""
    mtbf_s = fm.mtbf_gpu_hours * 3600 / gpus
    disk_s = params_total * STATE_BYTES_PER_PARAM.get(optimizer, 12) / fm.storage_bytes_per_s
    save_every = _every(disk_s, mtbf_s, step_s)
    copy_s = state_bytes_per_rank / nic_bytes_per_s
    mem_every = _every(copy_s, mtbf_s, step_s)
    return {
        "mtbf_job_h": mtbf_s / 3600, "checkpoint_write_s": disk_s, "save_every": save_every,
        "goodput_disk": 1 - waste(save_every * step_s, disk_s, disk_s, fm.restart_s, mtbf_s),
        "mem_copy_s": copy_s, "mem_ckpt_every": mem_every, "mem_host_bytes_per_rank": 2 * state_bytes_per_rank,  # = peer_copy_host_bytes
        "goodput_mem": 1 - waste(mem_every * step_s, copy_s, copy_s, fm.restart_s, mtbf_s),
    }


def goodput_lines(g: dict) -> list[str]:
    """--explain's terms."""
    return [f"failures: one every {g['mtbf_job_h']:.2f} h for the job (MTBF per GPU / GPUs)",
            f"disk checkpoints: {g['checkpoint_write_s']:.1f} s to write (and read), Young–Daly --save-every "
            f"{g['save_every']}: goodput {g['goodput_disk']:.3f}",
            f"memory copies: {g['mem_copy_s']:.2f} s per copy to a peer node, "
            f"{g['mem_host_bytes_per_rank'] / 1e9:.1f} GB host memory per rank (own + peer's), --mem-ckpt-every "
            f"{g['mem_ckpt_every']}: goodput {g['goodput_mem']:.3f}"]
