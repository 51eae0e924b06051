"""What a search or a bench is given: shape keys, shape sets (shapes files, model presets) and search spaces."""
