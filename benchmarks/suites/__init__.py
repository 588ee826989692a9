"""The quality suites: real models and data shipped in packages, merged by every method and
scored (``python -m benchmarks.suites.run``), with their sweeps, summary and table tools."""
