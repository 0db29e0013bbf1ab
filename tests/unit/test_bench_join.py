"""mesh/bench/join.py's pure parts: statistics over repeats, the table, the generated text."""

from mesh.bench.join import MEASURES, describe, generated_text, to_markdown, values_of

REPEATS = [
    {
        "join_to_training_s": [5.0, 7.0, 6.0],
        "replacement_to_resumed_s": 4.0,
        "dead_bootstrap_to_error_s": 3.0,
    },
    {
        "join_to_training_s": [9.0, 8.0, 6.5],
        "replacement_to_resumed_s": 6.0,
        "dead_bootstrap_to_error_s": 3.5,
    },
]


def test_values_of_flattens_per_join_lists_and_keeps_single_values():
    assert values_of(REPEATS, "join_to_training_s") == [5.0, 7.0, 6.0, 9.0, 8.0, 6.5]
    assert values_of(REPEATS, "replacement_to_resumed_s") == [4.0, 6.0]


def test_describe_gives_median_min_max_and_count():
    assert describe([5.0, 7.0, 6.0, 9.0, 8.0, 6.5]) == {
        "n": 6,
        "median": 6.75,
        "min": 5.0,
        "max": 9.0,
    }
    assert describe([3.0]) == {"n": 1, "median": 3.0, "min": 3.0, "max": 3.0}


def test_table_has_a_row_per_measure_and_names_the_machine_and_command():
    summary = {
        "command": "meshtrain bench join --repeats 2",
        "grid": "2x2",
        "machine": {
            "cores": 2,
            "load_1m_at_start": 1.5,
            "python": "3.11.7",
            "torch": "2.13.0",
            "hivemind": "1.1.12",
        },
        "stats": {name: describe(values_of(REPEATS, name)) for name in MEASURES},
    }
    table = to_markdown(summary)
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert [r.split("|")[1].strip() for r in rows] == [label for label, _ in MEASURES.values()]
    assert "| 6.8 " in rows[0] and "| 5.0 " in rows[0] and "| 9.0 " in rows[0]
    assert "2 cores" in table and "hivemind 1.1.12" in table
    assert "`meshtrain bench join --repeats 2`" in table


def test_generated_text_is_deterministic_and_long_enough():
    text = generated_text(10_000)
    assert len(text) >= 10_000 and text == generated_text(10_000)
    assert text != generated_text(10_000, seed=1)
