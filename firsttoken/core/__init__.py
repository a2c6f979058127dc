"""The corridor every answer walks: stream (the producer and its event log), registry,
admission ticket outcome, coalescing, pacing and the one schedule of timers."""
