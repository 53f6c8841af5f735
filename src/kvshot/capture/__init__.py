"""The target and what is read from it: training the toy target, the features (hidden states, KV) and their shards, regeneration."""
