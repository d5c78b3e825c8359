"""FP8 runs keep high-precision master weights: an `--fp8` run's checkpoint is an ordinary one (the same names,
shapes and fp32 dtypes as a bf16 run's, no FP8 tensor or scale in it), a bf16 run resumes from it and an FP8 run from
the bf16 run's checkpoint, bit for bit in parameters and AdamW state, and its Hugging Face export is the export of
the same weights without FP8. One process, two-layer tiny model, bf16 autocast."""
import dataclasses
import os

import torch

from shardwise.checkpoint import load_checkpoint, load_global_tensors, save_checkpoint
from shardwise.config import TrainConfig
from shardwise.hf.weights import export_hf
from shardwise.mesh import Mesh
from shardwise.optim import optimizers
from shardwise.training.assemble import assemble
from shardwise.training.trainer import Trainer

from _dist import fresh_seed


def _reloaded(cfg: TrainConfig, root) -> torch.nn.Module:
    """A fresh run of `cfg` (with or without FP8) holding the checkpoint under `root`."""
    t = _trainer(cfg)
    load_checkpoint(str(root), t)
    return t.model


def _trainer(cfg: TrainConfig) -> Trainer:
    return Trainer(assemble(cfg), Mesh.single(torch.device("cpu")))


def _state(t: Trainer) -> dict:
    """Parameters and AdamW moments, cloned."""
    out = {f"p/{n}": p.detach().clone() for n, p in t.model.named_parameters()}
    for i, opt in enumerate(optimizers(t.reducer)):
        out |= {f"opt{i}/{k}/{name}": v.clone() for k, s in opt.state_dict()["state"].items()
                for name, v in s.items() if torch.is_tensor(v)}
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_fp8_checkpoint_resumes_as_bf16_and_back_and_exports_unchanged(tmp_path):
    seed = fresh_seed()
    bf16 = TrainConfig(steps=4, seq_len=32, micro_batch=2, seed=seed, progress=False, dtype="bf16",
                       model_overrides={"n_layers": 2})
    fp8 = dataclasses.replace(bf16, fp8="rowwise")
    run = _trainer(fp8)
    assert any(getattr(m, "fp8", None) is not None for m in run.model.modules())
    for step in range(2):
        run.train_step(step)
    save_checkpoint(str(tmp_path / "fp8"), 2, run)
    saved = _state(run)
    step_dir = load_checkpoint(str(tmp_path / "fp8"), _trainer(bf16))["path"]
    tensors = load_global_tensors(step_dir)
    assert {t.dtype for t in tensors.values()} == {torch.float32}, {t.dtype for t in tensors.values()}
    assert tensors.keys() == dict(run.model.named_parameters()).keys()

    # FP8 → bf16: the same master weights and AdamW state, and the run goes on in bf16
    plain = _trainer(bf16)
    assert not any(getattr(m, "fp8", None) is not None for m in plain.model.modules())
    assert load_checkpoint(str(tmp_path / "fp8"), plain)["step"] == 2
    _same(_state(plain), saved)
    again = _trainer(bf16)
    load_checkpoint(str(tmp_path / "fp8"), again)
    loss = plain.train_step(2)["loss"]
    assert loss == again.train_step(2)["loss"]  # a bf16 step from the FP8 run's state, deterministic
    fp8_loss = run.train_step(2)["loss"]  # the FP8 run's own step from the same state: close, FP8-rounded
    assert fp8_loss != loss and abs(fp8_loss - loss) < 0.05 * loss, (seed, fp8_loss, loss)
    plain.train_step(3)
    save_checkpoint(str(tmp_path / "bf16"), 4, plain)

    # bf16 → FP8
    back = _trainer(fp8)
    assert load_checkpoint(str(tmp_path / "bf16"), back)["step"] == 4
    _same(_state(back), _state(plain))
    assert torch.isfinite(torch.tensor(back.train_step(4)["loss"]))

    # HF export: the FP8 model's is the bf16 model's of the same weights, tensor for tensor
    a = export_hf(_reloaded(fp8, tmp_path / "fp8"), run.model_cfg, str(tmp_path / "hf_fp8"))
    b = export_hf(_reloaded(bf16, tmp_path / "fp8"), run.model_cfg, str(tmp_path / "hf_bf16"))
    from safetensors.torch import load_file

    ta, tb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    _same(ta, tb)
    with open(os.path.join(a, "config.json")) as fa, open(os.path.join(b, "config.json")) as fb:
        assert fa.read() == fb.read()

