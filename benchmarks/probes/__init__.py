"""Probes: one script per question (a speed, a memory peak, a cost, a share, a reproduction),
each writing its answer to ``benchmarks/results/<name>.md`` with the command that made it."""
