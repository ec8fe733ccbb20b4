"""The gateway role: an OpenAI-compatible HTTP front that turns requests into bus messages."""
