"""What the server says about itself: metrics and JSON logs (metrics.py), the batched log
writer (logsink.py), process gauges (runtime.py), OpenTelemetry export (otel.py).

Nothing is imported here: the four sit on different floors of the import layers."""
