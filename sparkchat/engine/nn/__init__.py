"""The model's building blocks, one module per concept."""
