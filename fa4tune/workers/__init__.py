"""Worker processes that compile, validate and time a configuration, and the outcomes an evaluation can end in."""
