"""Tokenizers: a tiny built-in character tokenizer and a wrapper over HF `tokenizer.json`.

Both satisfy the `Tokenizer` protocol; `load_tokenizer` picks one from a name or directory.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

from hexrl.input_files import loads_json, read_json

CHAR_TOKENIZER_FILE = "hexrl_tokenizer.json"
HF_TOKENIZER_FILE = "tokenizer.json"
# what a model directory's tokenizer is made of (eos ids may come from generation_config.json)
TOKENIZER_FILES = (CHAR_TOKENIZER_FILE, HF_TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt")

# The instruction Qwen-Math / DeepSeek-R1 style evaluations append to a math question.
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SYSTEM_PROMPT = "You are a helpful assistant."


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of hexrl needs from a tokenizer."""

    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_prompt(self, question: str) -> str: ...


# ----------------------------------------------------------------------------- char


DEFAULT_ALPHABET = string.digits + "+-*/=?.,()" + " \n" + string.ascii_lowercase
CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2


class CharTokenizer:
    """One id per character of a fixed alphabet; ids 0/1/2 are pad/bos/eos.

    Meant for synthetic tasks a tiny model learns on CPU. `encode` adds no specials.
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if not alphabet:
            raise ValueError("CharTokenizer alphabet is empty")
        dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if dupes:
            raise ValueError(f"CharTokenizer alphabet has duplicate characters: {dupes!r}")
        self.alphabet = alphabet
        self._to_id = {c: i + len(CHAR_SPECIALS) for i, c in enumerate(alphabet)}
        self.vocab_size = len(CHAR_SPECIALS) + len(alphabet)

    def encode(self, text: str) -> list[int]:
        """Map each character to its id; raise ValueError naming every unknown character."""
        unknown = sorted({c for c in text if c not in self._to_id})
        if unknown:
            raise ValueError(
                f"CharTokenizer cannot encode characters {unknown!r} (not in its alphabet "
                f"{self.alphabet!r})")
        return [self._to_id[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        """Inverse of encode; special and out-of-range ids are dropped."""
        n = len(CHAR_SPECIALS)
        return "".join(self.alphabet[i - n] for i in ids if n <= int(i) < self.vocab_size)

    def chat_prompt(self, question: str) -> str:
        """Synthetic prompts are complete as written (e.g. "12+7="), so no template."""
        return question

    def to_json(self) -> str:
        return json.dumps({"type": "char", "alphabet": self.alphabet, "specials": list(CHAR_SPECIALS)})

    @classmethod
    def from_json(cls, text: str) -> "CharTokenizer":
        data = loads_json(text, CHAR_TOKENIZER_FILE, "tokenizer file")
        if not isinstance(data, dict) or data.get("type") != "char":
            raise ValueError('not a CharTokenizer description (expected {"type": "char", ...})')
        if list(data.get("specials", CHAR_SPECIALS)) != list(CHAR_SPECIALS):
            raise ValueError(f"CharTokenizer specials must be {list(CHAR_SPECIALS)}, got {data['specials']}")
        if not isinstance(data.get("alphabet"), str):
            raise ValueError("CharTokenizer description lacks a string 'alphabet'")
        return cls(data["alphabet"])

    def save(self, directory: str | Path) -> Path:
        """Write `hexrl_tokenizer.json` into `directory` (created if needed); return its path."""
        path = Path(directory) / CHAR_TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "CharTokenizer":
        path = Path(directory) / CHAR_TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no {CHAR_TOKENIZER_FILE} in {directory}")
        return cls.from_json(path.read_text())


# ----------------------------------------------------------------------------- HF


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    data = read_json(path, "tokenizer file")  # InputFileError (a ValueError) names the file
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    """eos_token_id may be an int or a list of ints."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (via the `tokenizers` library) plus its special ids.

    eos comes from, in order: tokenizer_config.json `eos_token`, generation_config.json
    `eos_token_id`, config.json `eos_token_id`. `stop_ids` holds every eos id found, since
    chat models stop on several (Qwen: <|im_end|> and <|endoftext|>).
    """

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer as _RawTokenizer  # optional dependency at import time

        d = Path(directory)
        tok_path = d / HF_TOKENIZER_FILE
        if not tok_path.is_file():
            raise FileNotFoundError(f"HF tokenizer needs {tok_path}, which does not exist")
        self.directory = d
        self.raw = _RawTokenizer.from_file(str(tok_path))
        self.vocab_size = self.raw.get_vocab_size(with_added_tokens=True)
        tok_cfg = _read_json(d / "tokenizer_config.json")
        self.stop_ids = self._find_eos_ids(tok_cfg, d)
        self.eos_id = self.stop_ids[0]
        pad = self._id_of(_token_text(tok_cfg.get("pad_token")))
        self.pad_id = pad if pad is not None else self.eos_id  # common choice for decoder-only models
        bos = self._id_of(_token_text(tok_cfg.get("bos_token")))
        self.bos_id = bos
        self.chat_style = self._detect_chat_style()

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.raw.token_to_id(token)

    def _find_eos_ids(self, tok_cfg: dict, d: Path) -> list[int]:
        found: list[int] = []
        eos = self._id_of(_token_text(tok_cfg.get("eos_token")))
        if eos is not None:
            found.append(eos)
        for name in ("generation_config.json", "config.json"):
            found += _ids(_read_json(d / name).get("eos_token_id"))
        if not found:  # last resort: conventional names
            found += [i for t in ("<|endoftext|>", "</s>", "<eos>") if (i := self.raw.token_to_id(t)) is not None]
        if not found:
            raise ValueError(
                f"cannot find an eos token for the tokenizer in {d}: none of tokenizer_config.json "
                "'eos_token', generation_config.json / config.json 'eos_token_id' is set, and the "
                "vocabulary has no <|endoftext|>, </s> or <eos>")
        return list(dict.fromkeys(found))  # dedupe, keep order

    def _detect_chat_style(self) -> str:
        if self.raw.token_to_id("<|im_start|>") is not None:
            return "qwen"
        if self.raw.token_to_id("<|start_header_id|>") is not None:
            return "llama3"
        return "plain"

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised, none added."""
        return self.raw.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.raw.decode([int(i) for i in ids], skip_special_tokens=True)

    def chat_prompt(self, question: str) -> str:
        """The chat-template prompt for a math question (style detected from special tokens)."""
        user = f"{question}\n{MATH_INSTRUCTION}"
        if self.chat_style == "qwen":
            return (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
                    f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
        if self.chat_style == "llama3":
            bos = "<|begin_of_text|>" if self.raw.token_to_id("<|begin_of_text|>") is not None else ""

            def turn(role: str, text: str) -> str:
                return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>"

            return bos + turn("system", SYSTEM_PROMPT) + turn("user", user) + \
                "<|start_header_id|>assistant<|end_header_id|>\n\n"
        return question + "\n"


# ----------------------------------------------------------------------------- loading


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read; the message names the file."""


def load_tokenizer(path_or_name: str | Path) -> CharTokenizer | HFTokenizer:
    """`"char"` -> CharTokenizer; a directory with hexrl_tokenizer.json -> CharTokenizer;
    a directory with tokenizer.json -> HFTokenizer. Anything else is a clear error."""
    if str(path_or_name) == "char":
        return CharTokenizer()
    p = Path(path_or_name)
    if p.is_file() and p.name in (CHAR_TOKENIZER_FILE, HF_TOKENIZER_FILE):
        p = p.parent
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {p} does not exist (and is not the name 'char')")
    if not p.is_dir():
        raise ValueError(f"tokenizer path {p} is not a directory")
    for name, kind in ((CHAR_TOKENIZER_FILE, CharTokenizer.load), (HF_TOKENIZER_FILE, HFTokenizer)):
        if (p / name).is_file():
            try:
                return kind(p)
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{p / name}: not a usable tokenizer ({type(e).__name__}: {e})") from None
            except Exception as e:  # the `tokenizers` library raises its own Exception type on garbage
                raise TokenizerError(f"{p / name}: not a valid tokenizer file ({e})") from None
    raise FileNotFoundError(
        f"no tokenizer in {p}: expected {CHAR_TOKENIZER_FILE} (hexrl char tokenizer) or "
        f"{HF_TOKENIZER_FILE} (Hugging Face)")


def tokenizer_files(model_dir: str | Path) -> dict[str, str]:
    """The tokenizer files of a model directory as {name: text}, to write next to weights exported
    from it, so that every model directory hexrl writes can be loaded and prompted on its own."""
    d = Path(model_dir)
    return {name: (d / name).read_text(encoding="utf-8") for name in TOKENIZER_FILES if (d / name).is_file()}
