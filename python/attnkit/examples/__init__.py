"""Runnable examples: python -m attnkit.examples.<name>."""
