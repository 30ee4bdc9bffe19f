"""Pre-rollout selection, the per-prompt history and dataflex refill inside verl 0.9.1 (semi-e2e harness,
see verl_harness.py): prompts are filtered at ``_next_train_batch`` (first batch and refills), every
finished group enters the history (also the groups verl's own DAPO evicts), the history is checkpointed
and exact after resume, and prompt ids that cannot be trusted are refused when the dataloader is built."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.verl]

#: GRESO alone: a code prompt (never solved in the harness) seen once is kept with probability 0.05.
GRESO = ["+dataflex.mechanism=select", "+dataflex.scorer.name=zero_variance_streak",
         "+dataflex.actuator.name=greso", "+dataflex.actuator.params.p_hard_init=0.05",
         "+dataflex.actuator.params.p_min=0.05", "+dataflex.actuator.params.adapt_from_epoch=100"]
DAPO_REFILL = ["+dataflex.mechanism=select", "+dataflex.scorer.name=reward_difficulty",
               "+dataflex.actuator.name=dapo", "+dataflex.refill.policy=credit2", "+dataflex.refill.max_rounds=0"]


def generated(run) -> list[list[int]]:
    """Dataset row (extra_info.index) of every prompt generated, per generate call."""
    return run.agent_loop.generated_rows


def record_rows(run) -> None:
    loop = run.agent_loop
    loop.generated_rows = []
    original = loop.generate_sequences

    def spy(batch):
        loop.generated_rows.append([int(getattr(x, "data", x)) for x in batch["index"]])
        return original(batch)

    loop.generate_sequences = spy


def fit(H, overrides):
    run = H.Run(overrides).setup()
    run.agent_loop = H.FakeAgentLoop(int(run.config.actor_rollout_ref.rollout.n), run.events)
    record_rows(run)
    run.logged = []
    original = run.trainer._compute_metrics

    def capture(batch, metrics, *args, **kwargs):
        out = original(batch, metrics, *args, **kwargs)
        run.logged.append(dict(metrics))
        return out

    run.trainer._compute_metrics = capture
    run.trainer.fit(run.agent_loop)
    return run


@pytest.mark.tq
@pytest.mark.integration
def test_fit_greso_filters_prompts_before_generation_and_resumes_exactly(H, tmp_path, clean_partition):
    tq = clean_partition
    data = H.write_dataset(tmp_path / "train.parquet", {"math": 4, "code": 4})
    over = lambda ckpt, steps: H.base_overrides(data, ckpt, batch=2, steps=steps) + GRESO  # noqa: E731
    full = fit(H, over(tmp_path / "full", 6))
    events = full.events
    assert events.index("on_prompts") < events.index("generate")
    rows = generated(full)
    assert all(len(r) == 2 for r in rows)  # always a full train_batch_size of prompts
    state = full.trainer.dataflex_state_dict()["runtime"]["history"]
    code = torch.tensor([4, 5, 6, 7])  # dataset rows of the code prompts; dense index = sorted (domain, row)
    table = full.trainer.dataflex.prompt_table
    dense_code = table.lookup_labels(["code"] * 4, code)
    assert int(state["visits"].sum()) == sum(len(r) for r in rows)  # every generated group is a visit
    assert bool((state["last_class"][dense_code][state["visits"][dense_code] > 0] == 2).all())  # hard
    skipped = [m.get("dataflex/prompts_skip_rate/hard", 0.0) for m in full.logged]
    assert max(skipped) > 0.5  # seen code prompts are skipped
    considered = sum(m["dataflex/prompts_considered"] for m in full.logged)
    assert considered > sum(m["dataflex/prompts_generated"] for m in full.logged)
    assert not tq_leftovers(tq)

    half = fit(H, over(tmp_path / "half", 3))
    resumed = H.Run(over(tmp_path / "half", 6)).setup()
    assert resumed.trainer.global_steps == 3
    resumed.agent_loop = H.FakeAgentLoop(2, resumed.events)
    record_rows(resumed)
    resumed.trainer.fit(resumed.agent_loop)
    assert generated(half) + generated(resumed) == rows
    a = full.trainer.dataflex_state_dict()["runtime"]
    b = resumed.trainer.dataflex_state_dict()["runtime"]
    for name in ("visits", "streak", "last_class", "ring_step"):
        assert torch.equal(a["history"][name], b["history"][name]), name
    assert a["history"]["considered"] == b["history"]["considered"]
    assert torch.equal(a["pipeline"]["methods"]["select:greso"]["actuator"]["generator"],
                       b["pipeline"]["methods"]["select:greso"]["actuator"]["generator"])


def tq_leftovers(tq) -> set:
    return set((tq.kv_list("train") or {}).get("train", {}))


@pytest.mark.tq
@pytest.mark.integration
def test_history_counts_groups_verl_dapo_evicts(H, tmp_path, clean_partition):
    data = H.write_dataset(tmp_path / "train.parquet", {"math": 4, "code": 4})
    run = fit(H, H.base_overrides(data, tmp_path / "ckpt", batch=2, steps=3) + GRESO + [
        "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=reward"])
    from dataflex_bus.verl.buffer import DataflexReplayBuffer

    assert isinstance(run.trainer.replay_buffer, DataflexReplayBuffer)
    history = run.trainer.dataflex.history
    assert int(history.visits.sum()) == sum(len(r) for r in generated(run))
    # verl evicts the code groups before _balance_batch, yet they were generated: counted and in the history
    assert run.logged[-1]["compute/generated_rollouts"] == 4 * sum(len(r) for r in generated(run))
    assert sum(m.get("dataflex/rollout/rows/code", 0.0) for m in run.logged) > 0
    assert sum(m.get("dataflex/history/visits_hard", 0.0) for m in run.logged) > 0


@pytest.mark.tq
@pytest.mark.integration
def test_dataflex_refill_under_verl_evicts_and_refills(H, tmp_path, clean_partition):
    tq = clean_partition
    data = H.write_dataset(tmp_path / "train.parquet", {"math": 4, "code": 4})
    run = fit(H, H.base_overrides(data, tmp_path / "ckpt", batch=2, steps=2) + DAPO_REFILL)
    assert run.trainer.config.data.gen_batch_size == 1
    for logged, update in zip(run.logged, run.trainer.actor_rollout_wg.updates):
        assert logged["dataflex/refill/trained_groups"] == 2  # refilled to train_batch_size
        assert logged["dataflex/rollout/groups"] == logged["dataflex/refill/generated_groups"]  # every round
        real = [k for k, pad in zip(update["keys"], update["is_padding"]) if not pad]
        assert len(real) == 2 * 4
        assert all(run.agent_loop.prompts[k.split("_")[0]][0] == "math" for k in real)  # dapo dropped code
    assert any(m["dataflex/refill/generated_groups"] > 2 for m in run.logged)  # code was generated, and refilled
    assert not tq_leftovers(tq)


# ---------------------------------------------------------------------------- ids verl cannot be trusted with
class Frame:
    """The two columns the table is built from, like a HF dataset."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows
        self.column_names = sorted({k for r in rows for k in r})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, column: str) -> list:
        return [r.get(column) for r in self.rows]


def row(source: str, index, prompt: str = "q") -> dict:
    extra = {} if index is None else {"index": index}
    return {"data_source": source, "extra_info": extra, "prompt": prompt}


def test_prompt_table_from_the_dataset_columns():
    from dataflex_bus.verl.prompts import dataset_prompt_table

    table = dataset_prompt_table(Frame([row("b", 3), row("a", 3), row("a", 0)]), "data_source")
    assert table.domains == ["a", "b"] and len(table) == 3
    assert table.lookup_labels(["b", "a"], torch.tensor([3, 0])).tolist() == [2, 0]
    # the same prompt twice under one id is one prompt
    assert len(dataset_prompt_table(Frame([row("a", 1, "x"), row("a", 1, "x")]), "data_source")) == 1


def test_rows_without_an_index_are_refused_naming_the_column():
    from dataflex_bus.errors import ConfigError
    from dataflex_bus.verl.prompts import dataset_prompt_table

    with pytest.raises(ConfigError, match=r"extra_info\.index: 2 of 3 training rows \(the first: row 1\)"):
        dataset_prompt_table(Frame([row("a", 0), row("a", None), row("a", None)]), "data_source")
    with pytest.raises(ConfigError, match=r"extra_info\.index=1 hold different prompts"):
        dataset_prompt_table(Frame([row("a", 1, "x"), row("a", 1, "y")]), "data_source")
    with pytest.raises(ConfigError, match=r"dataflex\.domain_key"):
        dataset_prompt_table(Frame([row("a", 0)]), "topic")


def test_padding_rows_get_prompt_index_zero_and_are_never_looked_up():
    from types import SimpleNamespace

    from dataflex_bus.batch import Batch
    from dataflex_bus.history import PromptTable
    from dataflex_bus.runtime import Runtime
    from dataflex_bus.verl.trainer import DataflexTrainer

    # No row 0 in the first domain: a padding row looked up as ("a", 0) would be refused.
    table = PromptTable.from_labels(["a", "a", "b"], [5, 7, 0], column="extra_info.index")
    runtime = Runtime(None)
    runtime.set_prompts(table)
    host = SimpleNamespace(dataflex=runtime, domain_key="data_source")
    batch = Batch.from_tensors(uid=["g0", "g0", "g1", "pad"], rm_scores=torch.zeros(4, 2),
                               response_mask=torch.ones(4, 2, dtype=torch.long),
                               is_padding=[False, False, False, True])
    data = {"data_source": ["b", "b", "a", "pad"], "index": [0, 0, 7, -1]}
    index = DataflexTrainer._prompt_index(host, data, batch)  # type: ignore[arg-type]
    assert index.tolist() == [table.lookup_labels(["b"], torch.tensor([0])).item()] * 2 + [1, 0]
