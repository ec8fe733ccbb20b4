"""The suffix-cache service: one global suffix index (SuffixDecoding) shared by every decode worker.

`service` is the process (`specmesh suffix-cache`); `client.RemoteSuffixIndex` is how a decode
worker's `SuffixProposer` reaches it.
"""
