"""Tokenizers compared by what they do, not by file bytes: one BPE saved raw and through transformers'
`save_pretrained` is one tokenizer (its data trains the checkpoint, blends with it); another vocabulary,
normalizer or added token is another. `train --init-from-hf` refuses byte-prepared data, and a checkpoint
without tokenizer.json until `--init-tokenizer` names the model's tokenizer — each with exit 2 and one line."""
import json
import os
import shutil

import pytest

from shardwise.cli import main
from shardwise.config import ConfigError
from shardwise.data import open_data
from shardwise.data.prepare import prepare_data
from shardwise.data.checksum import sha256_file
from shardwise.data.shards import PreparedData, tokenizer_fingerprint
from shardwise.data.tokenizer import byte_fingerprint, byte_tokenizer_json, fingerprint, load_tokenizer
from shardwise.hf.init import check_data_tokenizer

transformers = pytest.importorskip("transformers")

WORDS = "the quick brown fox jumps over a lazy dog while wizards pack boxes".split()


def _bpe(folder, vocab_size=320, normalizer=None):
    """A byte-level BPE with <unk> and <|endoftext|>, saved raw by the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return folder


def _through_transformers(raw, folder):
    """The same tokenizer written by transformers' PreTrainedTokenizerFast.save_pretrained."""
    t = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(raw, "tokenizer.json"),
                                             eos_token="<|endoftext|>", unk_token="<unk>")
    t.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    raw = _bpe(str(root / "raw"))
    return {"raw": raw, "hf": _through_transformers(raw, str(root / "hf")), "root": root}


def test_same_bpe_saved_two_ways_is_one_tokenizer(toks):
    raw, hf = (os.path.join(toks[k], "tokenizer.json") for k in ("raw", "hf"))
    assert sha256_file(raw) != sha256_file(hf), "the two files should differ in bytes for this test to mean anything"
    assert fingerprint(raw) == fingerprint(hf)
    text = "the lazy wizards jump over boxes"
    assert load_tokenizer(raw).encode_batch([text]) == load_tokenizer(hf).encode_batch([text])


def test_what_changes_ids_changes_the_fingerprint(toks, tmp_path):
    from tokenizers import AddedToken, Tokenizer, normalizers

    base = fingerprint(os.path.join(toks["raw"], "tokenizer.json"))
    smaller = _bpe(str(tmp_path / "small"), vocab_size=300)
    lower = _bpe(str(tmp_path / "lower"), normalizer=normalizers.Lowercase())
    added = str(tmp_path / "added")
    os.makedirs(added)
    t = Tokenizer.from_file(os.path.join(toks["raw"], "tokenizer.json"))
    t.add_special_tokens([AddedToken("<|im_start|>", special=True)])
    t.save(os.path.join(added, "tokenizer.json"))
    prints = [fingerprint(os.path.join(d, "tokenizer.json")) for d in (smaller, lower, added)]
    assert len({base, *prints}) == 4
    assert byte_fingerprint() not in {base, *prints}
    # the byte tokenizer is its tokenizer.json equivalent (what hf-export writes for a byte-level run)
    byte_tokenizer_json().save(str(tmp_path / "byte.json"))
    assert fingerprint(str(tmp_path / "byte.json")) == byte_fingerprint() == load_tokenizer("byte").fingerprint


def _prepare(tmp_path, name, spec):
    docs = tmp_path / f"{name}.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(WORDS[i % 7:])}) + "\n" for i in range(40)))
    out = str(tmp_path / name)
    prepare_data([str(docs)], spec, out, progress=False)
    return out


def test_data_of_either_file_blends_and_fine_tunes(toks, tmp_path):
    a, b = _prepare(tmp_path, "a", toks["raw"]), _prepare(tmp_path, "b", toks["hf"])
    sources, _ = open_data(f"{a}:0.5,{b}:0.5")
    assert len(sources) == 2
    manifest = PreparedData(a).manifest
    check_data_tokenizer(toks["hf"], manifest)  # the checkpoint ships the transformers-written file: accepted
    with pytest.raises(ConfigError, match="--data .* blends directories prepared with different tokenizers"):
        open_data(f"{a}:0.5,{_prepare(tmp_path, 'c', 'byte')}:0.5")
    # a directory prepared before manifests recorded the fingerprint: the recorded file's, while it is unchanged
    old = {k: v for k, v in manifest.items() if k != "tokenizer_fingerprint"}
    assert tokenizer_fingerprint(old) == manifest["tokenizer_fingerprint"]


def _checkpoint(folder, tokenizer=None):
    """A tiny Llama saved by transformers (vocabulary 330 covers the BPE's 320), with `tokenizer`'s files."""
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=330, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    if tokenizer:
        for name in os.listdir(tokenizer):
            shutil.copy(os.path.join(tokenizer, name), folder)
    return folder


def _train_error(capsys, *argv):
    code = main(["train", *argv, "--steps", "1", "--seq-len", "8", "--micro-batch", "1", "--no-progress",
                 "--no-report"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    return err[0]


def test_init_from_hf_refuses_byte_data_and_an_unnamed_tokenizer(toks, tmp_path, capsys):
    ck = _checkpoint(str(tmp_path / "ck"), toks["hf"])
    bare = _checkpoint(str(tmp_path / "bare"))
    byte_data, bpe_data = _prepare(tmp_path, "bytes", "byte"), _prepare(tmp_path, "bpe", toks["raw"])
    own = os.path.join(ck, "tokenizer.json")
    capsys.readouterr()  # transformers' progress bars

    line = _train_error(capsys, "--init-from-hf", ck, "--data", byte_data, "--out", str(tmp_path / "r1"))
    assert line == (f"shardwise train: error: --data was prepared with prepare-data's default byte tokenizer, not "
                    f"--init-from-hf's {own}: its ids mean other tokens to the model; prepare it with "
                    f"`shardwise prepare-data FILES --tokenizer {ck} --out DIR`, or pass --allow-tokenizer-mismatch")

    line = _train_error(capsys, "--init-from-hf", bare, "--data", bpe_data, "--out", str(tmp_path / "r2"))
    assert line.startswith(f"shardwise train: error: --init-from-hf {bare} has no tokenizer.json") and \
        f"({os.path.abspath(toks['raw'])})" in line and "--init-tokenizer SPEC" in line, line

    line = _train_error(capsys, "--init-from-hf", bare, "--data", bpe_data, "--init-tokenizer", "byte",
                        "--out", str(tmp_path / "r3"))
    assert line.startswith("shardwise train: error: --data was prepared with another tokenizer") and \
        "not --init-tokenizer byte" in line, line

    line = _train_error(capsys, "--init-from-hf", ck, "--data", bpe_data, "--init-tokenizer", "byte",
                        "--out", str(tmp_path / "r4"))
    assert f"--init-tokenizer byte is not --init-from-hf's own {own}" in line, line

    line = _train_error(capsys, "--init-from-hf", bare, "--data", bpe_data, "--init-tokenizer", "nope",
                        "--out", str(tmp_path / "r5"))
    assert "--init-tokenizer 'nope' is unknown; valid: byte" in line, line

    # what the user said is checked, then accepted: either file of the BPE names the bare checkpoint's tokenizer
    manifest = PreparedData(bpe_data).manifest
    for spec in (toks["hf"], os.path.join(toks["raw"], "tokenizer.json")):
        check_data_tokenizer(bare, manifest, spec)
    check_data_tokenizer(ck, manifest, toks["raw"])
