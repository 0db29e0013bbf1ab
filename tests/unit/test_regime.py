"""The rule in a study written before it (mesh/bench/regime.stamp, what
scripts/reference_ratios.py runs): the reference's ratio from the losses the summary recorded,
the flag in its table above the first table, the file's own indentation, and a second stamp
replacing the first."""

import json

from mesh.bench.regime import REFERENCES, stamp

ENTRY = {
    "unigram": {"nats_per_token": 3.3, "bits_per_byte": 4.8},
    "bigram": {"nats_per_token": 2.5, "bits_per_byte": 3.6},
}


def _study(tmp_path, fullsync: float):
    runs = [
        {"study": "dp", "method": "FullSync", "seed": s, "val_loss": fullsync + d}
        for s, d in ((10, -0.1), (11, 0.1))
    ]
    runs.append({"study": "dp", "method": "AsyncMesh-fp8", "seed": 10, "val_loss": 9.0})
    (tmp_path / "summary.json").write_text(json.dumps({"runs": runs}, indent=2))
    (tmp_path / "table.md").write_text("# Convergence\n\nwhat it is.\n\n| a |\n|---|\n| 1 |\n")


def test_a_study_is_stamped_from_its_recorded_reference(tmp_path):
    _study(tmp_path, 2.5)
    fields = stamp(tmp_path, "convergence", ENTRY)
    assert fields["reference_val_loss"] == {"dp FullSync": 2.5}
    assert (
        fields["reference_to_bigram_ratio"] == 1.0 and fields["regime"] == "early-training regime"
    )
    text = (tmp_path / "summary.json").read_text()
    assert text.startswith('{\n  "runs"')  # indent 2, as the study wrote it
    assert json.loads(text)["reference_to_bigram_ratio"] == 1.0
    table = (tmp_path / "table.md").read_text()
    assert "**early-training regime**" in table
    assert table.index("Regime: ") < table.index("| a |")
    # the study re-run to a loss that passes: the new stamp replaces the old line
    _study(tmp_path, 2.0)
    stamp(tmp_path, "convergence", ENTRY)
    table = (tmp_path / "table.md").read_text()
    assert table.count("Regime: ") == 1 and "early-training" not in table
    assert "Passes the rule" in table and "(0.80)" in table


def test_every_study_names_its_reference():
    assert {
        "boundary",
        "convergence",
        "ablations",
        "horizon",
        "precision",
        "scaling",
        "optimizers",
    } <= set(REFERENCES)
    assert all(arm for arm, _ in REFERENCES.values())


def test_a_stamp_at_the_top_of_a_table_stays_one_line(tmp_path):
    _study(tmp_path, 2.0)
    (tmp_path / "table.md").write_text("| a |\n|---|\n| 1 |\n")
    stamp(tmp_path, "convergence", ENTRY)
    once = (tmp_path / "table.md").read_text()
    stamp(tmp_path, "convergence", ENTRY)
    assert (tmp_path / "table.md").read_text() == once and once.startswith("Regime: ")
