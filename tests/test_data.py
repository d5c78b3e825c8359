"""Tokenizer and loader: deterministic, layout-independent global batches, disjoint dp shards."""
import pytest
import torch

from shardwise.config import ConfigError
from shardwise.data import EOS, Loader, decode, encode, load_tokens


def test_default_corpus_and_roundtrip():
    tokens = load_tokens(None)
    assert tokens.numel() > 400_000 and int(tokens.max()) == EOS and int(tokens.min()) >= 0
    assert decode(encode("héllo ✓")) == "héllo ✓"


def test_loader_deterministic_and_dp_disjoint():
    tokens = torch.arange(10_000) % 256
    a, b = Loader(tokens, 32, 8, seed=3), Loader(tokens, 32, 8, seed=3)
    x, y = a.global_batch_at(5)
    assert torch.equal(x, b.global_batch_at(5)[0]) and torch.equal(x[:, 1:], y[:, :-1])
    shards = [a.dp_shard(5, r, 4)[0] for r in range(4)]
    assert torch.equal(torch.cat(shards), x)
    assert not torch.equal(a.global_batch_at(6)[0], x)
    # past one epoch the permutation changes, windows stay in range
    big = a.global_batch_at(10_000 // 32 // 8 + 3)[0]
    assert big.shape == (8, 32)


def test_bad_data_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_tokens(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        load_tokens(str(empty))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="fewer than --seq-len"):
        Loader(load_tokens(str(short)), 128, 4, 0)
