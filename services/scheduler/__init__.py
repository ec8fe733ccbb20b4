"""The splitwise scheduler role."""
