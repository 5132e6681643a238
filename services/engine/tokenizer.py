"""Text <-> token ids for a model directory (``tokenizer.json``), plus its chat template.

Uses the ``tokenizers`` library directly: fast, and free of transformers' import time.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from services.engine.model.source import ModelLoadError


class Tokenizer:
    """A fast tokenizer with the model's special tokens and chat template."""

    def __init__(self, model_dir: Path, extra_eos_token_ids: tuple[int, ...] = ()):
        from tokenizers import Tokenizer as FastTokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"model directory {str(model_dir)!r} has no tokenizer.json")
        self._tok = FastTokenizer.from_file(str(path))
        self.path = path
        config_path = Path(model_dir) / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.chat_template: str | None = config.get("chat_template")
        template_file = Path(model_dir) / "chat_template.jinja"  # where transformers 5 saves it
        if not self.chat_template and template_file.exists():
            self.chat_template = template_file.read_text()
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        eos = {self._tok.token_to_id(self.eos_token)} if self.eos_token else set()
        self.eos_token_ids: frozenset[int] = frozenset(
            t for t in eos | set(extra_eos_token_ids) if t is not None
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def vocab(self) -> dict[str, int]:
        """Every token's id, added tokens included (the grammar engine reads it)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: only the batch call lets go of the GIL while it works, so a
        # long text tokenized in a thread does not stall the event loop (the router's probes).
        encoding = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return encoding.ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprob ``bytes``). A token holding part of
        a multi-byte character decodes alone to U+FFFD; its real bytes come from its vocabulary
        entry instead: a byte-level BPE piece through GPT-2's byte alphabet, a byte-fallback
        piece (``<0xE3>``) as its byte. Joined in order, the tokens' bytes are the text's."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tok.id_to_token(token_id) or ""
        if fallback := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(fallback.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if piece and all(char in alphabet for char in piece):
            return bytes(alphabet[char] for char in piece)
        return text.encode()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` with the model's own template (jinja2, sandboxed); ``tools``:
        the functions the model may call, as transformers passes them (OpenAI's tool dicts).
        ``continue_final_message``: the text ends right after the last message's content, so
        the model goes on with it (transformers' rule); ``template_kwargs``: more variables
        for the template (vLLM's ``chat_template_kwargs``, say ``enable_thinking``)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # what transformers gives templates: JSON as written (not HTML-escaped), a way to refuse
        # a conversation (Llama 3's templates do), today's date (Llama 3.2's system turn)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        template = env.from_string(self.chat_template)
        if continue_final_message:  # mark where the last message's content ends
            if not messages:
                raise ValueError("continue_final_message: there is no message to continue")
            last = {**messages[-1], "content": (messages[-1].get("content") or "") + _END_MARK}
            messages = [*messages[:-1], last]
        ours = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "tools": tools,
        }
        text = template.render({**(template_kwargs or {}), **ours})  # ours win
        return _cut_at_end_mark(text) if continue_final_message else text


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


# Appended to the message to continue, then cut away with everything after it (transformers'
# way). Its space tells whether the template trimmed the content: then so is the prompt.
_END_MARK = "<pdserve-continue-here> "


def _cut_at_end_mark(text: str) -> str:
    mark = _END_MARK.strip()
    if mark not in text:
        raise ValueError("continue_final_message: the template drops the last message's content")
    at = text.rindex(mark)
    return text[:at] if text.startswith(_END_MARK, at) else text[:at].rstrip()


def _raise_exception(message: str) -> None:
    raise ValueError(message)  # the template refuses the conversation: a 400 at the router


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value
