"""Client-side tools: `firsttoken diag` (measure any SSE endpoint) and `firsttoken replay`."""
