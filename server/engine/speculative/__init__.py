"""Speculative decoding on the engine: drafters propose tokens, one forward verifies them."""
