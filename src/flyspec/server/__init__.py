"""`flyspec serve`: an OpenAI-compatible server over the speculative decoders."""
