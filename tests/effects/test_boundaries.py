"""The one place each adapter turns transport errors into outcomes, row by row.

Real HTTP cannot produce every httpx error on demand (a connect timeout, a pool timeout),
so these rows use httpx's MockTransport; the rows it can produce are covered over real
HTTP in the adapter tests.
"""

from __future__ import annotations

import httpx
import pytest

import outbox
from effects._http import retry_after, send


def raising(error: Exception) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error

    return httpx.Client(transport=httpx.MockTransport(handler))


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (httpx.ConnectError("refused"), outbox.Retry),
        (httpx.ConnectTimeout("slow connect"), outbox.Retry),
        (httpx.PoolTimeout("no connection free"), outbox.Retry),
        (httpx.ProxyError("proxy down"), outbox.Retry),
        (httpx.ReadTimeout("slow answer"), outbox.UnknownOutcome),
        (httpx.WriteTimeout("slow upload"), outbox.UnknownOutcome),
        (httpx.ReadError("reset"), outbox.UnknownOutcome),
        (httpx.WriteError("broken pipe"), outbox.UnknownOutcome),
        (httpx.RemoteProtocolError("no answer"), outbox.UnknownOutcome),
        (httpx.LocalProtocolError("bad header"), outbox.Permanent),
        (httpx.UnsupportedProtocol("ftp://"), outbox.Permanent),
    ],
)
def test_transport_errors_become_outcomes(
    error: Exception, outcome: type[outbox.EffectOutcome]
) -> None:
    with raising(error) as client:
        request = client.build_request("POST", "https://provider.example/emails")
        with pytest.raises(outcome) as caught:
            send(client, request, what="email job k1")

    assert caught.value.__cause__ is error
    assert "email job k1" in str(caught.value)
    assert type(error).__name__ in str(caught.value)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("7", 7.0),
        ("0.5", 0.5),
        ("-3", 0.0),
        ("soon", None),
        ("nan", None),
        ("Thu, 01 Jan 1970 00:00:00 GMT", 0.0),
        ("Wed, 21 Oct 2015 07:28:10 GMT", 10.0),
    ],
)
def test_retry_after_reads_seconds_and_dates(value: str, seconds: float | None) -> None:
    now = 1445412480.0  # Wed, 21 Oct 2015 07:28:00 GMT

    assert retry_after({"Retry-After": value}, now=now) == seconds


def test_retry_after_absent() -> None:
    assert retry_after({}) is None
