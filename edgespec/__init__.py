"""edgespec: exact speculative decoding."""
