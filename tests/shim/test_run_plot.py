"""``dataflex run``'s plot shows the sampling probabilities when a method of the block publishes them: the run's
plan says so (``Plan.samples_domains``), whether the mixer stands alone or in a stack."""

from dataflex_bus.runtime import Runtime

MIX = {"mechanism": "mix", "scorer": {"name": "advantage_magnitude"}, "actuator": {"name": "dump_ucb"}}
BAND = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
        "actuator": {"name": "threshold_band", "params": {"low": 0.1, "high": 0.9}}}


def samples_domains(block):
    return bool(Runtime(block).plan.samples_domains)


def test_a_mixer_is_found_alone_and_in_a_stack():
    assert samples_domains(MIX)
    assert samples_domains({"methods": [{**BAND, "name": "band"}, {**MIX, "name": "mix"}]})
    assert not samples_domains(BAND) and not samples_domains({"methods": [BAND]})
    assert not samples_domains(None) and not samples_domains({})
