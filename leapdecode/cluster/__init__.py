"""Serving on a cluster of engine instances (prefill/decode disaggregation, replicas) and planning it.

Nothing is imported here, so a module of this package pulls in only what it needs.
"""
