"""Conformance suites: scripts that check a running server against its protocol page."""
