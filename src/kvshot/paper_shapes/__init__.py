"""The fake-tensor meter: memory and FLOPs of the real code at paper shapes."""
