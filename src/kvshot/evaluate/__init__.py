"""Step-wise and end-to-end evaluation: references, chain acceptance, speculative decoding, trees, benchmarks."""
