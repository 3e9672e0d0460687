"""Model loading and the Llama-family model."""
