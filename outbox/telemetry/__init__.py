"""What a process running outbox tells about itself: log lines, Prometheus metrics and
OpenTelemetry traces.

Instrumentation, called by the public API (publish, fenced_write) in the application's
own process and by the relay's parts; it imports neither, nor the operator's tools.
"""
