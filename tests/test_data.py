"""Tokenizer and loader: deterministic, layout-independent global batches, disjoint dp shards."""
import pytest
import torch

from shardwise.config import ConfigError
from shardwise.data import EOS, Loader, decode, encode, load_tokens


def test_default_corpus_and_roundtrip():
    tokens = load_tokens(None)
    assert tokens.numel() > 400_000 and int(tokens.max()) == EOS and int(tokens.min()) >= 0
    assert decode(encode("héllo ✓")) == "héllo ✓"


def test_loader_deterministic_and_layout_free():
    tokens = torch.arange(10_000) % 256
    a, b = Loader(tokens, 32, 8, seed=3), Loader(tokens, 32, 8, seed=3)
    x, y = a.global_batch_at(5)
    assert torch.equal(x, b.global_batch_at(5)[0]) and torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(a.global_batch_at(6)[0], x)


def test_epoch_boundary_inside_a_batch():
    """312 windows, 7 per batch: batch 44 holds epoch 0's last 4 windows and epoch 1's first 3. Each
    epoch visits every window exactly once, and the batch is the same whatever was read before."""
    tokens = torch.randint(0, 256, (10_000,), generator=torch.Generator().manual_seed(0))
    seq, g = 32, 7
    n = (tokens.numel() - 1) // seq
    assert n == 312 and n % g == 4
    walked = Loader(tokens, seq, g, seed=5)
    starts = torch.cat([walked._starts(k) for k in range(2 * n // g + 1)])
    assert sorted(starts[:n].tolist()) == list(range(0, n * seq, seq))
    assert sorted(starts[n:2 * n].tolist()) == list(range(0, n * seq, seq))
    assert not torch.equal(starts[:n], starts[n:2 * n])  # a fresh permutation per epoch
    fresh = Loader(tokens, seq, g, seed=5)
    x, y = fresh.global_batch_at(n // g)
    assert torch.equal(fresh._starts(n // g), starts[n // g * g:(n // g + 1) * g])
    for row, s in zip(range(g), starts[n // g * g:(n // g + 1) * g].tolist()):
        assert torch.equal(x[row], tokens[s:s + seq]) and torch.equal(y[row], tokens[s + 1:s + seq + 1])


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
