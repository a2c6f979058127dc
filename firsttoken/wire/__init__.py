"""Bytes on the wire: SSE framing, the renderers of each API's events, compression, the
event-stream response and the connection it writes to."""
