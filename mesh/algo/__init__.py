"""The pure math: update rules (optim, muon, rotated), subset selection and drift correction
(sparse), pipeline schedules and their formulas (schedule), grid topology. No processes, no I/O.

Imports nothing of mesh but config and errors.
"""
