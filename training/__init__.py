"""Offline training jobs for the reference model family (run as `specmesh` subcommands)."""
