"""kvshot: hidden-state vs KV-cache context reuse for long-range speculative decoding."""
__version__ = "0.1.0"
