"""Telemetry: Prometheus metrics, a rolling window for the status page, OpenTelemetry traces.

Everything here learns from the proxy's outcome records (router.core.outcome) through
observers that run inline per request: O(1) work and no awaits.
"""
