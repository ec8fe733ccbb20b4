"""Draft proposers and the pieces of the speculative loop: propose, verify, accept, adapt."""
