"""`dataflex validate`: the verl context is type-checked and named; a shim run config is checked exactly as
`dataflex run` checks it (domains, sizes); stacks print; no user error ends in a traceback."""

from __future__ import annotations

import pytest

from dataflex_bus.cli import main

BLOCK = ("dataflex:\n  mechanism: select\n  scorer: {name: toy_group_rate}\n"
         "  actuator: {name: toy_band, params: {low: 0.2, high: 0.8}}\n")


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def validate(tmp_path, capsys, text, *overrides):
    rc = main(["validate", write(tmp_path, text), *overrides])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out.out, out.err


@pytest.mark.parametrize(("override", "key", "why"), [
    ("actor_rollout_ref.rollout.n=abc", "actor_rollout_ref.rollout.n", "got str 'abc'"),
    ("actor_rollout_ref.rollout.n=1.5", "actor_rollout_ref.rollout.n", "got float 1.5"),
    ("actor_rollout_ref.rollout.n=true", "actor_rollout_ref.rollout.n", "got bool True"),
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n", "got int 0"),
    ("algorithm.adv_estimator=7", "algorithm.adv_estimator", "(a string), got int 7"),
    ("algorithm=grpo", "algorithm", "expected a mapping, got str 'grpo'"),
    ("actor_rollout_ref=5", "actor_rollout_ref", "expected a mapping, got int 5"),
    ("actor_rollout_ref.rollout=[1,2]", "actor_rollout_ref.rollout", "expected a mapping, got list"),
])
def test_bad_verl_context_is_a_validation_error_naming_the_key(toys, tmp_path, capsys, override, key, why):
    rc, _, err = validate(tmp_path, capsys, "algorithm: {adv_estimator: grpo}\n" + BLOCK, override)
    assert rc == 2
    line = next(x for x in err.splitlines() if x.strip().startswith(f"- {key}:"))
    assert why in line


def test_good_verl_context_is_used(toys, tmp_path, capsys):
    rc, out, _ = validate(tmp_path, capsys, "actor_rollout_ref: {rollout: {n: 8}}\n" + BLOCK)
    assert rc == 0 and "ok: mechanism=select" in out
    rc, _, err = validate(tmp_path, capsys, "actor_rollout_ref: {rollout: {n: 1}}\n" + BLOCK)
    assert rc == 2 and "needs groups, but rollout n=1" in err


def test_context_and_block_problems_are_reported_together(toys, tmp_path, capsys):
    rc, _, err = validate(tmp_path, capsys, "actor_rollout_ref: {rollout: {n: abc}}\n" + BLOCK,
                          "dataflex.actuator.params.low=0.9")
    assert rc == 2 and "2 problem(s)" in err
    assert "actor_rollout_ref.rollout.n" in err and "dataflex.actuator.params.low" in err


SHIM = ("trainer: {steps: 3, group_size: 4, prompts_per_step: 4}\n"
        "dataflex:\n  mechanism: mix\n  scorer: {name: toy_reward}\n  actuator: {name: toy_mixer}\n")


def test_shim_config_domains_run_would_refuse_are_refused(toys, tmp_path, capsys):
    rc, _, err = validate(tmp_path, capsys, SHIM + "  domains: [copy, sort, poetry]\n")
    assert rc == 2 and "dataflex.domains: domains ['poetry'] are not in data.domains" in err
    rc, out, _ = validate(tmp_path, capsys, SHIM + "  domains: [copy, sort]\n")
    assert rc == 0 and "ok: mechanism=mix" in out


@pytest.mark.parametrize(("override", "key"), [
    ("trainer.group_size=100000000000", "trainer.group_size"),
    ("trainer.group_size=abc", "trainer.group_size"),
    ("model.hidden=10000000", "model.hidden"),
    ("trainer.stepz=3", "trainer.stepz"),
])
def test_shim_config_sections_are_checked_as_run_checks_them(toys, tmp_path, capsys, override, key):
    rc, _, err = validate(tmp_path, capsys, SHIM, override)
    assert rc == 2 and f"- {key}:" in err


def test_stack_prints_every_method(tmp_path, capsys):
    text = ("dataflex:\n  methods:\n"
            "    - {name: f, mechanism: select, scorer: {name: reward_difficulty}, actuator: {name: dapo}}\n"
            "    - {name: ar, mechanism: reweight, scorer: {name: token_prob}, actuator: {name: advantage_reweight}}\n")
    rc, out, _ = validate(tmp_path, capsys, text)
    assert rc == 0
    assert "ok: f: mechanism=select scorer=reward_difficulty actuator=dapo" in out
    assert "ok: ar: mechanism=reweight scorer=token_prob actuator=advantage_reweight" in out


def test_an_interrupt_during_validation_is_no_traceback(toys, tmp_path, capsys):
    """A KeyboardInterrupt (Ctrl-C, or a plugin raising it while validation probes a selection) ends any
    command with 130 and one line."""
    from dataflex_bus import Scorer
    from dataflex_bus.registry import register_local, unregister_local

    class Interrupts(Scorer):
        requires = ("rm_scores", "response_mask")

        def score(self, batch, step_id, **ctx):
            raise KeyboardInterrupt

    register_local("scorer", "t_interrupts", Interrupts)
    try:
        rc, _, err = validate(tmp_path, capsys, BLOCK, "dataflex.scorer.name=t_interrupts")
    finally:
        unregister_local("scorer", "t_interrupts")
    assert rc == 130 and err.strip() == "dataflex validate: interrupted"
