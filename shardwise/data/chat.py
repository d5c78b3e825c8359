"""Chat records for SFT (`prepare-data --format chat`): `messages` rendered by the tokenizer's own chat template.

The template is the model folder's `chat_template.jinja` (what transformers 5 writes) or tokenizer_config.json's
`chat_template` (a string, or a list of named templates whose "default" is taken), rendered with jinja2 the way
transformers' `apply_chat_template` does — a sandbox with trim_blocks / lstrip_blocks, loop controls, its `tojson`,
`raise_exception`, `strftime_now`, and the named special tokens (bos_token, eos_token, ...) as variables — so the
rendered text, tokenized without special tokens, is token for token what transformers gives. jinja2 comes with torch
(the base install); transformers is not needed.

Loss is on the assistant's tokens only. Their characters are the template's `{% generation %}` blocks where it has
them, else found by rendering each conversation's beginning: the assistant message i spans from the end of
messages[:i] rendered with the generation prompt to the end of messages[:i+1] (its closing tokens included, so the
model learns to stop). A template whose beginnings are not prefixes of the whole conversation is refused.
"""
from __future__ import annotations

import datetime
import json
import os
import re

from ..config import ConfigError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def find_template(folder: str) -> str | None:
    """The chat template beside a tokenizer.json: chat_template.jinja, else tokenizer_config.json's."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(folder, "tokenizer_config.json")).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _environment(tracker: dict):
    """transformers' chat-template environment. While `tracker` holds "pieces" (the chunks rendered so far) and
    "spans", each `{% generation %}` block appends its (start, end) characters to "spans", as transformers'
    AssistantTracker does."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if tracker.get("pieces") is not None:  # rendering is lazy: every chunk before this block is in pieces
                start = len("".join(tracker["pieces"]))
                tracker["spans"].append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f))
    return env


class ChatTemplate:
    """A tokenizer folder's chat template, compiled once."""

    def __init__(self, folder: str, source: str):
        template = find_template(folder)
        if template is None:
            raise ConfigError(f"--format chat: --tokenizer {source!r} has no chat template (no chat_template.jinja, "
                              "no tokenizer_config.json chat_template); valid: a tokenizer folder that has one")
        try:
            import jinja2
        except ImportError:
            raise ConfigError("--format chat renders the chat template with jinja2, which is not installed: "
                              "pip install jinja2") from None
        self._tracker: dict = {}
        try:
            self.template = _environment(self._tracker).from_string(template)
        except jinja2.TemplateError as e:
            raise ConfigError(f"--format chat: the chat template of {source!r} does not compile ({e})") from None
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        config.update({k: v for k, v in _read_json(os.path.join(folder, "special_tokens_map.json")).items()
                       if k not in config})
        self.special = {}
        for name in SPECIAL_TOKENS:
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                self.special[name] = value
        self.tracks = re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.special)

    def render_with_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the character spans of the assistant's turns)."""
        import jinja2

        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as transformers drops them
        try:
            if self.tracks:
                return self._tracked(messages)
            text, spans = self.render(messages), []
            for i, m in enumerate(messages):
                if m.get("role") != "assistant":
                    continue
                before = self.render(messages[:i], add_generation_prompt=True)
                upto = self.render(messages[:i + 1])
                if not (upto.startswith(before) and text.startswith(upto)):
                    raise ConfigError(f"{where}: the chat template does not render the conversation up to message "
                                      f"{i} as the beginning of the whole, so the assistant's tokens cannot be "
                                      "found; valid: a template with {% generation %} blocks, or one whose "
                                      "renderings of a conversation's beginnings are its prefixes")
                if len(upto) > len(before):
                    spans.append((len(before), len(upto)))
            return text, spans
        except jinja2.TemplateError as e:
            raise ConfigError(f"{where}: the chat template refuses this conversation ({e})") from None

    def _tracked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """Spans from the template's `{% generation %}` blocks."""
        pieces, spans = [], []
        self._tracker.update(pieces=pieces, spans=spans)
        try:
            for chunk in self.template.generate(messages=messages, tools=None, documents=None,
                                                add_generation_prompt=False, **self.special):
                pieces.append(chunk)
        finally:
            self._tracker.clear()
        return "".join(pieces), spans


class Conversation(list):
    """One chat record's messages, with where it was read (for errors raised while it is rendered)."""

    def __init__(self, messages: list[dict], where: str):
        super().__init__(messages)
        self.where = where


def read_messages(obj, where: str) -> Conversation:
    """A record's `messages`: a non-empty list of {role, content} objects with string roles."""
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list) or not messages:
        keys = ", ".join(sorted(obj)) if isinstance(obj, dict) else type(obj).__name__
        raise ConfigError(f"{where}: --format chat needs a non-empty 'messages' list of {{role, content}} objects; "
                          f"found: {keys or 'none'}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ConfigError(f"{where}: every message must be an object with a string 'role' and a 'content'; "
                              f"got {json.dumps(m, default=str)[:80]}")
    return Conversation(messages, where)
