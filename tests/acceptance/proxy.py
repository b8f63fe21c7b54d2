"""The tests' TCP proxy: :mod:`outbox.demo.proxy`, which the two-service demo uses too."""

from outbox.demo.proxy import TcpProxy, database_target, through

__all__ = ["TcpProxy", "database_target", "through"]
