"""Any dataset verl accepts (``data.custom_cls``) runs under ``dataflex_sync``; a block that reads the training
prompts' table (the per-prompt history, a selection before generation, a mixer's domains) is refused at start-up,
naming ``data.custom_cls`` and what the class lacks (semi-e2e harness, see verl_harness.py)."""

from __future__ import annotations

import pytest
from seed_config import SEED

from dataflex_bus.errors import ConfigError

pytestmark = [pytest.mark.verl, pytest.mark.tq]

#: A dataset class verl accepts (a torch Dataset built with RLHFDataset's arguments) that keeps its rows in a plain
#: list: no ``dataframe``.
ROWS_DATASET = '''
import torch
from verl.utils.dataset.rl_dataset import RLHFDataset


class RowsDataset(torch.utils.data.Dataset):
    def __init__(self, data_files, tokenizer, config, processor=None, max_samples=-1):
        inner = RLHFDataset(data_files, tokenizer, config, processor, max_samples)
        self.rows = [inner[i] for i in range(len(inner))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]
'''
MIX = ["+dataflex.mechanism=mix", "+dataflex.scorer.name=reward_difficulty", "+dataflex.actuator.name=reward_gap"]
GRESO = ["+dataflex.mechanism=select", "+dataflex.scorer.name=zero_variance_streak",
         "+dataflex.actuator.name=greso"]


def custom(H, tmp_path, block, steps=1):
    module = tmp_path / "rows_dataset.py"
    module.write_text(ROWS_DATASET)
    data = H.write_dataset(tmp_path / "train.parquet", {"math": 4, "code": 4})
    return H.Run(H.base_overrides(data, tmp_path / "ckpt", batch=2, steps=steps) + block + [
        f"data.custom_cls.path={module}", "data.custom_cls.name=RowsDataset"])


@pytest.mark.integration
@pytest.mark.parametrize("block", [[], SEED], ids=["no_block", "select_at_rollout"])
def test_custom_dataset_class_runs_when_no_method_reads_its_table(H, tmp_path, clean_partition, block):
    run = custom(H, tmp_path, block).setup()
    assert type(run.trainer.train_dataset).__name__ == "RowsDataset"
    assert not hasattr(run.trainer.train_dataset, "dataframe")
    run.fit()
    assert len(run.trainer.actor_rollout_wg.updates) == 1 and run.logged[0]["training/global_step"] == 1
    assert (tmp_path / "ckpt" / "global_step_1" / "dataflex_state.pt").exists()


@pytest.mark.parametrize("block, key, why", [(MIX, "dataflex.mechanism", "draws the next prompts by domain"),
                                             (GRESO, "dataflex.mechanism", "before generation")],
                         ids=["mix", "greso"])
def test_block_reading_the_prompt_table_is_refused_naming_custom_cls(H, tmp_path, clean_partition, block, key, why):
    run = custom(H, tmp_path, block)
    with pytest.raises(ConfigError) as err:
        run.setup()
    issues = err.value.issues
    assert {i.key for i in issues} == {"data.custom_cls"}
    text = str(err.value)
    assert "RowsDataset from " in text and "rows_dataset.py" in text and "has no `dataframe` attribute" in text
    assert key in text and why in text and "subclass RLHFDataset" in text
