"""Decoding strategies that choose tokens by other rules than sampling from the processed distribution."""
