"""`shardwise generate`: the KV-cache forward equals the full forward, greedy decoding of a checkpoint trained on
a tp2 layout equals transformers' greedy `generate` on its hf-export token for token, bad input exits 2."""
import json

import pytest
import torch

from shardwise.cli import main
from shardwise.config import ParallelConfig, TrainConfig
from shardwise.generate import forward_cached, generate
from shardwise.mesh import Mesh
from shardwise.parallelize import build_model
from shardwise.run import assemble

from _dist import fresh_seed, run_ranks

PROMPT = "The tokenizer "


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_kv_cache_forward_equals_full_forward(model):
    cfg = assemble(TrainConfig(model=model, seed=fresh_seed())).model_config()
    m = build_model(cfg, Mesh.single(), seed=fresh_seed()).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        full = m(tokens)[..., :cfg.vocab_size]
        caches = [[] for _ in m.layers]
        steps = [forward_cached(m, tokens[:, :5], caches)]  # a prompt, then one token per call
        steps += [forward_cached(m, tokens[:, i:i + 1], caches) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained 2 steps on tp=2 with a checkpoint at its last step, and its hf-export."""
    from shardwise.train import train_main

    tmp = tmp_path_factory.mktemp("gen")
    cfg = assemble(TrainConfig(parallel=ParallelConfig(tp=2), steps=2, seq_len=32, micro_batch=2, save_every=2,
                               out=str(tmp / "run"), progress=False, report=False, seed=fresh_seed()))
    run_ranks(2, train_main, cfg)
    assert main(["hf-export", str(tmp / "run" / "checkpoints"), str(tmp / "hf")]) == 0
    return tmp


def test_greedy_equals_transformers_generate(trained):
    transformers = pytest.importorskip("transformers")
    ours = generate(str(trained / "run"), PROMPT, max_new_tokens=24, temperature=0.0)
    assert ours["prompt_tokens"] == list(PROMPT.encode()) and ours["source"].endswith("step-2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(trained / "hf"), dtype=torch.float32).eval()
    ids = torch.tensor([ours["prompt_tokens"]])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          eos_token_id=256, pad_token_id=256)
    assert ours["tokens"] == ref[0, ids.shape[1]:].tolist()
    # the exported directory as SOURCE (byte vocabulary, no tokenizer.json: bytes) decodes the same
    assert generate(str(trained / "hf"), PROMPT, max_new_tokens=24, temperature=0.0)["tokens"] == ours["tokens"]


def test_sampling_is_seeded_and_a_tiny_nucleus_is_greedy(trained):
    run = str(trained / "run")
    greedy = generate(run, PROMPT, max_new_tokens=12, temperature=0.0)["tokens"]
    a, b, c = (generate(run, PROMPT, max_new_tokens=12, temperature=1.5, top_p=1.0, seed=s)["tokens"]
               for s in (1, 1, 2))
    assert a == b and a != c
    assert generate(run, PROMPT, max_new_tokens=12, temperature=1.5, top_p=1e-6, seed=3)["tokens"] == greedy


def test_cli_json_last_line(trained, capsys):
    assert main(["generate", str(trained / "run" / "checkpoints"), "--prompt", PROMPT, "--max-new-tokens", "5",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["tokens"]) == 5 and out["stopped"] == "max_new_tokens" and isinstance(out["text"], str)


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
    (["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["--temperature", "-0.1"], "--temperature -0.1 must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be a positive integer"),
])
def test_bad_sampling_flags_exit_2(flags, message, tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardwise generate: error: ") and message in lines[0], lines


def test_neither_checkpoint_nor_hf_exits_2(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    for source in (tmp_path, tmp_path / "missing"):
        assert main(["generate", str(source), "--prompt", "x"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "shardwise generate: error: " in lines[0], lines
