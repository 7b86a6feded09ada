"""A small order service: an order, its confirmation email and its charge, once each."""
