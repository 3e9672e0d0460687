"""Decoding strategies that choose tokens by other rules than sampling one token from the processed distribution:
beam search, contrastive search, built on the engine's step."""
