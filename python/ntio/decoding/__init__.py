"""Decoding on top of the engine: sampling and the generation loop (later: speculative decoding)."""
