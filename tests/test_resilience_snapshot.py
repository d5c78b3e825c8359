"""A memory copy holds the whole training state on every layout: on 4 forked ranks, a run that trains two steps,
copies its state (`resilience.snapshot`), trains two more, then restores the copy and trains them again reproduces
those two losses and its whole state (parameters, optimizer state, RNG streams) bitwise — dp×ep with MoE, ZeRO-1 and ZeRO-3, interleaved dp×pp, Muon — with
dropout on, so every RNG stream counts. Restoring without the RNG streams changes the losses (the check can fail)."""
import pytest
import torch

from _dist import run_ranks

pytestmark = pytest.mark.slow

LAYOUTS = {
    "dp4_ep2_moe_zero1": ["--model", "tiny-moe", "--dp", "4", "--ep", "2", "--zero", "1"],
    "dp4_zero3": ["--dp", "4", "--zero", "3"],
    "dp2_pp2_interleaved": ["--dp", "2", "--pp", "2", "--schedule", "interleaved", "--microbatches", "4"],
    "dp2_tp2_muon": ["--dp", "2", "--tp", "2", "--optimizer", "muon", "--zero", "1"],
}


def _cfg(args, tmp):
    from shardwise.cli import build_parser, config_from_args

    argv = ["train", "--steps", "4", "--seq-len", "32", "--dropout", "0.1", "--no-progress", "--no-report",
            "--out", str(tmp), *args]
    return config_from_args(build_parser().parse_args(argv), 4)


def _round_trips(cfgs):
    """Inside ranks: for each config, (losses of steps 3-4, the same after restoring step 2's copy, whether the whole
    state after both is equal, losses after restoring without the RNG streams)."""
    from shardwise.resilience.snapshot import restore, snapshot
    from shardwise.training.assemble import assembled
    from shardwise.training.trainer import Trainer, make_mesh

    out = []
    for cfg in cfgs:
        cfg = assembled(cfg)
        trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        for step in range(2):
            trainer.train_step(step)
        blob = snapshot(trainer, 2)
        first = [trainer.train_step(step)["loss"] for step in (2, 3)]
        end = snapshot(trainer, 4)  # ZeRO-3's parameters have no storage between steps: compare the state's bytes
        assert restore(trainer, blob) == 2
        again = [trainer.train_step(step)["loss"] for step in (2, 3)]
        same = torch.equal(snapshot(trainer, 4), end)  # parameters, optimizer state and RNG streams
        streams = torch.get_rng_state(), {k: g.get_state() for k, g in trainer.model.rng_tracker.generators.items()}
        restore(trainer, blob)  # then the streams put back as step 4 left them: a restore without the RNG
        torch.set_rng_state(streams[0])
        for k, g in trainer.model.rng_tracker.generators.items():
            g.set_state(streams[1][k])
        no_rng = [trainer.train_step(step)["loss"] for step in (2, 3)]
        out.append((first, again, same, no_rng))
    return out


def test_restored_copy_replays_bitwise_on_every_layout(tmp_path):
    results = run_ranks(4, _round_trips, [_cfg(args, tmp_path / name) for name, args in LAYOUTS.items()])
    for name, (first, again, same, no_rng) in zip(LAYOUTS, results[0]):
        assert again == first, (name, first, again)
        assert same, name
        assert no_rng != first, (name, no_rng)  # the streams matter: skipping them is caught
    for rank in results[1:]:
        assert [r[2] for r in rank] == [True] * len(LAYOUTS)
