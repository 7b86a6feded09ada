"""The dashboard's client fixtures, for the schedules page's tests."""

from tests.web.conftest import anyio_backend, client, make_client

__all__ = ["anyio_backend", "client", "make_client"]
