"""What a model directory declares: architecture, pooling, normalisation, limits."""
