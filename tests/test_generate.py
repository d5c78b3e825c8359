"""`shardwise generate`: the KV-cache forward equals the full forward, greedy decoding of a checkpoint trained on
a tp2 layout equals transformers' greedy `generate` on its hf-export token for token, bad input exits 2."""
import json

import pytest
import torch

from shardwise.cli import main
from shardwise.config import ModelConfig, ParallelConfig, TrainConfig
from shardwise.training.generate import KVCache, generate, generate_ids, load_source
from shardwise.mesh import Mesh
from shardwise.parallelize import build_model
from shardwise.training.assemble import assemble

from _dist import fresh_seed, run_ranks

PROMPT = "The tokenizer "


# Qwen3-shaped (q/k norms, head_dim != dim / n_heads) and DeepSeek-V3-shaped (MLA, grouped sigmoid routing).
QWEN3 = ModelConfig(name="qwen3-tiny", vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24,
                    ffn_dim=96, max_seq_len=64, norm_eps=1e-6, qk_norm=True, tie_embeddings=True)
DEEPSEEK = ModelConfig(name="deepseek-tiny", vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=4,
                       head_dim=16, ffn_dim=96, max_seq_len=64, norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=24,
                       qk_rope_dim=8, v_head_dim=12, moe_experts=8, moe_topk=2, moe_ffn_dim=32, moe_shared_experts=1,
                       moe_dense_layers=(0,), moe_score="sigmoid", moe_n_group=4, moe_topk_group=2,
                       moe_routed_scaling=2.5)


@pytest.mark.parametrize("model", ["tiny", "tiny-moe", QWEN3, DEEPSEEK], ids=["tiny", "tiny-moe", "qwen3", "mla"])
def test_kv_cache_forward_equals_full_forward(model):
    cfg = assemble(TrainConfig(model=model, seq_len=32, seed=fresh_seed())).model_config()
    m = build_model(cfg, Mesh.single(), seed=fresh_seed()).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        full = m(tokens)[..., :cfg.vocab_size]
        cache = KVCache(m)
        steps = [cache.forward(tokens[:, :5])]  # a prompt, then one token per call
        steps += [cache.forward(tokens[:, i:i + 1]) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert all("core" not in vars(b.attention) for b in m.layers.values()), "the module's own core is back"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained 2 steps on tp=2 with a checkpoint at its last step, and its hf-export."""
    from shardwise.training.loop import train_main

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
                          eos_token_id=256, pad_token_id=256, output_logits=True, return_dict_in_generate=True)
    assert ours["tokens"] == ref.sequences[0, ids.shape[1]:].tolist()
    # every step's logits, not only their argmax: the cache's positions and contents are exact
    model, *_ = load_source(str(trained / "run"))
    scores = []
    generate_ids(model, ours["prompt_tokens"], 24, 256, scores=scores)
    torch.testing.assert_close(torch.stack(scores), torch.cat(ref.logits).float(), rtol=1e-4, atol=1e-4)
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
    assert isinstance(out["text"], str) and out["source"].endswith("step-2")
    assert (out["stopped"], len(out["tokens"])) == ("max_new_tokens", 5) or \
        (out["stopped"], out["tokens"][-1]) == ("eos", 256), out


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
    (["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["--temperature", "-0.1"], "--temperature -0.1 must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be a positive integer"),
    (["--device", "tpu"], "--device 'tpu' is unknown; valid: auto, cpu, cuda"),
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


def test_checkpoint_on_prepared_data_uses_its_tokenizer_and_eos(tmp_path):
    """A run on data prepared with a tokenizer.json: generate encodes and decodes with that tokenizer and stops
    at the data's end-of-document id (the record the checkpoint carries)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from shardwise.data.prepare import prepare_data
    from shardwise.training.loop import train_main

    tok = Tokenizer(WordLevel({"<unk>": 0, "<|endoftext|>": 1, **{f"w{i}": i + 2 for i in range(40)}},
                              unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": " ".join(f"w{(d + i) % 40}" for i in range(60))})
                                                 + "\n" for d in range(40)))
    prepare_data([str(tmp_path / "docs.jsonl")], str(tmp_path / "tokenizer.json"), str(tmp_path / "data"),
                 progress=False)
    cfg = assemble(TrainConfig(data=str(tmp_path / "data"), steps=2, seq_len=32, micro_batch=2, save_every=2,
                               out=str(tmp_path / "run"), progress=False, report=False, seed=fresh_seed()))
    train_main(cfg)
    out = generate(str(tmp_path / "run"), "w3 w4 w5", max_new_tokens=200, temperature=0.0)
    assert out["prompt_tokens"] == [5, 6, 7]
    assert out["text"] == tok.decode(out["tokens"][:-1] if out["stopped"] == "eos" else out["tokens"])
    assert out["stopped"] in ("eos", "max_new_tokens") and 1 not in out["tokens"][:-1]
    if out["stopped"] == "eos":
        assert out["tokens"][-1] == 1


def test_help_shows_zero_defaults(capsys):
    """Defaults that are 0 are shown too (0 == False must not hide them): generate's --seed, train's --zero."""
    from shardwise.cli import build_parser

    for cmd, flag in (("generate", "--seed SEED sampling seed (default: 0)"), ("train", "(+ parameters) (default: 0)")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, "--help"])
        assert flag in " ".join(capsys.readouterr().out.split())
