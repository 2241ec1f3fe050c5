"""Adapters that plug flashattn into other libraries (``flashattn.integrations.transformers``)."""
