"""The one TTT trainer: the loop, the objective, variants, checkpoints, held-out evaluation, diagnostics, the DDP launcher."""
