"""The order-processing demo (``outbox-relay demo``)."""
