"""Shared fixtures: a small generated corpus so unit tests never need the real one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

WORDS = (
    "the king and queen of the realm speak to their lords with grace and fury while the fool "
    "laughs at all of them under a grey sky that will not rain though every man prays for it"
).split()


def make_text(n_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_bytes:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + ".\n"
        out.append(line)
        size += len(line)
    return "".join(out)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(make_text(60_000))
    return path
