"""fa4tune: the harness that searches kernel knobs per shape, keeps the best-config database and reports."""
