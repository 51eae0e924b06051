"""Measured results. best_configs.json ships with the package; the rest (optuna storage, bench
output, the report) stays in the repository."""
