"""fa4: the runtime. `fa4.attention(q, k, v, causal=...)` looks up the tuned configuration and runs it."""
