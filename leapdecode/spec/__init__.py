"""Speculative decoding: drafters propose tokens, the target model verifies them in the normal step."""
