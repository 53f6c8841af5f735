"""Intervals and tests: the sequence bootstrap, acceptance metrics, Jeffreys intervals, power, the prompt bootstrap for end-to-end ratios."""
