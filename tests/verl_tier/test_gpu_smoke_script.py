"""The GPU proof's dry run on CPU: arguments, verl's metric prints, and the checks on recorded runs.

``fixtures/gpu_smoke_cpu.json`` holds the metrics of every run of ``python scripts/gpu_smoke.py --cpu``
(the whole GPU flow, rollout caching included, rehearsed with the test-only CPU backend of tests/e2e);
``fixtures/gpu_smoke_off_console.log`` is the console output of its ``off`` run, trimmed to the lines
around verl's metric prints. The checks must pass on the recording and fail when a method did nothing.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parents[1] / "scripts" / "gpu_smoke.py"
FIXTURES = HERE / "fixtures"


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses resolve their module by name
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


@pytest.fixture
def recorded(smoke):
    raw = json.loads((FIXTURES / "gpu_smoke_cpu.json").read_text())
    return {run: {int(step): values for step, values in steps.items()} for run, steps in raw.items()}


def names(checks):
    return {c.name: c for c in checks}


# ---------------------------------------------------------------------------------------------- arguments
def test_arguments_default_to_every_check_on_vllm(smoke):
    args = smoke.parse_args([])
    assert args.checks == list(smoke.CHECKS) and args.rollout == "vllm" and not args.cpu and args.jobs == 2
    args = smoke.parse_args(["--checks", "select, mix", "--timeout", "60", "--out", "/tmp/x", "--cpu"])
    assert args.checks == ["select", "mix"] and args.timeout == 60 and args.cpu and args.out == Path("/tmp/x")
    assert args.jobs == 1 and smoke.parse_args(["--cpu", "--jobs", "3"]).jobs == 3


@pytest.mark.parametrize("argv, message", [
    (["--checks", "select,bogus"], "--checks: unknown ['bogus']; allowed: off_off, select"),
    (["--checks", ","], "--checks: unknown empty list"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--jobs", "0"], "--jobs must be >= 1"),
])
def test_bad_arguments_name_the_option_and_allowed_values(smoke, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        smoke.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_runs_only_what_the_checks_need(smoke, tmp_path):
    inputs = smoke.Inputs(tmp_path / "m", tmp_path / "d.parquet", tmp_path / "r.py")
    every = smoke.plan(inputs, tmp_path, wanted=smoke.CHECKS, seed=1, rollout="vllm", extra=[])
    assert [r.name for r in every] == ["off", "mix", "off2", "select", "reweight", "subset", "resume"]
    assert {r.name: r.after for r in every} == {"off": None, "mix": None, **dict.fromkeys(
        ["off2", "select", "reweight", "subset", "resume"], "off")}
    by_name = {r.name: r.overrides for r in every}
    cached = [name for name, keys in by_name.items() if "skip.rollout_tq.enable=True" in keys]
    assert cached == ["off", "off2", "select", "reweight", "subset", "resume"]  # mix draws fresh prompts
    assert "trainer.v1.trainer_mode=sync" in by_name["off2"]
    assert f"trainer.resume_from_path={tmp_path / 'ckpt_off' / 'global_step_2'}" in by_name["resume"]
    only_mix = smoke.plan(inputs, tmp_path, wanted=["mix"], seed=1, rollout="vllm", extra=[])
    assert [r.name for r in only_mix] == ["mix"]


#: Stands in for main_ppo: records start/end in a journal, prints the servers-up line, writes a file log.
FAKE_TRAINER = """
import json, os, sys, time
name, wait_up, wait_end, journal = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
def note(what):
    with open(journal, "a") as fh:
        fh.write(f"{what} {name}\\n")
note("start")
time.sleep(wait_up)
print("LLMServerManager: ['fake']", flush=True)
time.sleep(wait_end)
print(f"step:1 - actor/pg_loss:np.float64(0.25) - name_len:{len(name)}", flush=True)
if name != "console_only":
    with open(os.environ["VERL_FILE_LOGGER_PATH"], "w") as fh:
        fh.write(json.dumps({"step": 1, "data": {"actor/pg_loss": 0.5}}) + "\\n")
note("end")
"""


@pytest.mark.integration
def test_runs_start_after_their_dependency_and_after_the_others_servers_are_up(smoke, tmp_path):
    fake, journal = tmp_path / "fake.py", tmp_path / "journal"
    fake.write_text(FAKE_TRAINER)

    def run(name, up, end, after=None):
        return smoke.Run(name, [name, str(up), str(end), str(journal)], after)

    runs = [run("off", 0.5, 1.0), run("mix", 0.0, 0.2), run("select", 0.0, 0.0, after="off"),
            run("console_only", 0.0, 0.0)]
    results = smoke.run_all(runs, tmp_path, dict(os.environ), timeout=60, jobs=2,
                            command=[sys.executable, str(fake)])
    events = journal.read_text().split("\n")
    # mix waited for off's servers; select waited for off to finish
    assert events.index("start mix") > events.index("start off")
    assert events.index("start select") > events.index("end off")
    assert {n: r.returncode for n, r in results.items()} == dict.fromkeys(["off", "mix", "select", "console_only"], 0)
    assert results["off"].metrics == {1: {"actor/pg_loss": 0.5}}  # the file logger wins
    assert results["console_only"].metrics == {1: {"actor/pg_loss": 0.25, "name_len": 12.0}}


@pytest.mark.integration
def test_a_run_past_its_timeout_is_ended_and_reported(smoke, tmp_path):
    fake, journal = tmp_path / "fake.py", tmp_path / "journal"
    fake.write_text(FAKE_TRAINER)
    result = smoke.launch(smoke.Run("slow", ["slow", "0", "120", str(journal)]), tmp_path,
                          dict(os.environ), timeout=1, command=[sys.executable, str(fake)])
    assert result.returncode == "timeout after 1 s" and result.metrics == {}
    assert journal.read_text().split() == ["start", "slow"]


def test_select_is_the_seed_quick_start_verbatim(smoke):
    sys.path.insert(0, str(HERE))
    from seed_config import SEED

    assert smoke.METHODS["select"] == SEED


# ---------------------------------------------------------------------------------------------- metric prints
@pytest.mark.parametrize("text, value", [
    ("np.float64(0.4440848231315613)", 0.4440848231315613), ("np.int32(2)", 2.0), ("np.True_", 1.0),
    ("0.5", 0.5), ("16", 16.0), ("1e-06", 1e-06), ("-1.48", -1.48), ("False", 0.0), ("np.float32(nan)", math.nan),
    ("inf", math.inf), ("'text'", None), ("[1, 2]", None),
])
def test_values_as_verl_prints_them(smoke, text, value):
    parsed = smoke.parse_value(text)
    if value is None or math.isnan(value):
        assert (parsed is None) if value is None else math.isnan(parsed)
    else:
        assert parsed == value


def test_console_lines_with_ray_prefixes_and_numpy_scalars(smoke):
    text = ("\x1b[36m(TaskRunnerV1 pid=9271)\x1b[0m step:1 - actor/pg_loss:0.0359 - num_turns/min:np.int32(2) - "
            "num_turns/mean:np.float64(2.0) - training/global_step:1\nunrelated line\n"
            "(TaskRunnerV1 pid=9271) step:2 - actor/pg_loss:np.float64(-0.5)")
    assert smoke.parse_console(text) == {
        1: {"actor/pg_loss": 0.0359, "num_turns/min": 2.0, "num_turns/mean": 2.0, "training/global_step": 1.0},
        2: {"actor/pg_loss": -0.5}}


def test_recorded_console_log_parses_like_the_file_logger(smoke, recorded):
    console = smoke.parse_console((FIXTURES / "gpu_smoke_off_console.log").read_text())
    assert sorted(console) == sorted(recorded["off"]) == [1, 2, 3]
    assert "np.float64(" in (FIXTURES / "gpu_smoke_off_console.log").read_text()
    for step, values in recorded["off"].items():
        assert console[step]["num_turns/mean"] == 2.0
        for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean", "dataflex/rollout/rows"):
            assert console[step][key] == pytest.approx(values[key], rel=1e-9), key


def test_file_logger_lines(smoke, tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":1,"data":{"a":1.5,"b":2,"s":"x"}}\n\n{"step":2,"data":{"a":null}}\n')
    assert smoke.read_file_log(path) == {1: {"a": 1.5, "b": 2.0}, 2: {}}


# ---------------------------------------------------------------------------------------------- checks
def test_every_check_passes_on_the_recorded_runs(smoke, recorded):
    checks = smoke.evaluate(recorded)
    assert len(checks) >= 8
    failed = [c.line() for c in checks if not c.ok]
    assert not failed, failed
    assert all(c.line().startswith("PASS ") for c in checks)


def test_a_method_that_did_nothing_fails_its_check(smoke, recorded):
    inert = dict(recorded)
    for method in ("select", "reweight", "subset"):
        inert[method] = recorded["off2"]  # the method run trained exactly like the control
    checks = names(smoke.evaluate(inert))
    assert not checks["select: rows removed, fewer trained tokens"].ok
    assert not checks["reweight: weights reach the loss"].ok
    assert not checks["subset: on_advantage selection reaches the loss"].ok
    assert checks["off/off control"].ok and checks["mix: draws follow the published probabilities"].ok


def test_reweight_with_constant_weights_fails_even_if_the_loss_moved(smoke, recorded):
    runs = copy.deepcopy(recorded)
    runs["reweight"][1]["dataflex/weight_std"] = 0.0
    assert not names(smoke.evaluate(runs, ["off_off", "reweight"]))["reweight: weights reach the loss"].ok


def test_loss_change_within_the_off_off_noise_fails(smoke, recorded):
    off = recorded["off"]
    noise = 2 * abs(recorded["reweight"][1]["actor/pg_loss"] - off[1]["actor/pg_loss"])
    assert not smoke.check_reweight(off, recorded["reweight"], 1, noise / 10).ok
    assert smoke.check_reweight(off, recorded["reweight"], 1, 0.0).ok


def test_mix_fails_when_draws_ignore_the_published_probabilities(smoke, recorded):
    runs = copy.deepcopy(recorded)
    probs = smoke.domain_series(runs["mix"], 1, "dataflex/domain_prob/")
    least = min(probs, key=probs.get)
    for d in probs:
        runs["mix"][2][f"dataflex/drawn/{d}"] = float(smoke.BATCH if d == least else 0)
    check = smoke.check_mix(runs["mix"])
    assert not check.ok and "uniform draws explain them better" in check.detail


def test_mix_fails_when_the_mixer_published_uniform_probabilities(smoke, recorded):
    runs = copy.deepcopy(recorded)
    for d in smoke.DOMAINS:
        runs["mix"][1][f"dataflex/domain_prob/{d}"] = 1 / 3
    check = smoke.check_mix(runs["mix"])
    assert not check.ok and "uniform" in check.detail


def test_mix_fails_on_a_draw_from_a_zero_probability_domain(smoke):
    m = {1: {"dataflex/domain_prob/a": 1.0, "dataflex/domain_prob/b": 0.0},
         2: {"dataflex/drawn/a": 3.0, "dataflex/drawn/b": 1.0}}
    check = smoke.check_mix(m)
    assert not check.ok and "probability 0: ['b']" in check.detail


def test_resume_and_off_off_fail_on_a_diverging_metric(smoke, recorded):
    runs = copy.deepcopy(recorded)
    runs["resume"][3]["actor/pg_loss"] += 0.01
    runs["off2"][2]["critic/score/mean"] += 0.01
    checks = names(smoke.evaluate(runs, ["off_off", "resume"]))
    assert not checks["resume: step after resume matches"].ok
    assert "actor/pg_loss" in checks["resume: step after resume matches"].detail
    assert not checks["off/off control"].ok and "critic/score/mean" in checks["off/off control"].detail


def test_a_run_that_logged_nothing_is_a_fail_not_a_crash(smoke, recorded):
    runs = dict(recorded, select={}, resume={1: {}, 2: {}})
    checks = names(smoke.evaluate(runs))
    assert not checks["select"].ok and "no metrics logged for step 1" in checks["select"].detail
    assert not checks["resume: step after resume matches"].ok


# ---------------------------------------------------------------------------------------------- inputs (verl)
@pytest.mark.verl
def test_every_run_composes_and_the_reward_has_signal(smoke, tmp_path):
    pytest.importorskip("verl")
    import pandas as pd
    import verl_harness as H
    from verl.trainer.ppo.reward import get_custom_reward_fn

    inputs = smoke.Inputs(tmp_path / "model", smoke.write_data(tmp_path), smoke.write_reward(tmp_path))
    for run in smoke.plan(inputs, tmp_path, wanted=smoke.CHECKS, seed=1, rollout="vllm", extra=smoke.VLLM_KEYS):
        cfg = H.compose(run.overrides)
        assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == smoke.BATCH  # one mini-batch per step
    score = get_custom_reward_fn(cfg)  # what verl's reward workers load
    frame = pd.read_parquet(inputs.data)
    assert list(frame["data_source"][:6]) == [*smoke.DOMAINS, *smoke.DOMAINS]
    for start in range(0, len(frame), smoke.BATCH):  # every training batch holds a code prompt
        assert "code" in set(frame["data_source"][start:start + smoke.BATCH])
    responses = ["7 12 code 88 3", "93 61 answer 70 51", ""]
    got = {d: [score(data_source=d, solution_str=r, ground_truth="0") for r in responses] for d in smoke.DOMAINS}
    assert got == {"math": [0.6, 0.0, 0.0], "logic": [0.2, 0.8, 0.0], "code": [0.0, 0.0, 0.0]}


def test_comparisons_insist_on_the_training_metrics(smoke, recorded):
    runs = copy.deepcopy(recorded)
    del runs["off2"][1]["actor/pg_loss"]
    check = smoke.check_off_off(runs["off"], runs["off2"], [1, 2])
    assert not check.ok and "step 1 actor/pg_loss: missing" in check.detail
