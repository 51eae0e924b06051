"""Search spaces (TOML), one per architecture: each narrows the knobs declared in fa4.kernels.knobs."""
