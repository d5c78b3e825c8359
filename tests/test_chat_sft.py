"""`prepare-data --format chat`: `messages` records rendered by the tokenizer's own chat template are token for token
transformers' `apply_chat_template`, the loss mask is 1 on the assistant's tokens only (equal to transformers' own
assistant mask for a template with {% generation %} blocks, and found without them), documents are packed with an
EOS each; a template from tokenizer_config.json works like chat_template.jinja; mistakes exit 2 with one line."""
import json
import os

import numpy as np
import pytest

from shardwise.cli import main
from shardwise.config import ConfigError
from shardwise.data.prepare import prepare_data
from shardwise.data.shards import PreparedData

transformers = pytest.importorskip("transformers")

WORDS = "the quick brown fox jumps over a lazy dog while wizards pack boxes".split()
CHATML = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# the same text, the assistant's part marked for transformers' return_assistant_tokens_mask
TRACKED = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
           "{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
           "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATS = [
    [{"role": "system", "content": "you pack boxes"}, {"role": "user", "content": "the quick fox?"},
     {"role": "assistant", "content": "jumps over a lazy dog"}],
    [{"role": "user", "content": "wizards pack"}, {"role": "assistant", "content": "boxes while the dog"},
     {"role": "user", "content": "and the fox?"}, {"role": "assistant", "content": "quick brown", "name": None}],
    [{"role": "user", "content": "a conversation that ends with the user"}],
]


def _tokenizer(folder, template, in_config=False):
    """A byte-level BPE with ChatML's added tokens, saved by transformers with `template` (chat_template.jinja), or
    with the template written into tokenizer_config.json (older transformers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<s>",
                                                unk_token="<unk>", chat_template=template)
    fast.save_pretrained(folder)
    if in_config:
        os.remove(os.path.join(folder, "chat_template.jinja"))
        path = os.path.join(folder, "tokenizer_config.json")
        config = json.load(open(path))
        json.dump(config | {"chat_template": template}, open(path, "w"))
    return transformers.AutoTokenizer.from_pretrained(folder)


def _documents(folder):
    """[(token ids, loss mask)] of each document of a prepared directory."""
    d = PreparedData(folder)
    toks, mask = d.read([0], d.n_tokens)[0], d.read([0], d.n_tokens, mask=True)[0]
    starts = list(np.load(os.path.join(folder, "documents.npy"))) + [d.n_tokens]
    return [(toks[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(starts, starts[1:])]


def _write(path, records):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    return str(path)


@pytest.mark.parametrize("template,in_config", [(CHATML, False), (TRACKED, False), (CHATML, True)],
                         ids=["chatml", "generation-blocks", "tokenizer_config"])
def test_chat_records_equal_apply_chat_template_and_mask_the_assistant(tmp_path, template, in_config):
    hf = _tokenizer(str(tmp_path / "tok"), template, in_config)
    reference = _tokenizer(str(tmp_path / "ref"), TRACKED)  # transformers' own assistant mask
    data = str(tmp_path / "data")
    m = prepare_data([_write(tmp_path / "chats.jsonl", CHATS)], str(tmp_path / "tok"), data, progress=False, fmt="chat")
    assert m["loss_mask"] and m["documents"] == len(CHATS) and m["records"] == "chat"
    eos = hf.convert_tokens_to_ids("<|endoftext|>")
    for chat, (ids, mask) in zip(CHATS, _documents(data)):
        want = hf.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        ref = reference.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(want) + [eos] and list(ref["input_ids"]) == list(want)
        ends_with_answer = chat[-1]["role"] == "assistant"
        assert mask == list(ref["assistant_masks"]) + [int(ends_with_answer)], (chat, mask)
        answers = "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant")
        assert hf.decode([t for t, k in zip(ids, mask) if k]) == answers + ("<|endoftext|>" if ends_with_answer else "")


def test_chat_mistakes_exit_2_with_one_line(tmp_path, capsys):
    _tokenizer(str(tmp_path / "tok"), CHATML)
    plain = tmp_path / "plain"
    plain.mkdir()
    _tokenizer(str(plain), None)
    good = _write(tmp_path / "chats.jsonl", CHATS)
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "no messages"}) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"content": "no role"}]}) + "\n")
    (tmp_path / "a.txt").write_text("plain text")
    cases = [([good, "--tokenizer", "byte"], "--tokenizer byte has none"),
             ([good, "--tokenizer", str(tmp_path / "tok"), "--format", "chats"], "--format 'chats' is unknown; valid: "
                                                                              "text, chat"),
             ([good, "--tokenizer", str(plain)], f"--tokenizer {str(plain)!r} has no chat template"),
             ([str(tmp_path / "text.jsonl"), "--tokenizer", str(tmp_path / "tok")], "needs a non-empty 'messages' list"),
             ([str(tmp_path / "bad.jsonl"), "--tokenizer", str(tmp_path / "tok")], "a string 'role'"),
             ([str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "tok")], "is plain text; --format chat reads")]
    capsys.readouterr()
    for i, (argv, message) in enumerate(cases):
        out = str(tmp_path / f"out{i}")
        assert main(["prepare-data", "--format", "chat", *argv, "--out", out, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
        assert not os.path.exists(out)
    # a template whose beginnings are not prefixes of the whole (it numbers turns from the end) cannot be masked
    odd = "{% for m in messages %}{{ (messages|length - loop.index)|string + m['content'] }}{% endfor %}"
    _tokenizer(str(tmp_path / "odd"), odd)
    with pytest.raises(ConfigError, match=r"chats.jsonl:1: the chat template does not render the conversation up to "
                                          r"message 2 as the beginning of the whole"):
        prepare_data([good], str(tmp_path / "odd"), str(tmp_path / "odd_out"), progress=False, fmt="chat")
