"""The GPU check's dry run on CPU: arguments, the plan and its time bound, the preflight, verl's metric prints,
and the checks on recorded runs.

``fixtures/gpu_smoke_cpu.json`` holds the metrics of every run of the CPU rehearsal of the GPU check's predecessor
(``gpu_smoke.py --cpu``: verl's real ``main_ppo`` with the test-only ``cpu_hf`` rollout, rollout caching
included): ``off`` (``dataflex_sync``, no block), ``off2`` (verl's ``sync`` replaying ``off``'s rollouts),
``select`` and ``reweight`` (replaying them too). ``fixtures/gpu_check_speed_cpu.json`` is a run of the e2e
tier's ``speed`` configuration without its failed request (SPEED in bf16 through the real agent loop, requests
finishing out of order).
``fixtures/gpu_smoke_off_console.log`` is the console output of the ``off`` run, trimmed to the lines around
verl's metric prints. The checks must pass on the recordings and fail when a method did nothing.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parents[1] / "scripts" / "gpu_check.py"
FIXTURES = HERE / "fixtures"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses resolve their module by name
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def _steps(raw: dict) -> dict:
    return {run: {int(step): values for step, values in steps.items()} for run, steps in raw.items()}


@pytest.fixture
def recorded(gc):
    """The runs of the GPU check's plan, from the CPU recordings: ``control`` is ``off2`` (the same rollouts,
    no method: what a method warming up at step 1 must log), ``speed`` the e2e tier's."""
    old = _steps(json.loads((FIXTURES / "gpu_smoke_cpu.json").read_text()))
    speed = _steps(json.loads((FIXTURES / "gpu_check_speed_cpu.json").read_text()))["speed"]
    control = {1: {**old["off2"][1], "dataflex/warmup": 1.0}}
    return {"off": old["off"], "control": control, "reweight": old["reweight"], "speed": speed,
            "select": old["select"], "off2": old["off2"]}


def names(checks):
    return {c.name: c for c in checks}


# ---------------------------------------------------------------------------------------------- arguments
def test_arguments_default_to_this_interpreter_and_the_install_venv(gc):
    args = gc.parse_args([])
    assert args.python == sys.executable and not args.cpu and not args.install and not args.dry_run
    args = gc.parse_args(["--install", "--venv", "/tmp/v", "--out", "/tmp/x", "--timeout-scale", "2"])
    assert args.python == "/tmp/v/bin/python" and args.out == Path("/tmp/x") and args.timeout_scale == 2


@pytest.mark.parametrize("argv, message", [
    (["--timeout-scale", "0"], "--timeout-scale must be > 0"),
    (["--cpu", "--install"], "--install sets up the GPU environment; --cpu runs in this one"),
    (["--checks", "select"], "unrecognized arguments: --checks"),
])
def test_bad_arguments_name_the_option(gc, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        gc.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_plan_runs_one_main_ppo_at_a_time_with_sdpa_and_no_remove_padding(gc, tmp_path):
    inputs = gc.Inputs(tmp_path / "m", tmp_path / "d.parquet", tmp_path / "r.py")
    runs = gc.plan(inputs, tmp_path, seed=1, rollout="vllm", extra=gc.GPU_KEYS, timeouts=gc.GPU_TIMEOUTS)
    assert [r.name for r in runs] == list(gc.RUNS) == ["off", "control", "reweight", "speed"]
    assert {r.name: r.after for r in runs} == {"off": None, "control": "off", "reweight": "off", "speed": None}
    by_name = {r.name: r.overrides for r in runs}
    for name, keys in by_name.items():
        assert "+actor_rollout_ref.model.override_config.attn_implementation=sdpa" in keys, name
        assert "actor_rollout_ref.model.use_remove_padding=False" in keys, name
    cached = [name for name, keys in by_name.items() if "skip.rollout_tq.enable=True" in keys]
    assert cached == ["off", "control", "reweight"]  # SPEED's continuation rounds generate fresh
    assert "+dataflex.warmup_step=1" in by_name["control"] and "trainer.save_freq=1" in by_name["off"]
    assert "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16" in by_name["speed"]
    assert all("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32" in by_name[n]
               for n in ("off", "control", "reweight"))
    assert [f"trainer.total_training_steps={s}" in by_name[n] for n, s in
            (("off", 2), ("control", 1), ("reweight", 1), ("speed", 2))] == [True] * 4


def test_the_time_plan_fits_eight_minutes_on_one_h100(gc):
    stages = dict(gc.time_plan(gc.GPU_TIMEOUTS))
    assert stages["total"] == sum(v for k, v in stages.items() if k != "total") <= gc.BUDGET_S == 480
    assert stages["preflight"] == gc.PREFLIGHT_S == 20


def test_dry_run_prints_the_commands_and_the_plan_and_runs_nothing(gc, capsys, tmp_path):
    assert gc.main(["--dry-run", "--out", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "w").exists()
    lines = {line.split("]")[0].lstrip("["): line for line in out.splitlines() if line.startswith("[")}
    assert set(lines) >= {"preflight", *gc.RUNS}
    command = shlex.split(lines["speed"].split(": ", 1)[1])
    assert command[:3] == [sys.executable, "-m", "verl.trainer.main_ppo"]
    assert "+dataflex.actuator.name=speed" in command and "actor_rollout_ref.rollout.name=vllm" in command
    assert "budget 480 s: fits" in out and "sizing:" in out and "total" in out
    assert gc.main(["--dry-run", "--timeout-scale", "2"]) == 0
    assert "EXCEEDS" in capsys.readouterr().out
    assert gc.main(["--dry-run", "--install", "--venv", str(tmp_path / "v")]) == 0
    assert f"pip install {gc.VERL_PIN}" in capsys.readouterr().out.replace("'", "")


def test_dry_run_cpu_rehearses_the_same_runs_on_cpu_hf(gc, capsys):
    assert gc.main(["--dry-run", "--cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("actor_rollout_ref.rollout.name=cpu_hf") == len(gc.RUNS) and "vllm" not in out.split("time")[0]


#: Stands in for main_ppo: records start/end in a journal, writes a file log, exits with the given status.
FAKE_TRAINER = """
import json, os, sys, time
name, status, wait, journal = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
def note(what):
    with open(journal, "a") as fh:
        fh.write(f"{what} {name}\\n")
note("start")
time.sleep(wait)
print(f"step:1 - actor/pg_loss:np.float64(0.25) - name_len:{len(name)}", flush=True)
if name != "console_only":
    with open(os.environ["VERL_FILE_LOGGER_PATH"], "w") as fh:
        fh.write(json.dumps({"step": 1, "data": {"actor/pg_loss": 0.5}}) + "\\n")
note("end")
sys.exit(status)
"""


@pytest.mark.integration
def test_runs_go_one_at_a_time_and_a_failed_dependency_starts_nothing(gc, tmp_path):
    fake, journal = tmp_path / "fake.py", tmp_path / "journal"
    fake.write_text(FAKE_TRAINER)

    def run(name, status=0, after=None):
        return gc.Run(name, [name, str(status), "0.3", str(journal)], after, timeout=60)

    runs = [run("off"), run("control", after="off"), run("console_only"), run("broken", status=3),
            run("after_broken", after="broken")]
    results = gc.run_sequentially(runs, tmp_path, dict(os.environ), command=[sys.executable, str(fake)])
    events = journal.read_text().split("\n")[:-1]
    assert events == [f"{what} {name}" for name in ("off", "control", "console_only", "broken")
                      for what in ("start", "end")]
    assert {n: r.returncode for n, r in results.items()} == {
        "off": 0, "control": 0, "console_only": 0, "broken": 3, "after_broken": "not started (broken failed)"}
    assert results["off"].metrics == {1: {"actor/pg_loss": 0.5}}  # the file logger wins
    assert results["console_only"].metrics == {1: {"actor/pg_loss": 0.25, "name_len": 12.0}}


@pytest.mark.integration
def test_a_run_past_its_timeout_is_ended_and_reported(gc, tmp_path):
    fake, journal = tmp_path / "fake.py", tmp_path / "journal"
    fake.write_text(FAKE_TRAINER)
    result = gc.launch(gc.Run("slow", ["slow", "0", "120", str(journal)]), tmp_path,
                       dict(os.environ), timeout=1, command=[sys.executable, str(fake)])
    assert result.returncode == "timeout after 1 s" and result.metrics == {}
    assert journal.read_text().split() == ["start", "slow"]


def test_select_is_the_seed_quick_start_verbatim_and_control_its_warming_up_copy(gc):
    sys.path.insert(0, str(HERE))
    from seed_config import SEED

    assert gc.METHODS["select"] == SEED
    assert gc.METHODS["control"] == [*SEED[:-1], "+dataflex.warmup_step=1"]


# ---------------------------------------------------------------------------------------------- preflight
#: The probes' time in the tests that check what they find.
PROBE_S = 120.0


@pytest.mark.verl
def test_preflight_names_what_this_cpu_box_lacks_for_the_gpu_check(gc):
    # What is missing, not how fast: a loaded 2-core CI box may take longer than the GPU box's 20 s to import verl
    # three times at once (the bound itself: test_preflight_gives_up_in_time_naming_the_probe).
    missing = gc.preflight(sys.executable, dict(os.environ), cpu=False, timeout=PROBE_S)
    assert [m.split(":")[0] for m in missing] == ["CUDA", "vLLM"], missing
    assert "torch.cuda.is_available() is False" in missing[0]
    assert gc.preflight(sys.executable, dict(os.environ), cpu=True, timeout=PROBE_S) == []


@pytest.mark.verl
def test_preflight_names_an_unregistered_trainer_mode(gc):
    missing = gc.preflight(sys.executable, {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"}, cpu=True,
                           timeout=PROBE_S)
    assert len(missing) == 1 and missing[0].startswith("dataflex_sync: `import verl` did not register it")
    assert "VERL_USE_EXTERNAL_PLUGINS" in missing[0]


@pytest.mark.integration
def test_preflight_gives_up_in_time_naming_the_probe(gc, tmp_path):
    hanging = tmp_path / "python"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(hanging.stat().st_mode | stat.S_IEXEC)
    missing = gc.preflight(str(hanging), dict(os.environ), cpu=False, timeout=1.0)
    assert [m.split(":")[0] for m in missing] == list(gc.PROBES)
    assert all("gave no answer within 1 s" in m for m in missing)


# ---------------------------------------------------------------------------------------------- metric prints
@pytest.mark.parametrize("text, value", [
    ("np.float64(0.4440848231315613)", 0.4440848231315613), ("np.int32(2)", 2.0), ("np.True_", 1.0),
    ("0.5", 0.5), ("16", 16.0), ("1e-06", 1e-06), ("-1.48", -1.48), ("False", 0.0), ("np.float32(nan)", math.nan),
    ("inf", math.inf), ("'text'", None), ("[1, 2]", None),
])
def test_values_as_verl_prints_them(gc, text, value):
    parsed = gc.parse_value(text)
    if value is None or math.isnan(value):
        assert (parsed is None) if value is None else math.isnan(parsed)
    else:
        assert parsed == value


def test_console_lines_with_ray_prefixes_and_numpy_scalars(gc):
    text = ("\x1b[36m(TaskRunnerV1 pid=9271)\x1b[0m step:1 - actor/pg_loss:0.0359 - num_turns/min:np.int32(2) - "
            "num_turns/mean:np.float64(2.0) - training/global_step:1\nunrelated line\n"
            "(TaskRunnerV1 pid=9271) step:2 - actor/pg_loss:np.float64(-0.5)")
    assert gc.parse_console(text) == {
        1: {"actor/pg_loss": 0.0359, "num_turns/min": 2.0, "num_turns/mean": 2.0, "training/global_step": 1.0},
        2: {"actor/pg_loss": -0.5}}


def test_recorded_console_log_parses_like_the_file_logger(gc, recorded):
    console = gc.parse_console((FIXTURES / "gpu_smoke_off_console.log").read_text())
    assert sorted(console) == sorted(recorded["off"]) == [1, 2, 3]
    assert "np.float64(" in (FIXTURES / "gpu_smoke_off_console.log").read_text()
    for step, values in recorded["off"].items():
        assert console[step]["num_turns/mean"] == 2.0
        for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean", "dataflex/rollout/rows"):
            assert console[step][key] == pytest.approx(values[key], rel=1e-9), key


def test_file_logger_lines(gc, tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":1,"data":{"a":1.5,"b":2,"s":"x"}}\n\n{"step":2,"data":{"a":null}}\n')
    assert gc.read_file_log(path) == {1: {"a": 1.5, "b": 2.0}, 2: {}}


# ---------------------------------------------------------------------------------------------- checks
def test_every_check_passes_on_the_recorded_runs(gc, recorded, tmp_path):
    folder = tmp_path / "ckpt_off" / "global_step_2"
    (folder / "actor").mkdir(parents=True)
    (folder / "actor" / "model.pt").write_bytes(b"x")
    (folder / gc.STATE_FILE).write_bytes(b"x")
    checks = gc.evaluate(recorded, tmp_path)
    assert len(checks) == 6
    failed = [c.line() for c in checks if not c.ok]
    assert not failed, failed


def test_the_state_file_check_fails_without_the_file_or_verls_checkpoint(gc, tmp_path):
    folder = tmp_path / "global_step_2"
    assert not gc.check_state_beside_checkpoint(tmp_path, 2).ok  # no folder at all
    (folder / "actor").mkdir(parents=True)
    (folder / "actor" / "model.pt").write_bytes(b"x")
    check = gc.check_state_beside_checkpoint(tmp_path, 2)
    assert not check.ok and "['actor']" in check.detail
    (folder / gc.STATE_FILE).write_bytes(b"x")
    assert gc.check_state_beside_checkpoint(tmp_path, 2).ok


def test_log_probs_that_disagree_fail(gc, recorded):
    off = copy.deepcopy(recorded["off"])
    assert gc.check_logprobs_agree(off, [1, 2]).ok
    off[2]["training/rollout_probs_diff_mean"] = 0.2  # vLLM left on other weights after the step-1 sync
    assert not gc.check_logprobs_agree(off, [1, 2]).ok
    off = copy.deepcopy(recorded["off"])
    off[1]["training/rollout_actor_probs_pearson_corr"] = 0.5
    check = gc.check_logprobs_agree(off, [1, 2])
    assert not check.ok and "pearson 0.5" in check.detail


def test_a_control_whose_method_acted_fails(gc, recorded):
    off = recorded["off"]
    acting = {1: {**recorded["select"][1], "dataflex/warmup": 1.0}}  # rows removed at step 1
    assert not gc.check_control(off, acting, 1).ok
    not_warm = {1: {**recorded["control"][1], "dataflex/warmup": 0.0}}  # equal, but the method was not warming up
    check = gc.check_control(off, not_warm, 1)
    assert not check.ok and "not warming up" in check.detail


def test_a_method_that_did_nothing_fails_its_check(gc, recorded):
    inert = dict(recorded, reweight=recorded["off2"])  # the method run trained exactly like the control
    checks = names(gc.evaluate(inert))
    assert not checks["reweight: weights reach the loss"].ok
    assert checks["control: warming-up method equals off"].ok


def test_reweight_with_constant_weights_fails_even_if_the_loss_moved(gc, recorded):
    runs = copy.deepcopy(recorded)
    runs["reweight"][1]["dataflex/weight_std"] = 0.0
    assert not names(gc.evaluate(runs))["reweight: weights reach the loss"].ok


def test_loss_change_within_the_control_noise_fails(gc, recorded):
    off = recorded["off"]
    noise = 2 * abs(recorded["reweight"][1]["actor/pg_loss"] - off[1]["actor/pg_loss"])
    assert not gc.check_reweight(off, recorded["reweight"], 1, noise / 10).ok
    assert gc.check_reweight(off, recorded["reweight"], 1, 0.0).ok


def test_speed_fails_off_the_plan(gc, recorded):
    speed = recorded["speed"]
    assert gc.check_speed(speed, [1, 2]).ok
    for step, key, delta in ((1, "compute/generated_rollouts", 1.0), (2, "dataflex/alloc/max", -1.0),
                             (2, "dataflex/trained/rows", -gc.N)):
        broken = copy.deepcopy(speed)
        broken[step][key] += delta
        assert not gc.check_speed(broken, [1, 2]).ok, key
    # a step that continued nothing proves nothing about continuation rounds
    idle = copy.deepcopy(speed)
    idle[1].update({"dataflex/alloc/continued": 0.0, "dataflex/alloc/max": float(gc.N)})
    assert not gc.check_speed(idle, [1]).ok


def test_speed_plan_counts_failed_groups_and_continuations_out(gc):
    m = {1: {"dataflex/alloc/continued": 2.0, "dataflex/refill/failed_groups": 1.0,
             "dataflex/refill/failed_continuations": 1.0}}
    # a failed screening group generates nothing counted; a failed continuation leaves its group its n rows
    assert gc.speed_plan(m, 1) == {"generated": 3 * gc.N + 2 * gc.N_CONTINUE, "largest": gc.N + gc.N_CONTINUE,
                                   "trained": 2 * (gc.N + gc.N_CONTINUE) + gc.N, "continued": 2.0, "failed": 1.0,
                                   "failed_continuations": 1.0}


def test_mix_fails_when_draws_ignore_the_published_probabilities(gc):
    probs = {"math": 0.7, "code": 0.1, "logic": 0.2}
    m = {1: {f"dataflex/domain_prob/{d}": p for d, p in probs.items()},
         2: {"dataflex/drawn/math": 0.0, "dataflex/drawn/code": 4.0, "dataflex/drawn/logic": 0.0}}
    check = gc.check_mix(m)
    assert not check.ok and "uniform draws explain them better" in check.detail
    m[2] = {"dataflex/drawn/math": 3.0, "dataflex/drawn/code": 0.0, "dataflex/drawn/logic": 1.0}
    assert gc.check_mix(m).ok


def test_mix_fails_when_the_mixer_published_uniform_probabilities(gc):
    m = {1: {f"dataflex/domain_prob/{d}": 1 / 3 for d in gc.DOMAINS},
         2: {"dataflex/drawn/math": 4.0}}
    check = gc.check_mix(m)
    assert not check.ok and "uniform" in check.detail


def test_mix_fails_on_a_draw_from_a_zero_probability_domain(gc):
    m = {1: {"dataflex/domain_prob/a": 1.0, "dataflex/domain_prob/b": 0.0},
         2: {"dataflex/drawn/a": 3.0, "dataflex/drawn/b": 1.0}}
    check = gc.check_mix(m)
    assert not check.ok and "probability 0: ['b']" in check.detail


def test_resume_and_off_off_fail_on_a_diverging_metric(gc, recorded):
    off, off2 = recorded["off"], copy.deepcopy(recorded["off2"])
    resumed = {3: copy.deepcopy(off[3])}
    assert gc.check_resume(off, resumed, 3).ok and gc.check_off_off(off, off2, [1, 2]).ok
    resumed[3]["actor/pg_loss"] += 0.01
    off2[2]["critic/score/mean"] += 0.01
    check = gc.check_resume(off, resumed, 3)
    assert not check.ok and "actor/pg_loss" in check.detail
    check = gc.check_off_off(off, off2, [1, 2])
    assert not check.ok and "critic/score/mean" in check.detail


def test_a_run_that_logged_nothing_is_a_fail_not_a_crash(gc, recorded):
    runs = dict(recorded, control={}, speed={1: {}, 2: {}})
    checks = names(gc.evaluate(runs))
    control = checks["control: warming-up method equals off"]
    assert not control.ok and "step 1 missing (second run)" in control.detail
    assert not checks["speed"].ok and "logged no 'dataflex/alloc/continued'" in checks["speed"].detail
    assert not names(gc.evaluate(dict(recorded, reweight={})))["reweight"].ok


# ---------------------------------------------------------------------------------------------- inputs (verl)
@pytest.mark.verl
def test_every_run_composes_and_the_reward_has_signal(gc, tmp_path):
    pytest.importorskip("verl")
    import pandas as pd
    import verl_harness as H
    from verl.trainer.ppo.reward import get_custom_reward_fn

    inputs = gc.Inputs(tmp_path / "model", gc.write_data(tmp_path), gc.write_reward(tmp_path))
    for run in gc.plan(inputs, tmp_path, seed=1, rollout="vllm", extra=gc.GPU_KEYS, timeouts=gc.GPU_TIMEOUTS):
        cfg = H.compose(run.overrides)
        assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == gc.BATCH  # one mini-batch per step
        # what verl's HFModelConfig and FSDP engine read (verl/workers/config/model.py)
        assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
        assert cfg.actor_rollout_ref.model.use_remove_padding is False
    score = get_custom_reward_fn(cfg)  # what verl's reward workers load
    frame = pd.read_parquet(inputs.data)
    assert list(frame["data_source"][:6]) == [*gc.DOMAINS, *gc.DOMAINS]
    for start in range(0, len(frame), gc.BATCH):  # every training batch holds a code prompt
        assert "code" in set(frame["data_source"][start:start + gc.BATCH])
    responses = ["7 12 code 88 3", "93 61 answer 70 51", ""]
    got = {d: [score(data_source=d, solution_str=r, ground_truth="0") for r in responses] for d in gc.DOMAINS}
    assert got == {"math": [0.6, 0.0, 0.0], "logic": [0.2, 0.8, 0.0], "code": [0.0, 0.0, 0.0]}


def test_comparisons_insist_on_the_training_metrics(gc, recorded):
    off2 = copy.deepcopy(recorded["off2"])
    del off2[1]["actor/pg_loss"]
    check = gc.check_off_off(recorded["off"], off2, [1, 2])
    assert not check.ok and "step 1 actor/pg_loss: missing" in check.detail
