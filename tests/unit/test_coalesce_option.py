"""``coalesce=`` on subscribers, forwarders and schedules (docs/coalescing.md): declared
and validated when made."""

from __future__ import annotations

import pytest

from outbox import Outbox
from outbox.errors import ConfigurationError
from outbox.sinks.jetstream import JetStream


def test_coalesce_is_declared_on_subscribers_and_defaults_to_off():
    ob = Outbox()
    ob.subscriber("t", consumer="a", coalesce=True)(lambda job: None)
    ob.subscriber("t", consumer="b")(lambda job: None)
    ob.subscriber("t", consumer="c", coalesce=True, ordered=True, transactional=True)(lambda job, session: None)
    assert [s.coalesce for s in ob] == [True, False, True]


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_coalesce_must_be_a_bool(bad):
    ob = Outbox()
    with pytest.raises(ConfigurationError, match=r"subscriber 'a': coalesce must be True or False"):
        ob.subscriber("t", consumer="a", coalesce=bad)(lambda job: None)
    with pytest.raises(ConfigurationError, match=r"subscriber 'f': coalesce must be True or False"):
        ob.forward("t", to=JetStream(), consumer="f", coalesce=bad)
    assert len(ob) == 0


def test_a_forwarder_coalesces_too():
    ob = Outbox()
    ob.forward("t", to=JetStream(subject="x"), consumer="fwd", coalesce=True)
    assert ob["fwd"].coalesce and ob["fwd"].sink is not None


def test_a_schedule_passes_coalesce_to_its_subscriber():
    pytest.importorskip("croniter")
    ob = Outbox()
    ob.periodic("*/5 * * * *", topic="tick", coalesce=True)(lambda job: None)
    assert ob["tick"].coalesce
