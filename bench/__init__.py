"""Benchmark harness: firsttoken against a raw-asyncio floor and the FastAPI tutorial stack.

Run it with `python -m bench` (see bench/README.md). Nothing here is imported by the server.
"""
