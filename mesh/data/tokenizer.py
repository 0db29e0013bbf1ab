"""Tokenizers: text <-> token ids for a run's data.

`load_tokenizer(data_path)` gives the tokenizer a run trains with: bytes (vocab 256) for a text
file or the default corpus. Prepared datasets (a directory with manifest.json and a Hugging Face
`tokenizer.json`) add their own kind here.
"""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no end-of-text token, nothing to ship with an export."""

    name = "bytes"
    vocab_size = 256
    eot_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def files(self) -> list[Path]:
        """Files an export copies beside the weights so `transformers` can load the tokenizer."""
        return []


def load_tokenizer(data_path: str | None) -> ByteTokenizer:
    """The tokenizer of the data at data.path (None: the default corpus, bytes)."""
    return ByteTokenizer()
