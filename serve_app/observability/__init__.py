"""Prometheus metrics and raystream's log lines."""
