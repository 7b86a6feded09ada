"""One way in: each package's ``__all__`` is sorted, importable and complete."""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest

import effects
import effects.testing
import outbox


def public_members(package: ModuleType) -> set[str]:
    """Public classes and functions the package defines (not ones it merely imports)."""
    return {
        name
        for name, member in vars(package).items()
        if not name.startswith("_")
        and (inspect.isclass(member) or inspect.isfunction(member))
        and member.__module__.startswith(package.__name__)
    }


@pytest.mark.parametrize("package", [effects, effects.testing])
def test_all_is_sorted_importable_and_complete(package: ModuleType) -> None:
    exported = package.__all__

    assert exported == sorted(exported)
    assert all(hasattr(package, name) for name in exported)
    assert public_members(package) <= set(exported)


def test_effect_names_match_the_public_contract() -> None:
    assert effects.SendEmail.name == "email.send"
    assert effects.ChargeCard.name == "payment.charge"
    assert effects.RefundPayment.name == "payment.refund"
    assert effects.PostWebhook.name == "webhook.post"
    for adapter in (effects.SendEmail, effects.ChargeCard, effects.RefundPayment):
        assert issubclass(adapter, outbox.Effect)
        assert adapter.payload_model is not None
