"""The operator's tools: the command line, the dashboard and the grants.

They present :mod:`outbox.admin` (the one operator API) and run the relay; nothing below
them imports them, and nothing imports the command line (a test of the layout checks both).
"""
