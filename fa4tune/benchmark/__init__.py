"""`fa4tune bench`: the tuned configuration, the default and every peer timed side by side; host time per call."""
