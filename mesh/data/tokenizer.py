"""Tokenizers: text <-> token ids for a run's data.

`load_tokenizer(data_path)` gives the tokenizer a run trains with: bytes (vocab 256) for a text
file or the default corpus; for a prepared dataset (a directory with manifest.json, written by
`meshtrain data prepare`) the one it was prepared with: bytes plus an end-of-text token (vocab
257), or a Hugging Face `tokenizers` tokenizer saved as DIR/tokenizer.json, with a
tokenizer_config.json beside it so `transformers.AutoTokenizer.from_pretrained(DIR)` loads it.

`tokenizer_from_spec` makes one for `data prepare --tokenizer`: `bytes`, a path to a
tokenizer.json, or `bpe:VOCAB` (a byte-level BPE trained with `tokenizers` on a sample).

imports: numpy, tokenizers (lazily), mesh.errors.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from mesh.errors import DataError

EOT = "<|endoftext|>"
# end-of-text tokens other tokenizers use: a tokenizer.json with one of them keeps it
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MANIFEST = "manifest.json"
BPE_MIN_VOCAB = 257 + 1  # the 256 byte symbols, end-of-text, and at least one merge


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256 and no end-of-text token (a text file, the default
    corpus); with eot=True (a prepared dataset) id 256 ends each document: vocab 257. Nothing to
    ship with an export."""

    name = "bytes"

    def __init__(self, eot: bool = False) -> None:
        self.vocab_size = 257 if eot else 256
        self.eot_id: int | None = 256 if eot else None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def files(self) -> list[Path]:
        """Files an export copies beside the weights so `transformers` can load the tokenizer."""
        return []

    def sha256(self) -> str:
        """What identifies this tokenizer in a manifest (bytes have no file: their name)."""
        return hashlib.sha256(f"bytes:{self.vocab_size}".encode()).hexdigest()


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with an end-of-text token (`tokenizer.json`)."""

    def __init__(self, tok: Any, name: str, path: Path | None = None) -> None:
        self.tok, self.name, self.path = tok, name, path
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        eot = next((t for t in EOT_NAMES if tok.token_to_id(t) is not None), None)
        if eot is None:  # a tokenizer without one gets ours (saved with the dataset)
            tok.add_special_tokens([EOT])
            eot = EOT
            self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eot_token = eot
        self.eot_id: int | None = tok.token_to_id(eot)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self.tok.encode_batch(texts, add_special_tokens=False)  # parallel, in Rust
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def files(self) -> list[Path]:
        if self.path is None:
            return []
        return [self.path / TOKENIZER_FILE, self.path / TOKENIZER_CONFIG]

    def sha256(self) -> str:
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()

    def save(self, directory: Path) -> None:
        """DIR/tokenizer.json and the tokenizer_config.json that lets `transformers` load it
        (PreTrainedTokenizerFast, end-of-text as eos and bos)."""
        self.tok.save(str(directory / TOKENIZER_FILE))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eot_token,
            "bos_token": self.eot_token,
            "unk_token": self.eot_token,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
        }
        (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        self.path = directory


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(data_path: str | None) -> Tokenizer:
    """The tokenizer of the data at data.path (None: the default corpus, bytes)."""
    if data_path is None or not (Path(data_path) / MANIFEST).is_file():
        return ByteTokenizer()
    directory = Path(data_path)
    try:
        entry = json.loads((directory / MANIFEST).read_text())["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(
            f"{directory / MANIFEST}: not a manifest meshtrain can read; prepare the data again"
        ) from None
    if entry.get("file") is None:
        return ByteTokenizer(eot=True)
    if not isinstance(entry["file"], str) or Path(entry["file"]).name != entry["file"]:
        raise DataError(
            f"{directory / MANIFEST}: tokenizer.file = {entry['file']!r} is not a file name "
            "inside the dataset; prepare the data again"
        )
    return _load_hf(directory / entry["file"], entry.get("name", TOKENIZER_FILE), directory)


def _load_hf(path: Path, name: str, directory: Path | None = None) -> HFTokenizer:
    from tokenizers import Tokenizer as HFTok

    try:
        tok = HFTok.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
        raise DataError(f"{path}: not a Hugging Face tokenizer.json ({e})") from None
    return HFTokenizer(tok, name, directory)


def parse_spec(spec: str) -> tuple[str, int | Path | None]:
    """--tokenizer SPEC -> ("bytes", None) | ("bpe", VOCAB) | ("file", PATH); DataError naming
    the flag and the forms it takes otherwise."""
    forms = "use bytes, bpe:VOCAB (e.g. bpe:4096) or a path to a tokenizer.json"
    if spec == "bytes":
        return "bytes", None
    if spec.startswith("bpe:"):
        text = spec[4:].replace("_", "")
        if not text.isdigit() or int(text) < BPE_MIN_VOCAB:
            raise DataError(
                f"--tokenizer {spec}: VOCAB must be an integer >= {BPE_MIN_VOCAB} (256 bytes, "
                f"end-of-text and merges); {forms}"
            )
        return "bpe", int(text)
    path = Path(spec)
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"--tokenizer {spec}: no such file; {forms}")
    return "file", path


def tokenizer_from_spec(spec: str, sample: Iterable[str]) -> Tokenizer:
    """The tokenizer `data prepare --tokenizer SPEC` writes with. `sample`: texts a BPE is
    trained on (read only for bpe:VOCAB)."""
    kind, arg = parse_spec(spec)
    if kind == "bytes":
        return ByteTokenizer(eot=True)
    if kind == "file":
        assert isinstance(arg, Path)
        return _load_hf(arg, f"file:{arg.name}")
    assert isinstance(arg, int)
    return train_bpe(sample, arg)


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style: every byte is a symbol, so any text encodes) trained with
    `tokenizers`; the trainer keeps word counts, not the text, so memory follows the sample's
    vocabulary, not its length."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, f"bpe:{vocab_size}")
