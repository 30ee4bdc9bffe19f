"""``dataflex run``'s plot shows the sampling probabilities when a method of the block publishes them."""

from dataflex_bus.shim.commands import samples_domains

MIX = {"mechanism": "mix", "scorer": {"name": "advantage_magnitude"}, "actuator": {"name": "dump_ucb"}}
BAND = {"mechanism": "select", "scorer": {"name": "group_solve_rate"}, "actuator": {"name": "threshold_band"}}


def test_a_mixer_is_found_alone_and_in_a_stack():
    assert samples_domains(MIX)
    assert samples_domains({"methods": [{**BAND, "name": "band"}, {**MIX, "name": "mix"}]})
    assert not samples_domains(BAND) and not samples_domains({"methods": [BAND]})
    assert not samples_domains(None) and not samples_domains({})
