"""The studies behind `meshtrain bench`: each runs the engine or the runtime and writes a report
(summary.json, table.md, plots) under results/<name>/. Imported by cli only.
"""
