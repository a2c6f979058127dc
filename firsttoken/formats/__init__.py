"""The API formats as bytes, apart from any connection: SSE framing (both ways), the renderers
of each API's events, one answer assembled from chunks and deltas read back from events, the
error bodies. Pure functions and small classes; nothing here does I/O (`wire/` does)."""
