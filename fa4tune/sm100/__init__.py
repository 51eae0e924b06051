"""The sm100 kernel without a Blackwell GPU: what the compiler made of it (SASS), how often its rescale fires."""
