"""`shardwise prepare-data`: text, JSON lines or Parquet in; token shards, a document index and a
manifest out (format in shards.py).

The parent process reads documents in order and hands batches to worker processes, which tokenize
(`encode_batch`) and return numpy arrays; the parent writes them in input order, so the output does
not depend on --workers. Each document is followed by the end-of-document id (unless --no-eos).
Records with `prompt` + `completion` (and no text key) are SFT examples: their loss mask is 0 on the
prompt and 1 on the completion and its EOS, so training counts only completion tokens. With `--format chat`
records hold `messages`, rendered by the tokenizer's chat template (chat.py): the mask is 1 on the assistant's
tokens (and the EOS after a conversation that ends with one), 0 elsewhere.
"""
from __future__ import annotations

import errno
import fnmatch
import glob
import gzip
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator

import numpy as np

from ..config import ConfigError
from ..paths import check_writable
from .chat import ChatTemplate, Conversation, read_messages
from .shards import ShardWriter, dtype_for
from .tokenizer import load_tokenizer

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
FORMATS = ("text", "chat")
WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO}
"""The filesystem refusing the output: one line (the input side's errors are said where they are read)."""
BATCH_CHARS = 1 << 20  # text per work item: large enough to amortise the hand-off between processes


def resolve_inputs(inputs: list[str], globs: list[str] | None = None) -> list[str]:
    """Files, directories (searched recursively) and globs → the sorted list of input files.

    `globs` (`--glob '*.py'`): file-name patterns that select a directory's files and make any matching file
    plain text, one document per file (code corpora); without them only .txt / .jsonl / .parquet are read."""
    globs = list(globs or [])

    def text_by_glob(path: str) -> bool:
        return any(fnmatch.fnmatch(os.path.basename(path), g) or fnmatch.fnmatch(path, g) for g in globs)

    files: list[str] = []
    for spec in inputs:
        if any(c in spec for c in "*?["):
            found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not found:
                raise ConfigError(f"input {spec!r} matches no file")
        elif os.path.isdir(spec):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(spec) for f in fs
                           if (text_by_glob(f) if globs else f.endswith(SUFFIXES)))
            if not found:
                raise ConfigError(f"input directory {spec!r} holds no "
                                  f"{' / '.join(globs) if globs else ', '.join(SUFFIXES)} file")
        elif os.path.isfile(spec):
            found = [spec]
        else:
            raise ConfigError(f"input {spec!r}: no such file or directory")
        for p in found:
            if not p.endswith(SUFFIXES) and not text_by_glob(p):
                raise ConfigError(f"input {p!r} has an unsupported type; valid: {', '.join(SUFFIXES)}, or any text "
                                  "file selected with --glob PATTERN (e.g. --glob '*.py')")
            if not os.access(p, os.R_OK):
                raise ConfigError(f"input {p!r} is not readable (permission denied)")
        files.extend(found)
    return list(dict.fromkeys(files))


def _record(obj, text_key: str | None, where: str):
    """A JSON object or Parquet row → a text (str), an SFT pair (prompt, completion), or with `text_key` None
    (--format chat) a Conversation."""
    if text_key is None:
        return read_messages(obj, where)
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if text_key in obj:
        val = obj[text_key]
        if not isinstance(val, str):
            raise ConfigError(f"{where}: {text_key!r} is {type(val).__name__}, not a string")
        return val
    if "prompt" in obj and "completion" in obj:
        pair = obj["prompt"], obj["completion"]
        if not all(isinstance(v, str) for v in pair):
            raise ConfigError(f"{where}: 'prompt' and 'completion' must be strings")
        return pair
    raise ConfigError(f"{where}: no {text_key!r} key (nor 'prompt' + 'completion'); keys: "
                      f"{', '.join(sorted(obj)) or 'none'} (choose one with --text-key)")


def read_documents(path: str, text_key: str | None) -> Iterator[str | tuple[str, str] | Conversation]:
    """A file's documents; `text_key` None reads chat records (--format chat)."""
    try:
        if path.endswith(".parquet"):
            yield from _read_parquet(path, text_key)
        elif path.endswith((".jsonl", ".jsonl.gz")):
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from None
                    yield _record(obj, text_key, f"{path}:{lineno}")
        elif text_key is None:
            raise ConfigError(f"input {path!r} is plain text; --format chat reads .jsonl / .jsonl.gz / .parquet "
                              "records with a 'messages' list")
        else:  # .txt, or any file a --glob pattern selected: the whole file is one document
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
    except (OSError, EOFError) as e:  # unreadable file, truncated or corrupt gzip
        raise ConfigError(f"input {path!r} cannot be read ({getattr(e, 'strerror', None) or e})") from None


def _read_parquet(path: str, text_key: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except pa.ArrowException as e:
        raise ConfigError(f"input {path!r} is not a readable Parquet file ({e})") from None
    cols = pf.schema_arrow.names
    want = ["messages"] if text_key is None else [text_key] if text_key in cols else ["prompt", "completion"]
    if text_key is None and "messages" not in cols:
        raise ConfigError(f"{path}: --format chat needs a 'messages' column; columns: {', '.join(cols)}")
    if not set(want) <= set(cols):
        raise ConfigError(f"{path}: no {text_key!r} column (nor 'prompt' + 'completion'); columns: "
                          f"{', '.join(cols)} (choose one with --text-key)")
    row = 0
    for batch in pf.iter_batches(columns=want, batch_size=8192):
        for rec in batch.to_pylist():
            row += 1
            yield _record(rec, text_key, f"{path} row {row}")


def _chars(doc) -> int:
    if isinstance(doc, str):
        return len(doc)
    if isinstance(doc, Conversation):
        return sum(len(str(m.get("content", ""))) for m in doc)
    return len(doc[0]) + len(doc[1])


def _batches(files: list[str], text_key: str | None) -> Iterator[list]:
    batch, chars = [], 0
    for path in files:
        for doc in read_documents(path, text_key):
            batch.append(doc)
            chars += _chars(doc)
            if chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


_WORKER = {}


def chat_template(tok, spec: str) -> ChatTemplate:
    """The chat template beside `tok`'s tokenizer.json; ConfigError for the byte tokenizer (it has none)."""
    if tok.kind == "byte":
        raise ConfigError("--format chat renders records with the tokenizer's chat template; --tokenizer byte has "
                          "none: pass --tokenizer with a Hugging Face model folder whose tokenizer has a chat template")
    return ChatTemplate(os.path.dirname(os.path.abspath(tok.json_path)), spec)


def _init_worker(spec: str, no_eos: bool, dtype: str, pool: bool = False, chat: bool = False) -> None:
    if pool:  # the processes are the parallelism: no tokenizer thread pool inside each
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(spec, no_eos)
    _WORKER.update(tok=tok, no_eos=no_eos, dtype=np.dtype(dtype), chat=chat_template(tok, spec) if chat else None)


def encode_conversation(doc: Conversation) -> tuple[list[int], np.ndarray]:
    """A chat record → its token ids (the rendered text without special tokens, as apply_chat_template) and the
    loss mask: 1 on every token overlapping an assistant span (transformers' rule for its assistant mask)."""
    text, spans = _WORKER["chat"].render_with_spans(doc, doc.where)
    enc = _WORKER["tok"].tok.encode(text, add_special_tokens=False)
    mask = np.zeros(len(enc.ids), np.uint8)
    for i, (start, end) in enumerate(enc.offsets):
        mask[i] = any(start < hi and end > lo for lo, hi in spans)
    return enc.ids, mask


def encode_documents(docs: list) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One work item → (concatenated tokens, per-document lengths, loss mask or None when no SFT record)."""
    tok, dtype = _WORKER["tok"], _WORKER["dtype"]
    eos = None if _WORKER["no_eos"] else tok.eos_id
    if _WORKER.get("chat") is not None:
        return _encode_chats(docs, eos, dtype)
    sft = [i for i, d in enumerate(docs) if not isinstance(d, str)]
    texts = [d if isinstance(d, str) else d[0] for d in docs]
    ids = tok.encode_batch(texts)
    completions = dict(zip(sft, tok.encode_batch([docs[i][1] for i in sft]))) if sft else {}
    tail = [] if eos is None else [np.array([eos], dtype)]
    pieces, lengths, masks = [], np.empty(len(docs), np.int64), []
    for i, a in enumerate(ids):
        parts = [np.asarray(a, dtype)] + ([np.asarray(completions[i], dtype)] if i in completions else []) + tail
        pieces.extend(parts)
        lengths[i] = sum(len(p) for p in parts)
        if sft:  # prompt tokens 0; completion and its EOS 1; plain documents all 1
            masks.append(np.zeros(len(parts[0]), np.uint8) if i in completions else np.ones(len(parts[0]), np.uint8))
            masks.append(np.ones(int(lengths[i]) - len(parts[0]), np.uint8))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    return tokens, lengths, (np.concatenate(masks) if sft else None)


def _encode_chats(docs: list[Conversation], eos: int | None, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pieces, lengths, masks = [], np.empty(len(docs), np.int64), []
    for i, doc in enumerate(docs):
        ids, mask = encode_conversation(doc)
        pieces.append(np.asarray(ids, dtype))
        masks.append(mask)
        if eos is not None:  # counted after an assistant's last turn: the model learns to end the document there
            pieces.append(np.array([eos], dtype))
            masks.append(np.array([doc[-1].get("role") == "assistant"], np.uint8))
        lengths[i] = len(ids) + (eos is not None)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    return tokens, lengths, (np.concatenate(masks) if masks else np.zeros(0, np.uint8))


def prepare_data(inputs: list[str], tokenizer: str, out: str, text_key: str = "text", workers: int = 1,
                 no_eos: bool = False, shard_tokens: int = 1 << 27, progress: bool = True,
                 globs: list[str] | None = None, fmt: str = "text", debug: bool = False) -> dict:
    """Tokenize `inputs` into `out`; returns the manifest. Errors raise ConfigError and leave nothing at `out`:
    a filesystem that refuses the shards midway (full disk, quota, read-only) too, unless `debug` (--debug: the
    original error). `fmt` "chat" reads `messages` records (the module's docstring)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is unknown; valid: {', '.join(FORMATS)}")
    files = resolve_inputs(inputs, globs)
    tok = load_tokenizer(tokenizer, no_eos)
    chat = fmt == "chat"
    if chat:
        chat_template(tok, tokenizer)  # no template: refused before anything is written
        text_key = None
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"--out {out!r} already exists and is not empty; choose a new directory")
    if workers < 1 or shard_tokens < 1:
        raise ConfigError(f"--workers {workers} / --shard-tokens {shard_tokens} must be positive")
    dtype = dtype_for(tok.vocab_size)
    parent = os.path.dirname(os.path.abspath(out))
    check_writable(parent, "--out", shown=out)  # the shards are written beside it, then renamed into place
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        writer = ShardWriter(tmp, dtype, shard_tokens)
        _run(files, text_key, tokenizer, no_eos, dtype, workers, writer, progress, chat)
        if writer.tokens == 0:
            raise ConfigError(f"the corpus is empty: {len(files)} input file(s) hold no document with text")
        manifest = writer.finish({"tokenizer_kind": tok.kind, "tokenizer": os.path.abspath(tokenizer)
                                  if tok.kind != "byte" else "byte", "tokenizer_sha256": tok.sha256,
                                  "tokenizer_fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size, "eos_id": None if no_eos else tok.eos_id,
                                  "inputs": [os.path.abspath(f) for f in files], "records": fmt})
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above): the rename below needs the name free
        os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if debug or not isinstance(e, OSError) or e.errno not in WRITE_ERRORS:
            raise
        what = f"{e.strerror} ({e.filename})" if e.filename else e.strerror
        raise ConfigError(f"--out {out}: writing the shards failed: {what}; the partial output was removed, "
                          "nothing is left at --out; free space or choose another --out") from e
    return manifest


def _run(files, text_key, spec, no_eos, dtype, workers, writer: ShardWriter, progress: bool, chat: bool) -> None:
    shown = Progress(progress)
    try:
        if workers == 1:
            _init_worker(spec, no_eos, dtype, chat=chat)
            for tokens, lengths, mask in map(encode_documents, _batches(files, text_key)):
                writer.add(tokens, lengths, mask)
                shown.update(len(tokens), len(lengths))
            return
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers, _init_worker, (spec, no_eos, dtype, True, chat)) as pool:
            for tokens, lengths, mask in pool.imap(encode_documents, _batches(files, text_key)):
                writer.add(tokens, lengths, mask)
                shown.update(len(tokens), len(lengths))
    finally:
        shown.close()


class Progress:
    """prepare-data's progress on stderr: a tqdm bar on a terminal; elsewhere (a job's log file, where a bar is a
    stream of carriage returns) one `prepare-data documents=N tokens=N tokens_per_s=N` line every `every_s`
    seconds, as `train` prints its lines (training/console.py)."""

    def __init__(self, enabled: bool = True, every_s: float = 30.0, stream=None):
        self.stream = stream or sys.stderr
        self.enabled, self.every_s, self.tokens, self.documents = enabled, every_s, 0, 0
        self.start = self.last = time.monotonic()
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(unit="tok", unit_scale=True, desc="prepare-data", dynamic_ncols=True, file=self.stream)

    def update(self, tokens: int, documents: int) -> None:
        self.tokens += tokens
        self.documents += documents
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(tokens)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float) -> str:
        rate = self.tokens / max(now - self.start, 1e-9)
        return f"prepare-data documents={self.documents} tokens={self.tokens} tokens_per_s={rate:.0f}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
