"""An adapter built without its key (or with one it cannot use) refuses at construction
with ``outbox.ConfigurationError`` naming the adapter and the argument, never the value."""

from __future__ import annotations

from typing import Any

import pytest

import outbox
from effects.email import SendEmail
from effects.payments import ChargeCard, RefundPayment
from effects.webhook import PostWebhook


@pytest.mark.parametrize("api_key", ["", "   ", None])
@pytest.mark.parametrize("adapter", [SendEmail, ChargeCard, RefundPayment])
def test_a_missing_api_key_is_a_configuration_error(adapter: Any, api_key: Any) -> None:
    with pytest.raises(outbox.ConfigurationError) as raised:
        adapter(api_key=api_key)
    message = str(raised.value)
    assert adapter.__name__ in message and "api_key is missing or empty" in message


@pytest.mark.parametrize("secret", ["", [], b""])
def test_a_missing_webhook_secret_is_a_configuration_error(secret: Any) -> None:
    with pytest.raises(outbox.ConfigurationError, match="PostWebhook needs a signing secret"):
        PostWebhook(url="http://127.0.0.1:9/hook", secret=secret)


def test_a_malformed_webhook_secret_is_refused_without_repeating_it() -> None:
    with pytest.raises(outbox.ConfigurationError) as raised:
        PostWebhook(url="http://127.0.0.1:9/hook", secret="whsec_not base64!")
    assert "PostWebhook" in str(raised.value) and "not base64!" not in str(raised.value)


def test_a_configuration_error_is_still_a_value_error() -> None:
    # Callers that caught the ValueError these raised before keep working.
    with pytest.raises(ValueError, match="API key"):
        SendEmail(api_key="")
