"""Sampling and speculative verification."""
