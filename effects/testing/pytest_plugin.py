"""pytest fixtures for the fake providers (registered through the pytest11 entry point)."""
