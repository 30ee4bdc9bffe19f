"""DataflexGRPOTrainer over whole runs: plain TRL when there is no block, refill, domain sampling, the method
packs and examples unchanged, and checkpoints (k steps + resume + k steps == 2k steps)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

import torch
import trl_tiny as T

from dataflex_bus.errors import ConfigError
from dataflex_bus.state_file import CheckpointError, read_state, save_state
from dataflex_bus.trl import DataflexGRPOTrainer

pytestmark = pytest.mark.trl

ROOT = Path(__file__).resolve().parents[2]
MIXED, FLAT = T.prompts()
DAPO = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}}
QUICK_START = {"mechanism": "select", "scorer": {"name": "group_solve_rate", "params": {"success_threshold": 0.5}},
               "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}, "warmup_step": 0}


def with_domains(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows labelled by the parity of their first operand (a ``data_source`` column for the mixers)."""
    return [{**r, "data_source": "even" if int(r["prompt"][0]) % 2 == 0 else "odd"} for r in rows]


def test_no_block_trains_bit_identically_to_plain_trl():
    """Real sampling (no scripted completions), the same seed and initial weights; the old-log-prob pass is
    TRL's (ga < spg). The kit still counts and logs."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    kw = dict(rows=rows, scripted=False, rows_per_gen=8, spg=2, ga=1, steps=4, width=4, reward_funcs=[T.length])
    a = T.train(DataflexGRPOTrainer, **kw)
    b = T.train(**kw)
    assert T.compare(a, b) == 0.0 and a["losses"] == b["losses"]
    assert any(float(g.abs().max()) > 0 for g in b["grads"][0].values())
    assert a["logs"][-1]["compute/generated_rollouts"] == 16


class Recording(DataflexGRPOTrainer):
    """Remembers the prompts of the groups each generation batch trained, in training order."""

    def _dfx_replay(self, rounds, kept):
        self.trained_prompts = [*getattr(self, "trained_prompts", []),
                                *[rounds[a].inputs[b]["prompt"] for a, b in kept.refs][::T.G]]
        return super()._dfx_replay(rounds, kept)


def test_refill_trains_full_batches_of_kept_groups_exactly():
    """Dynamic sampling: rounds of TRL's generation until 4 groups are kept; the update equals plain TRL on a
    dataset of exactly the groups trained, and every generated rollout is counted."""
    rows = [r for pair in zip(FLAT[:8], MIXED[:8]) for r in pair]
    block = {**DAPO, "refill": {"policy": "fixed", "max_rounds": 10}}
    a = T.train(Recording, rows=rows, rows_per_gen=16, spg=2, ga=1, loss_type="bnpo", steps=4,
                trainer_kwargs={"dataflex": block})
    metrics = a["trainer"].dataflex_metrics
    assert [m["dataflex/refill/trained_groups"] for m in metrics] == [4.0, 4.0]
    assert all(m["dataflex/refill/rounds"] >= 2 for m in metrics)
    assert metrics[-1]["compute/generated_rollouts"] == 4 * sum(m["dataflex/refill/generated_groups"] for m in metrics)
    answers = {r["prompt"]: r for r in rows}
    b = T.train(rows=[answers[p] for p in a["trainer"].trained_prompts], rows_per_gen=16, spg=2, ga=1,
                loss_type="bnpo", steps=4)
    assert T.compare(a, b) == 0.0


def test_the_sampler_follows_the_published_domain_probabilities():
    rows = with_domains(MIXED[:8] + FLAT[:8])
    block = {"mechanism": "mix", "scorer": {"name": "advantage_magnitude"},
             "actuator": {"name": "static", "params": {"proportions": {"even": 1.0, "odd": 0.0}}}}
    a = T.train(Recording, rows=rows, rows_per_gen=8, steps=3, trainer_kwargs={"dataflex": block})
    first, *later = a["trainer"].dataflex_metrics
    assert first["dataflex/sample_prob/even"] == 0.5 and first["dataflex/domain_prob/even"] == 1.0
    for m in later:  # published at the end of a generation batch, drawn by from the next one on
        assert m["dataflex/sample_prob/even"] == 1.0
        assert m["dataflex/rollout/rows/even"] == 8 and "dataflex/rollout/rows/odd" not in m


def test_the_seed_quick_start_and_the_stack_example_run_unchanged():
    rows = with_domains(T.interleave(MIXED[:8], FLAT[:8], 2, 2))
    a = T.train(DataflexGRPOTrainer, rows=rows, rows_per_gen=16, steps=2, trainer_kwargs={"dataflex": QUICK_START})
    assert all(m["dataflex/removed_rows"] == 8 for m in a["trainer"].dataflex_metrics)
    stack = T.train(DataflexGRPOTrainer, rows=rows, rows_per_gen=16, steps=2,
                    trainer_kwargs={"dataflex": str(ROOT / "examples" / "stack_dapo_dump_ar.yaml")})
    m = stack["trainer"].dataflex_metrics[-1]
    assert m["dataflex/filter/kept_fraction"] == 0.5
    assert m["dataflex/ar/weight_std"] > 0 and {"dataflex/curriculum/domain_prob/even",
                                                "dataflex/curriculum/domain_prob/odd"} <= set(m)
    logged = stack["logs"][-1]
    assert logged["dataflex/ar/weight_mean"] == m["dataflex/ar/weight_mean"]


def test_the_gfpo_pack_runs_in_trl(register, dataflex_plugin_env, monkeypatch):
    """contrib/dataflex-gfpo: the k shortest of each group kept, advantages recomputed over them. The pack's
    source is registered in-process beside the first-party packs only: an installed dataflex-gfpo (or the
    ``src/*.egg-info`` that building it in place leaves, a distribution once ``src`` is on sys.path) would
    otherwise provide a second ``gfpo``."""
    monkeypatch.syspath_prepend(str(ROOT / "contrib" / "dataflex-gfpo" / "src"))
    dataflex_plugin_env(load=["dataflex-bus"])
    register("selector", "gfpo", "dataflex_gfpo.selector:GFPO")
    block = {"mechanism": "select", "scorer": {"name": "reward_difficulty"},
             "actuator": {"name": "gfpo", "params": {"metric": "length", "k": 2}}}
    a = T.train(DataflexGRPOTrainer, rows=MIXED[:8], rows_per_gen=16, steps=2, trainer_kwargs={"dataflex": block})
    for m in a["trainer"].dataflex_metrics:
        assert m["dataflex/trained/rows"] == 8 and m["dataflex/trained/groups"] == 4


STACK = str(ROOT / "examples" / "stack_dapo_dump_ar.yaml")
GRESO = {"methods": [
    {"name": "greso", "mechanism": "select", "scorer": {"name": "zero_variance_streak"},
     "actuator": {"name": "greso", "params": {"p_easy_init": 0.5, "p_hard_init": 0.5, "adapt_from_epoch": 0}}},
    {"name": "dapo", **DAPO}]}


def _comparable(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The logged metrics that a resumed run must reproduce (wall times excluded)."""
    return [{k: v for k, v in h.items() if "time" not in k and "per_second" not in k} for h in logs]


@pytest.mark.parametrize("block", [STACK, GRESO], ids=["stack", "greso"])
def test_k_steps_then_resume_then_k_steps_is_2k_steps(tmp_path, block):
    """The plugin state (methods, prompt history, the prompt stream, the kit's counters) rides in TRL's
    checkpoint folder and is restored by resume_from_checkpoint."""
    rows = with_domains(T.interleave(MIXED[:12], FLAT[:12], 2, 2))
    kw = dict(rows=rows, rows_per_gen=16, steps=4, save_strategy="steps", save_steps=2,
              trainer_kwargs={"dataflex": block})
    whole = T.train(DataflexGRPOTrainer, out=str(tmp_path / "whole"), **kw)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert (checkpoint / "dataflex_state.pt").is_file()
    resumed = T.train(DataflexGRPOTrainer, out=str(tmp_path / "resumed"), resume=str(checkpoint), **kw)
    # The resumed run's log holds the checkpoint's history (steps 1-2) and its own steps 3-4.
    assert [h["step"] for h in resumed["logs"]] == [1, 2, 3, 4]
    assert _comparable(resumed["logs"]) == _comparable(whole["logs"])
    assert all(torch.equal(whole["params"][n], p) for n, p in resumed["params"].items())


def test_a_checkpoint_without_dataflex_state_resumes_fresh_with_a_warning(tmp_path, dataflex_log):
    rows = T.interleave(MIXED[:4], FLAT[:4], 2, 2)
    T.train(rows=rows, rows_per_gen=16, steps=2, save_strategy="steps", save_steps=1, out=str(tmp_path / "plain"))
    resumed = T.train(DataflexGRPOTrainer, rows=rows, rows_per_gen=16, steps=2, resume=str(tmp_path / "plain" /
                      "checkpoint-1"), trainer_kwargs={"dataflex": DAPO})
    assert resumed["trainer"].dataflex_batch.generations == 2
    assert any("holds no dataflex_state.pt" in r.getMessage() for r in dataflex_log.records
               if r.levelno == logging.WARNING)
    assert os.path.isdir(tmp_path / "plain" / "checkpoint-1")


def test_resume_with_another_block_names_the_keys_and_the_side_that_has_one(tmp_path):
    """Before: ``saved {...}, now {...}`` (both whole blocks) and, with ``dataflex=None``, "disagree on whether a
    dataflex method is configured" without saying which side has the block; neither said what to do."""
    from dataflex_bus.confdiff import RESUME_FIX
    from dataflex_bus.errors import ConfigError

    rows = T.interleave(MIXED[:4], FLAT[:4], 2, 2)
    kw = dict(rows=rows, rows_per_gen=16, steps=2)
    T.train(DataflexGRPOTrainer, out=str(tmp_path / "a"), save_strategy="steps", save_steps=1,
            trainer_kwargs={"dataflex": QUICK_START}, **kw)
    checkpoint = str(tmp_path / "a" / "checkpoint-1")
    other = {**QUICK_START, "actuator": {"name": "threshold_band", "params": {"low": 0.25, "high": 0.8}}}
    with pytest.raises(ConfigError) as err:
        T.train(DataflexGRPOTrainer, out=str(tmp_path / "b"), resume=checkpoint, trainer_kwargs={"dataflex": other},
                **kw)
    text = str(err.value)
    assert "dataflex.actuator.params.low: checkpoint 0.2, this run 0.25" in text and RESUME_FIX in text
    assert "success_threshold" not in text
    with pytest.raises(ConfigError) as err:
        T.train(DataflexGRPOTrainer, out=str(tmp_path / "c"), resume=checkpoint, trainer_kwargs={"dataflex": None},
                **kw)
    text = str(err.value)
    assert "checkpoint: a dataflex block (select group_solve_rate+threshold_band); this run: none" in text
    assert "the checkpoint's block: {" in text


def test_a_bare_name_for_dataflex_is_refused_saying_what_dataflex_takes():
    from dataflex_bus.errors import ConfigError

    tok = T.tokenizer()
    with pytest.raises(ConfigError, match=r"'dynamic_sampling' is no file; dataflex= takes a block \(a mapping"):
        DataflexGRPOTrainer(model=T.model(tok), reward_funcs=[T.correct], args=T.config("unused", rows_per_gen=8),
                            processing_class=tok, dataflex="dynamic_sampling")


def test_a_model_built_from_a_config_without_processing_class_is_refused_naming_it():
    """Before: ``OSError: Repo id must use alphanumeric chars ...: ''`` from inside the Hub client."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dataflex_bus.errors import ConfigError

    model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ConfigError, match=r"processing_class: not given, and the model was built from a config"):
        DataflexGRPOTrainer(model=model, reward_funcs=[T.correct], args=T.config("unused", rows_per_gen=8),
                            dataflex=QUICK_START)


def test_a_skipped_update_logs_no_grad_norm_and_a_run_mostly_skipped_ends_with_a_summary(dataflex_log):
    """Before: TRL logged a grad_norm for every skipped update, and a run whose every update was skipped ended
    like one that trained (no line saying so)."""
    # Generation batch 1 only flat groups (skipped), batch 2 mixed ones (trained); shuffle_dataset=False.
    run = T.train(DataflexGRPOTrainer, rows=[*FLAT[:4], *MIXED[:4]], rows_per_gen=16, steps=2,
                  trainer_kwargs={"dataflex": DAPO})
    first, second = run["logs"]
    assert first["dataflex/skipped_update"] == 1.0 and "grad_norm" not in first
    assert second["dataflex/skipped_update"] == 0.0 and second["grad_norm"] > 0
    warnings = [r.getMessage() for r in dataflex_log.records if r.levelno == logging.WARNING]
    assert not any("updates were skipped" in w for w in warnings)  # half skipped: no summary
    T.train(DataflexGRPOTrainer, rows=FLAT[:8], rows_per_gen=16, steps=2, trainer_kwargs={"dataflex": DAPO})
    (line,) = [r.getMessage() for r in dataflex_log.records if "updates were skipped" in r.getMessage()]
    assert line.startswith("dataflex: 2 of 2 updates were skipped")
    assert "select:dapo (reward_difficulty+dapo @ on_rollout) kept 0.0% of the rows it saw" in line


def test_what_trl_cannot_run_is_refused_at_construction_naming_the_field():
    from datasets import Dataset

    tok = T.tokenizer()
    rows = MIXED[:4]

    def build(dataset: Any, **cfg: Any) -> None:
        DataflexGRPOTrainer(model=T.model(tok), reward_funcs=[T.correct], processing_class=tok, train_dataset=dataset,
                            args=T.config("/tmp/dataflex-refused", rows_per_gen=8, **cfg), dataflex=DAPO)

    with pytest.raises(ConfigError, match=r"GRPOConfig\.loss_type"):
        build(Dataset.from_list(rows), loss_type="made_up")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        build(Dataset.from_list(rows), spg=2, ga=4)
    with pytest.raises(ConfigError, match="train_dataset"):
        build(Dataset.from_list([{**r, "image": None} for r in rows]))
    with pytest.raises(ConfigError, match="train_dataset"):
        DataflexGRPOTrainer(model=T.model(tok), reward_funcs=[T.correct], processing_class=tok,
                            train_dataset=Dataset.from_list(rows).to_iterable_dataset(),
                            args=T.config("/tmp/dataflex-refused", rows_per_gen=8, steps=1),
                            dataflex={**DAPO, "refill": {"max_rounds": 2}})


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated or extended"),
    (lambda p: p.write_bytes(b""), "the file is empty"),
    (lambda p: p.write_bytes(bytes(range(256)) * 8), "no dataflex-checkpoint/1 header"),
    (lambda p: save_state(p, {k: v for k, v in read_state(p, "").items() if k != "kit"}), "entry 'kit' is missing"),
    (lambda p: save_state(p, {**read_state(p, ""), "runtime": {"pipeline": {}}}), "entry 'runtime'"),
], ids=["truncated", "empty", "random", "entry-missing", "entry-unfit"])
def test_a_damaged_dataflex_state_file_is_refused_naming_the_file_and_entry(tmp_path, damage, message):
    """TRL's checkpoint-N/dataflex_state.pt is written behind the kit's checksum header and read back checked."""
    kw = dict(rows=T.interleave(MIXED[:4], FLAT[:4], 2, 2), rows_per_gen=16, steps=2, save_strategy="steps",
              save_steps=1, trainer_kwargs={"dataflex": DAPO})
    T.train(DataflexGRPOTrainer, out=str(tmp_path / "run"), **kw)
    path = tmp_path / "run" / "checkpoint-1" / "dataflex_state.pt"
    assert path.read_bytes().startswith(b"dataflex-checkpoint/1 sha256=")
    damage(path)
    with pytest.raises((CheckpointError, ConfigError), match=message) as err:
        T.train(DataflexGRPOTrainer, out=str(tmp_path / "resumed"), resume=str(path.parent), **kw)
    assert str(path) in str(err.value)


def _construct(dataflex: Any, rows: list[dict[str, Any]] | None = None, *, iterable: bool = False,
               **kwargs: Any) -> DataflexGRPOTrainer:
    """A trainer built (not trained) on ``rows`` (default: the 100 scripted prompts)."""
    from datasets import Dataset

    tok = T.tokenizer()
    data = Dataset.from_list(rows if rows is not None else [*MIXED, *FLAT])
    return DataflexGRPOTrainer(model=T.model(tok), reward_funcs=[T.correct], processing_class=tok,
                               train_dataset=data.to_iterable_dataset() if iterable else data,
                               args=T.config("/tmp/dataflex-refused", rows_per_gen=16, steps=1), dataflex=dataflex,
                               **kwargs)


@pytest.mark.parametrize("name", ["repo_replay", "dots_replay"])
def test_a_replay_example_over_an_iterable_dataset_is_refused_at_construction_naming_train_dataset(name, monkeypatch):
    """Before: ``TypeError: object of type 'IterableDataset' has no len()`` after TRL had built the model."""
    import trl

    def built(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("GRPOTrainer.__init__ ran before the refusal")

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", built)  # the refusal comes before any model work
    with pytest.raises(ConfigError) as err:
        _construct(str(ROOT / "examples" / f"{name}.yaml"), iterable=True)
    text = str(err.value)
    assert "dataflex.mechanism" in text and "train_dataset is an IterableDataset" in text
    assert "datasets.Dataset" in text


class _Env:
    """An environment TRL would build per rollout (``environment_factory``)."""

    def reset(self, **kwargs: Any) -> str:
        return ""


@pytest.mark.parametrize("name", ["knapsack", "speed", "pilot_commit", "reinforce_ada"])
def test_every_allocation_example_under_environment_factory_is_refused_at_construction(name):
    """Before: Knapsack (allocating before generation) was accepted, and TRL ran its generation again with
    ``reset()`` on every environment; SPEED, Pilot-Commit and Reinforce-Ada were refused."""
    with pytest.raises(ConfigError) as err:
        _construct(str(ROOT / "examples" / f"{name}.yaml"), rows=[{"prompt": f"{a}+{b}=", "answer": str(a + b)}
                                                                  for a in range(20) for b in range(10)],
                   environment_factory=_Env)
    text = str(err.value)
    assert "environment_factory" in text and "allocates rollouts per prompt" in text and "rollout_func" in text


def test_pilot_commit_on_a_dataset_smaller_than_its_pilot_round_is_refused_at_construction():
    """Before: step 0 failed with the kit's internal "draw what request() asks for"."""
    with pytest.raises(ConfigError) as err:
        _construct(str(ROOT / "examples" / "pilot_commit.yaml"))  # 100 rows, pilot rounds of 192
    text = str(err.value)
    assert "dataflex.refill.gen_batch_size: 192" in text and "train_dataset holds 100 rows" in text


def test_evicted_prompts_generated_to_fill_a_round_are_warned_once(dataflex_log):
    """Once every prompt is evicted (solved), a round is filled with skipped candidates: before, silently."""
    evict = {"mechanism": "select", "scorer": {"name": "max_solve_rate"},
             "actuator": {"name": "exclude_solved", "params": {"exclude_threshold": 1.0}}}
    solved = [r for r in FLAT if int(r["answer"]) % 2 == 0][:4]  # every scripted completion is right
    run = T.train(DataflexGRPOTrainer, rows=solved, rows_per_gen=16, steps=3, trainer_kwargs={"dataflex": evict})
    forced = [m["dataflex/prompts_forced"] for m in run["trainer"].dataflex_metrics]
    assert forced[0] == 0 and forced[1] == forced[2] == 4
    lines = [r.getMessage() for r in dataflex_log.records if "skipped candidates" in r.getMessage()]
    assert len(lines) == 1 and "dataflex/prompts_forced" in lines[0] and "4 of 4" in lines[0], lines


@pytest.mark.parametrize("text", ["dataflex:\nmechanism: select\nscorer: {name: reward_difficulty}\n"
                                  "actuator: {name: dapo}\n", "dataflex:\n", "dataflex: {}\n"],
                         ids=["mis-indented", "bare", "empty-mapping"])
def test_a_yaml_file_with_an_empty_dataflex_block_is_refused_at_construction(tmp_path, text):
    """Before: the trainer trained plain TRL without a word (dataflex=None is how plain TRL is asked for)."""
    path = tmp_path / "method.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"'dataflex:' block is empty.*dataflex=None") as err:
        _construct(str(path))
    assert str(path) in str(err.value)


def test_trl_s_hook_points_run_plain_trl_on_a_trainer_made_without_init(monkeypatch):
    """TRL's own tests build a trainer with ``__new__`` and call ``_generate`` on it: the subclass's hook points
    run TRL's code there (no dataflex state, no pass)."""
    from trl import GRPOTrainer

    trainer = DataflexGRPOTrainer.__new__(DataflexGRPOTrainer)
    assert trainer._dfx_current_pass() is None
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self, prompts: ("plain", prompts))
    assert trainer._generate(["p"]) == ("plain", ["p"])
