"""Decoding strategies beyond sampling one token per step: beam search (and more), built on the engine's step."""
