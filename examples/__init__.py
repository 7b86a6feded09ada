"""Runnable examples of outbox."""
