"""Held-out evaluation: eval_loss is a function of the weights alone, equal on every layout; the flags'
bad input exits 2 before any rank starts; train logs eval rows to metrics.jsonl, TensorBoard and the report."""
import json

import pytest
import torch

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.data.loader import load_tokens
from shardwise.training.evaluate import EvalLoader, Evaluator
from shardwise.training.assemble import assemble

from _dist import fresh_seed, run_ranks
from test_cli import Launched, main_without_ranks

# world 4 each: pp with tp and SP over an interleaved schedule, cp (ring, document masks) with ZeRO-3
# gathers, ep with tp (tiny-moe, the aux loss's all-reduce in every forward).
LAYOUTS = [
    (dict(tp=2, pp=2, sequence_parallel=True, schedule="interleaved", vp=2), dict(global_batch=8)),
    (dict(cp=2, dp=2, zero=3), dict(attention_mask="document")),
    (dict(dp=2, ep=2, tp=2), dict(model="tiny-moe")),
]


def _eval_tokens() -> torch.Tensor:
    return load_tokens(None)[-20_000:]  # the corpus' tail: other windows than training's first steps


def _layouts_against_single(seed: int):
    """Per layout: eval_loss of the layout and of the single-device model at init and after one step."""
    from shardwise.training.trainer import Trainer, make_mesh
    from shardwise.verify.reference import reference

    out = []
    for degrees, extra in LAYOUTS:
        cfg = assemble(TrainConfig(parallel=ParallelConfig(**degrees), steps=2, seq_len=32, micro_batch=2,
                                   eval_steps=2, seed=seed, progress=False, **extra))
        trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        ref = reference(cfg, torch.device("cpu"))
        ev, ev_ref = Evaluator(trainer, _eval_tokens()), Evaluator(ref, _eval_tokens())
        bytes_before = dict(trainer.mesh.ledger.current)
        row = {"layout": degrees, "init": (ev.run(), ev_ref.run()), "again": ev.run()}
        row["ledger_untouched"] = dict(trainer.mesh.ledger.current) == bytes_before
        trainer.train_step(0)
        ref.train_step(0)
        row["trained"] = (ev.run(), ev_ref.run())
        out.append(row)
    return out


def test_eval_loss_equal_across_layouts():
    """eval_loss equals the single-device model's at init and after a step, and the step's new weights are what the
    evaluation sees (its loss changed). Not that the held-out loss fell: a few steps need not lower it (a fresh seed
    went 5.5726 → 5.5813)."""
    seed = fresh_seed()
    rows = run_ranks(4, _layouts_against_single, seed)
    assert all(r == rows[0] for r in rows), (seed, "every rank returns the same (all-reduced) eval loss", rows)
    for row in rows[0]:
        for when in ("init", "trained"):
            mine, single = row[when]
            assert abs(mine - single) <= 1e-5 * max(1.0, abs(single)), (seed, row)
        assert row["again"] == row["init"][0], (seed, "a second evaluation of the same weights: the same loss", row)
        assert row["trained"][0] != row["init"][0], (seed, "the evaluation sees the weights the step moved", row)
        assert row["ledger_untouched"], (seed, "the evaluation's collectives stay out of the step's comm ledger", row)


def test_eval_windows_are_taken_in_order():
    tokens = torch.arange(1000) % 250
    loader = EvalLoader(tokens, 10, 4, seed=7)
    x, y = loader.global_batch_at(1)
    assert x[:, 0].tolist() == [40, 50, 60, 70] and torch.equal(y, x + 1)


@pytest.mark.parametrize("extra, message", [
    (["--eval-every", "0"], "--eval-every 0 must be a positive integer"),
    (["--eval-steps", "0"], "--eval-steps 0 must be a positive integer"),
    (["--eval-steps", "100000"], "lower --eval-steps"),
])
def test_bad_eval_flags_exit_2(extra, message, tmp_path, capsys):
    held = tmp_path / "held.txt"
    held.write_text("held-out text " * 400)
    assert main_without_ranks(["train", "--eval-data", str(held), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_eval_every_without_eval_data_exits_2(capsys):
    assert main_without_ranks(["train", "--eval-every", "5"]) == 2
    assert "--eval-every 5 needs --eval-data" in capsys.readouterr().err


def test_eval_data_with_another_tokenizer_exits_2(tmp_path, capsys):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from shardwise.data.prepare import prepare_data

    tok = Tokenizer(WordLevel({"<unk>": 0, "<|endoftext|>": 1, **{f"w{i}": i + 2 for i in range(50)}},
                              unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs.txt").write_text(" ".join(f"w{i % 50}" for i in range(3000)))
    prepare_data([str(tmp_path / "docs.txt")], str(tmp_path / "tokenizer.json"), str(tmp_path / "words"),
                 progress=False)
    assert main_without_ranks(["train", "--eval-data", str(tmp_path / "words")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "was encoded with another tokenizer" in lines[0], lines
    # the same directory is fine as held-out data for a run on that tokenizer
    with pytest.raises(Launched):
        main_without_ranks(["train", "--data", str(tmp_path / "words"), "--eval-data", str(tmp_path / "words"),
                            "--eval-steps", "1", "--seq-len", "32"])


def test_train_logs_eval_to_metrics_tensorboard_and_report(tmp_path):
    """One in-process single-device run: eval rows at every 2nd and the last step, TensorBoard's eval/loss,
    the report's loss plot and summary line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardwise.training.report import render
    from shardwise.training.loop import train_main

    held = tmp_path / "held.txt"
    held.write_text("".join(chr(32 + i % 90) for i in range(5000)))
    cfg = TrainConfig(steps=3, seq_len=32, micro_batch=2, eval_data=str(held), eval_every=2, eval_steps=2,
                      out=str(tmp_path / "run"), progress=False, report=False, seed=fresh_seed())
    summary = train_main(assemble(cfg))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [sorted(r) for r in evals] == [["eval_loss", "step"]] * 2 and [r["step"] for r in evals] == [2, 3]
    assert summary["eval_loss"] == evals[-1]["eval_loss"]
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars("eval/loss")] == \
        [(r["step"], r["eval_loss"]) for r in evals]
    lines = render(str(tmp_path / "run"))
    assert any(line.startswith("eval loss ") for line in lines), lines
