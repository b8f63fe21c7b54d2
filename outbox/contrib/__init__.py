"""Integrations with other frameworks, each an optional extra (``outbox.contrib.django``: ``[django]``)."""
