"""The worker roles (mixed, prefill, decode): an engine on the bus."""
