"""prepare-data (inputs, tokenizers, shards, manifest), the memory-mapped loader and blends, SFT loss
masks on several layouts, and every bad input exiting 2 with one line."""
import gzip
import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch

from shardwise.cli import main
from shardwise.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from shardwise.training.assemble import assemble, resolve_model
from shardwise.data import EOS, Loader, open_data
from shardwise.data.loader import blend_assign, permute
from shardwise.data.prepare import prepare_data
from shardwise.data.shards import PreparedData, ShardWriter, dtype_for

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of liquor "
         "and jugs near the river bank under a pale moon shardwise trains tokens").split()


def _texts(n, seed, length=40):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(length // 2, length))) for _ in range(n)]


def _bpe(folder, eos=True):
    """A small BPE trained here, saved as a Hugging Face-style model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = ["<unk>"] + (["<|endoftext|>"] if eos else [])
    tok.train_from_iterator(_texts(200, 0), trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    if eos:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": {"content": "<|endoftext|>"}}, f)
    return tok


def _corpus(root):
    """The same kinds of input prepare-data takes: .txt, .jsonl, .jsonl.gz, .parquet (plain text only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _texts(12, 1)
    os.makedirs(root / "txt")
    for i, d in enumerate(docs[:3]):
        (root / "txt" / f"{i}.txt").write_text(d)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": 1}) + "\n" for d in docs[3:6]) + "\n")
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[6:9])
    pq.write_table(pa.table({"text": docs[9:]}), root / "c.parquet")
    return [str(root / "txt"), str(root / "a.jsonl"), str(root / "*.jsonl.gz"), str(root / "c.parquet")], docs


def _stream(folder):
    d = PreparedData(str(folder))
    return d, d.read([0], d.n_tokens)[0], (d.read([0], d.n_tokens, mask=True)[0] if d.masked else None)


def test_prepare_inputs_tokenizers_and_manifest(tmp_path):
    inputs, docs = _corpus(tmp_path)
    bpe = _bpe(tmp_path / "model")
    for spec, enc, eos in (("byte", lambda t: list(t.encode()), EOS),
                           (str(tmp_path / "model"), lambda t: bpe.encode(t, add_special_tokens=False).ids,
                            bpe.token_to_id("<|endoftext|>"))):
        out = tmp_path / f"out-{len(os.listdir(tmp_path))}"
        m = prepare_data(inputs, spec, str(out), shard_tokens=97, progress=False)
        want = [t for d in docs for t in enc(d) + [eos]]
        data, toks, mask = _stream(out)
        assert toks.tolist() == want and mask is None and data.eos_id == eos
        assert m["tokens"] == len(want) and m["documents"] == len(docs) and m["dtype"] == "uint16"
        assert m["vocab_size"] == (257 if spec == "byte" else bpe.get_vocab_size()) and len(m["shards"]) > 2
        starts = np.load(out / "documents.npy")
        assert starts.tolist() == np.cumsum([0] + [len(enc(d)) + 1 for d in docs[:-1]]).tolist()
        for s in m["shards"]:
            assert hashlib.sha256((out / s["file"]).read_bytes()).hexdigest() == s["sha256"]
        assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # the temporary was renamed into place
    # two worker processes write the same bytes; --no-eos drops the separators
    m2 = prepare_data(inputs, str(tmp_path / "model"), str(tmp_path / "w2"), workers=2, shard_tokens=97,
                      progress=False)
    assert [s["sha256"] for s in m2["shards"]] == [s["sha256"] for s in m["shards"]]
    m3 = prepare_data(inputs, "byte", str(tmp_path / "noeos"), no_eos=True, progress=False)
    assert m3["eos_id"] is None and _stream(tmp_path / "noeos")[1].tolist() == [b for d in docs for b in d.encode()]
    # a tokenizer.json without an eos token is refused unless --no-eos
    _bpe(tmp_path / "plain", eos=False)
    with pytest.raises(ConfigError, match="no eos token.*--no-eos"):
        prepare_data(inputs, str(tmp_path / "plain" / "tokenizer.json"), str(tmp_path / "x"), progress=False)
    assert not (tmp_path / "x").exists()
    prepare_data(inputs, str(tmp_path / "plain" / "tokenizer.json"), str(tmp_path / "x"), no_eos=True, progress=False)
    # more than 65536 ids → uint32 shards, read back exactly
    assert dtype_for(65536) == "uint16" and dtype_for(65537) == "uint32"
    (tmp_path / "big").mkdir()
    w = ShardWriter(str(tmp_path / "big"), "uint32", 5)
    ids = np.array([70000, 1, 2, 99999, 3, 4, 5], np.int64)
    w.add(ids, np.array([4, 3]), None)
    w.finish({"tokenizer_kind": "test", "tokenizer_sha256": "0", "vocab_size": 100000, "eos_id": None})
    assert _stream(tmp_path / "big")[1].tolist() == ids.tolist()


def _sft(root, n=40, seed=2):
    """prompt/completion records mixed with a few plain documents (those count in full)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, t in enumerate(_texts(n, seed, 30)):
        cut = int(rng.integers(5, len(t) - 5))
        rows.append({"text": t} if i % 7 == 3 else {"prompt": t[:cut], "completion": t[cut:]})
    path = root / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), rows


def test_sft_masks_written(tmp_path):
    path, rows = _sft(tmp_path)
    prepare_data([path], "byte", str(tmp_path / "sft"), shard_tokens=301, progress=False)
    data, toks, mask = _stream(tmp_path / "sft")
    want_t, want_m = [], []
    for r in rows:
        if "text" in r:
            want_t += list(r["text"].encode()) + [EOS]
            want_m += [1] * (len(r["text"].encode()) + 1)
        else:
            p, c = r["prompt"].encode(), r["completion"].encode()
            want_t += list(p) + list(c) + [EOS]
            want_m += [0] * len(p) + [1] * (len(c) + 1)
    assert toks.tolist() == want_t and mask.tolist() == want_m


def test_loader_memmap_equals_in_memory_and_reads_only_its_rows(tmp_path):
    inputs, _ = _corpus(tmp_path)
    prepare_data(inputs, "byte", str(tmp_path / "d"), shard_tokens=53, progress=False)  # windows cross shards
    data, toks, _ = _stream(tmp_path / "d")
    mm = Loader(open_data(str(tmp_path / "d")), 16, 6, seed=3)
    mem = Loader(torch.from_numpy(toks), 16, 6, seed=3)
    assert mm.eos_id == EOS == data.eos_id  # what document masking splits windows at
    for step in (0, 1, 37):  # 37: several epochs later; the loader is a pure function of the step
        x, y = mm.global_batch_at(step)
        assert torch.equal(x, mem.global_batch_at(step)[0]) and torch.equal(y, mem.global_batch_at(step)[1])
        assert torch.equal(torch.cat([mm.batch_at(step, 0, 2)[0], mm.batch_at(step, 2, 6)[0]]), x)
        assert mm.count_targets(step) == 6 * 16
    reads = []
    real = data.read
    data.read = lambda starts, n, mask=False: reads.append(len(starts)) or real(starts, n, mask)
    Loader(([data], [1.0]), 16, 6, seed=3).batch_at(5, 2, 4)
    assert reads == [2]


def test_permutation_and_blend_are_closed_formulas():
    """Each epoch's permutation is a bijection evaluated pointwise (no table: a 2^40-window source costs
    nothing); a blend's shares are exact to one sample at every prefix, and each source is read in order."""
    for n in (1, 2, 7, 64, 1000):
        assert sorted(permute(np.arange(n), n, key=5).tolist()) == list(range(n))
    assert not np.array_equal(permute(np.arange(1000), 1000, 5), permute(np.arange(1000), 1000, 6))
    huge = permute(np.arange(10**6, 10**6 + 8), 1 << 40, key=1)
    assert len(set(huge.tolist())) == 8 and (huge < 1 << 40).all()
    w = [0.5, 0.3, 0.2]
    src, local = blend_assign(np.arange(1000), w, theta=0.37)
    for j, wj in enumerate(w):
        counts = np.cumsum(src == j)
        assert np.abs(counts - wj * np.arange(1, 1001)).max() <= 2
        assert local[src == j].tolist() == list(range(int((src == j).sum())))
    s2, l2 = blend_assign(np.arange(500, 700), w, theta=0.37)
    assert np.array_equal(s2, src[500:700]) and np.array_equal(l2, local[500:700])


def _plain_dir(tmp_path, name, seed, spec="byte", no_eos=False):
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(30, seed)))
    out = tmp_path / name
    prepare_data([str(tmp_path / f"{name}.jsonl")], spec, str(out), no_eos=no_eos, progress=False)
    return str(out)


def test_blend_of_prepared_dirs(tmp_path):
    a, b = _plain_dir(tmp_path, "a", 4), _plain_dir(tmp_path, "b", 5)
    loader = Loader(open_data(f"{a}:0.7,{b}:0.3"), 16, 10, seed=1)
    streams = [_stream(p)[1] for p in (a, b)]
    seen = {0: 0, 1: 0}
    for step in range(5):
        x, _ = loader.global_batch_at(step)
        src, starts = loader._rows(step, 0, 10)
        for row, j, s in zip(x, src.tolist(), starts.tolist()):  # each row is a window of its own source
            seen[j] += 1
            assert np.array_equal(streams[j][s:s + 16], row.numpy())
    assert abs(seen[0] - 35) <= 1 and seen[0] + seen[1] == 50
    assert torch.equal(loader.global_batch_at(3)[0], Loader(open_data(f"{a}:7,{b}:3"), 16, 10, 1).global_batch_at(3)[0])
    c = _plain_dir(tmp_path, "c", 6, no_eos=True)  # packed without separators: its documents would merge
    with pytest.raises(ConfigError, match=r"different end-of-document ids .*c: none \(--no-eos\).*all with --no-eos"):
        open_data(f"{a}:0.5,{c}:0.5")


def _sft_cfg(data, **par):
    model = ModelConfig(name="sft", vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                        max_seq_len=64)
    return TrainConfig(model=model, parallel=ParallelConfig(**par), steps=2, seq_len=32, micro_batch=2,
                       global_batch=4, data=data, progress=False, lr=1e-3)


def _sft_layouts(data):
    from tests._dist import verify_all

    return verify_all([_sft_cfg(data, dp=2, tp=2), _sft_cfg(data, pp=2, dp=2)])


def test_sft_loss_counts_only_completions_on_every_layout(tmp_path):
    path, _ = _sft(tmp_path, n=60)
    data = str(tmp_path / "sft")
    prepare_data([path], "byte", data, shard_tokens=500, progress=False)
    from shardwise.mesh import Mesh
    from shardwise.training.trainer import Trainer

    cfg = assemble(_sft_cfg(data), 1)
    trainer = Trainer(cfg, Mesh.single(torch.device("cpu")))
    # hand computation: windows from the raw shards, the mask of each target from the mask shard
    d, toks, mask = _stream(data)
    starts = trainer.loader._starts(0).tolist()
    x = torch.tensor(np.stack([toks[s:s + 32] for s in starts]))
    tgt = torch.tensor(np.stack([toks[s + 1:s + 33] for s in starts]))
    keep = torch.tensor(np.stack([mask[s + 1:s + 33] for s in starts])).bool()
    assert 0 < int(keep.sum()) < keep.numel()  # the windows hold prompt tokens that must not count
    with torch.no_grad():
        logits = trainer.model(x)
        per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                      tgt.reshape(-1), reduction="none")
    want = float(per_token[keep.reshape(-1)].mean())
    assert trainer.loader.count_targets(0) == int(keep.sum())
    assert abs(trainer.forward_backward(0) - want) < 1e-5 * max(1, want)
    assert abs(float(per_token.mean()) - want) > 1e-3  # counting prompt tokens would give another loss
    from tests._dist import run_ranks

    results = run_ranks(4, _sft_layouts, data)[0]
    for r in results:
        assert r["passed"], r


def _cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "badline.jsonl").write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    (tmp_path / "nokey.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    (tmp_path / "notparquet.parquet").write_bytes(b"PAR1 no")
    cases = [
        (["missing.txt"], {}, "no such file or directory"),
        ([str(tmp_path / "badline.jsonl")], {}, "badline.jsonl:2: malformed JSON"),
        ([str(tmp_path / "nokey.jsonl")], {}, "nokey.jsonl:1: no 'text' key"),
        ([str(tmp_path / "broken.jsonl.gz")], {}, "cannot be read"),
        ([str(tmp_path / "notparquet.parquet")], {}, "not a readable Parquet"),
        ([str(good)], {"--tokenizer": "gpt9"}, "--tokenizer 'gpt9' is unknown"),
        ([str(tmp_path / "empty.jsonl")], {}, "corpus is empty"),
        ([str(tmp_path / "*.csv")], {}, "matches no file"),
    ]
    for inputs, flags, msg in cases:
        out = tmp_path / "never"
        code, err = _cli(capsys, "prepare-data", *inputs, "--out", str(out), "--no-progress",
                         *[a for kv in flags.items() for a in kv])
        assert code == 2 and len(err) == 1 and msg in err[0], (inputs, err)
        assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    # a failure after shards were written (the bad line is in the second file) leaves nothing behind,
    # also when the reading feeds worker processes
    for workers in ("1", "2"):
        code, err = _cli(capsys, "prepare-data", str(good), str(tmp_path / "badline.jsonl"), "--out",
                         str(tmp_path / "o"), "--no-progress", "--shard-tokens", "2", "--workers", workers)
        assert code == 2 and "badline.jsonl:2" in err[-1] and not (tmp_path / "o").exists()
        assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]

    data = _plain_dir(tmp_path, "d", 6)
    train = ["train", "--dp", "1", "--steps", "1", "--seq-len", "16", "--no-progress", "--no-report",
             "--out", str(tmp_path / "run")]
    half = tmp_path / "half"
    shutil.copytree(data, half)
    os.remove(half / "manifest.json")
    altered = tmp_path / "altered"
    shutil.copytree(data, altered)
    raw = bytearray((altered / "tokens-00000.bin").read_bytes())
    raw[10] ^= 1
    (altered / "tokens-00000.bin").write_bytes(bytes(raw))
    short = tmp_path / "short"
    shutil.copytree(data, short)
    (short / "tokens-00000.bin").write_bytes((short / "tokens-00000.bin").read_bytes()[:-2])
    for spec, msg in ((str(half), "no manifest.json"), (str(altered), "tokens-00000.bin has sha256"),
                      (str(short), "missing or not"), (f"{data}:0.5,{data}:x", "DIR:WEIGHT"),
                      (f"{data}:0.5,{tmp_path / 'nope'}:0.5", "not a prepared directory"),
                      (str(tmp_path / "nope"), "no such file or directory")):
        code, err = _cli(capsys, *train, "--data", spec)
        assert code == 2 and len(err) == 1 and msg in err[0], (spec, err)
    # a model with its own vocabulary must cover the tokenizer's ids
    vocab = _bpe(tmp_path / "model").get_vocab_size()
    bpe_dir = _plain_dir(tmp_path, "bpe", 7, spec=str(tmp_path / "model"))
    small = ModelConfig(name="fixed", vocab_size=vocab - 1, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    with pytest.raises(ConfigError, match=f"tokenizer has {vocab} ids but model 'fixed' has vocab_size={vocab - 1}"):
        assemble(TrainConfig(model=small, data=bpe_dir), 1)
    assert resolve_model(TrainConfig(model="tiny", data=bpe_dir)).vocab_size == vocab
    assert resolve_model(TrainConfig(model="llama3-8b", data=bpe_dir)).vocab_size == 128256


def test_train_on_prepared_bpe_data_and_resume(tmp_path, capsys):
    """prepare → train on one process: the model's vocabulary follows the tokenizer, and a resumed run
    reproduces the uninterrupted one's losses bitwise (the data position is the step)."""
    vocab = _bpe(tmp_path / "model").get_vocab_size()
    a = _plain_dir(tmp_path, "a", 8, spec=str(tmp_path / "model"))
    b = _plain_dir(tmp_path, "b", 9, spec=str(tmp_path / "model"))
    base = ["train", "--dp", "1", "--seq-len", "16", "--micro-batch", "2", "--no-progress", "--no-report",
            "--model", "tiny", "--data", f"{a}:0.6,{b}:0.4", "--save-every", "2"]
    assert main([*base, "--steps", "4", "--out", str(tmp_path / "full")]) == 0
    shutil.rmtree(tmp_path / "full" / "checkpoints" / "step-4")  # resume from step 2
    assert main([*base, "--steps", "4", "--out", str(tmp_path / "resumed"), "--resume",
                 "--checkpoint-dir", str(tmp_path / "full" / "checkpoints")]) == 0
    cfg = json.loads((tmp_path / "full" / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == vocab != 257
    full, resumed = ([json.loads(x)["loss"] for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
                     for r in ("full", "resumed"))
    assert len(full) == 4 and full[2:] == resumed


def test_all_prompt_batch_and_raw_jsonl_are_refused(tmp_path):
    """A global batch whose every target is a masked prompt token would divide the loss by 0 (a NaN step
    blamed on the model); a .jsonl / .parquet file given to --data would train on its raw bytes."""
    class AllPrompt:  # a prepared source whose loss mask is all zeros
        n_tokens, masked, eos_id = 1000, True, EOS

        def read(self, starts, length, mask=False):
            return np.zeros((len(starts), length), dtype=np.uint8 if mask else np.int64)

    loader = Loader(([AllPrompt()], [1.0]), 16, 4, seed=0)
    with pytest.raises(ConfigError, match=r"step 2: no target of the global batch's 4 windows counts"):
        loader.count_targets(2)
    raw = tmp_path / "docs.jsonl"
    raw.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ConfigError, match=r"read as plain UTF-8 text; run `shardwise prepare-data"):
        open_data(str(raw))


def test_glob_reads_any_text_file_as_one_document(tmp_path, capsys):
    """`--glob '*.py'`: a code corpus — every matching file (directories searched recursively) is one plain-text
    document; other files in the directory are left out; without --glob such a file is refused."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    bodies = {"a.py": "def f():\n    return 1\n", "pkg/b.py": "x = 'é'\n", "pkg/c.pyi": "y: int\n"}
    for name, text in bodies.items():
        (src / name).write_text(text)
    (src / "notes.md").write_text("not code")
    code, err = _cli(capsys, "prepare-data", str(src / "a.py"), "--out", str(tmp_path / "no"), "--no-progress")
    assert code == 2 and len(err) == 1 and "--glob PATTERN" in err[0], err
    for inputs, globs, names in (([str(src)], ["*.py"], ["a.py", "pkg/b.py"]),
                                 ([str(src)], ["*.py", "*.pyi"], ["a.py", "pkg/b.py", "pkg/c.pyi"]),
                                 ([str(src / "**" / "*.py*")], ["*.py*"], ["a.py", "pkg/b.py", "pkg/c.pyi"])):
        out = tmp_path / f"out{len(globs)}{len(inputs[0])}"
        argv = ["prepare-data", *inputs, "--out", str(out), "--no-progress"]
        assert main(argv + [a for g in globs for a in ("--glob", g)]) == 0
        m = json.loads((out / "manifest.json").read_text())
        want = [t for n in names for t in [*bodies[n].encode(), EOS]]
        tokens = np.fromfile(out / m["shards"][0]["file"], dtype=m["dtype"]).tolist()
        assert m["documents"] == len(names) and tokens == want, (names, m, tokens)
