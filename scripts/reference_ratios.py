"""Record the rule (mesh/bench/regime.py) in the studies written before it, from the reference
losses they recorded, without training anything: each results/<study>/summary.json gains the
data's unigram and bigram cross-entropy, `reference_to_bigram_ratio` and the verdict, and its
table.md the line that says where the reference ends ("early-training regime" above 0.85).

Run from the repository root: python3 scripts/reference_ratios.py
The BPE studies need data/shakespeare-bpe4k (README: Demo); without it they are skipped, said.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mesh.bench.regime import stamp
from mesh.data.corpus import load_corpus, ngram_ce
from mesh.errors import DataError

BPE4K = "data/shakespeare-bpe4k"
# results folder -> (its study in mesh.bench.regime.REFERENCES, the data it trained on: None is
# the default Shakespeare bytes at the default val_fraction)
STUDIES = {
    "results/boundary-bpe4k": ("boundary", BPE4K),
    "results/convergence": ("convergence", None),
    "results/convergence/interval": ("interval", None),
    "results/ablations": ("ablations", None),
    "results/fidelity/horizon": ("horizon", None),
    "results/fidelity/precision": ("precision", None),
    "results/fidelity/scaling": ("scaling", None),
    "results/optimizers": ("optimizers", None),
    "results/fp8-feedback": ("fp8-feedback", None),
    "results/runtime": ("runtime", None),
    "results/demo": ("demo", BPE4K),
    "results/data": ("data", None),
}


def reference(path: str | None) -> dict | None:
    try:
        return ngram_ce(load_corpus(path, 0.05, 64))
    except DataError as e:
        print(f"  no reference points for {path}: {e}", file=sys.stderr)
        return None


def main() -> None:
    entries = {None: reference(None), BPE4K: reference(BPE4K)}
    for folder, (study, data) in STUDIES.items():
        out = Path(folder)
        if not (out / "summary.json").is_file():
            continue
        if entries[data] is None:
            print(f"{folder}: skipped ({data} is not prepared)")
            continue
        extra = {"per_setting": {"bpe:4096": entries[BPE4K]}} if study == "data" else {}
        if study == "data" and entries[BPE4K] is None:
            extra = {}
        fields = stamp(out, study, entries[data], **extra)
        ratio = fields["reference_to_bigram_ratio"]
        print(
            f"{folder}: {fields['reference_to_bigram_by_setting']} -> {ratio} ({fields['regime']})"
        )


if __name__ == "__main__":
    main()
