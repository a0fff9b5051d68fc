"""Decoding on top of the engine: sampling, the generation loop, and speculative decoding."""
