"""The hosts' one state-file envelope: atomic, checksummed, read with weights_only, every entry named."""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

import pytest
import torch

from dataflex_bus.errors import ConfigError, ConfigIssue
from dataflex_bus.state_file import CheckpointError, check_format, read_state, restore, save_state

FRESH = "remove it to start fresh"


class Opaque:
    """Not a tensor or a plain container: a weights-only read must refuse it, not run its code."""


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "dataflex_state.pt"
    save_state(path, {"format": 1, "runtime": {"pipeline": torch.arange(3)}, "kit": {"steps": 2}})
    return path


def test_a_saved_state_reads_back_and_leaves_no_temporary(saved: Path):
    state = read_state(saved, FRESH)
    assert state["kit"] == {"steps": 2} and torch.equal(state["runtime"]["pipeline"], torch.arange(3))
    assert os.listdir(saved.parent) == [saved.name]


@pytest.mark.parametrize(("damage", "message"), [
    (lambda b: b[: len(b) // 2], "truncated or extended"),
    (lambda b: b"", "the file is empty"),
    (lambda b: random.Random(0).randbytes(len(b)), "no dataflex-checkpoint/1 header"),
    (lambda b: b.replace(b"sha256=", b"sha256=0", 1), "checksum mismatch"),
])
def test_a_damaged_state_file_is_refused_naming_it(saved: Path, damage, message):
    saved.write_bytes(damage(saved.read_bytes()))
    with pytest.raises(CheckpointError, match=message) as err:
        read_state(saved, FRESH)
    assert str(saved) in str(err.value) and FRESH in str(err.value)


def test_a_plain_torch_save_from_an_older_version_is_refused(tmp_path: Path):
    path = tmp_path / "dataflex_state.pt"
    torch.save({"format": 1, "runtime": {}}, path)
    with pytest.raises(CheckpointError, match="no dataflex-checkpoint/1 header"):
        read_state(path, FRESH)


def test_a_file_holding_other_objects_is_not_unpickled(tmp_path: Path):
    path = tmp_path / "dataflex_state.pt"
    save_state(path, {"format": 1, "runtime": Opaque()})
    with pytest.raises(CheckpointError, match=r"cannot read the checkpoint .*UnpicklingError"):
        read_state(path, FRESH)


def test_a_state_that_is_not_a_mapping_is_refused(tmp_path: Path):
    from dataflex_bus.state_file import write_checked

    path = tmp_path / "dataflex_state.pt"
    write_checked(path, [1, 2])
    with pytest.raises(CheckpointError, match="holds a list, not a mapping"):
        read_state(path, FRESH)


def test_another_format_is_refused_naming_the_entry(saved: Path):
    with pytest.raises(CheckpointError, match=r"entry 'format' holds 1, expected 2"):
        check_format(saved, read_state(saved, FRESH), "TRL", (2,), FRESH)


def test_each_entry_is_named_when_missing_or_unfit(saved: Path):
    state = read_state(saved, FRESH)
    got: dict[str, object] = {}
    restore(saved, state, {"kit": lambda v: got.update(kit=v)}, FRESH)
    assert got == {"kit": {"steps": 2}}
    with pytest.raises(CheckpointError, match=r"entry 'stream' is missing \(the file holds \['format', 'kit', "
                                              r"'runtime'\]\)"):
        restore(saved, state, {"kit": lambda v: None, "stream": lambda v: None}, FRESH)

    def needs_history(value: dict[str, object]) -> None:
        value["history"]  # a state of another block: KeyError inside the loader

    with pytest.raises(CheckpointError, match=r"entry 'runtime' does not fit this run \(KeyError: 'history'\)"):
        restore(saved, state, {"runtime": needs_history}, FRESH)


def test_a_loader_s_own_config_refusal_keeps_its_keys_and_says_where_it_was_read(saved: Path):
    def refuse(value: object) -> None:
        raise ConfigError(ConfigIssue("dataflex", "the checkpoint has a block, this run has none"))

    with pytest.raises(ConfigError, match="the checkpoint has a block") as err:
        restore(saved, read_state(saved, FRESH), {"runtime": refuse}, FRESH)
    assert err.value.issues[0].key == "dataflex" and f"read from {saved}, entry 'runtime'" in str(err.value)


def test_a_write_error_names_the_file(tmp_path: Path):
    target = tmp_path / "missing" / "dataflex_state.pt"
    with pytest.raises(CheckpointError, match=f"{target}: cannot write the dataflex state"):
        save_state(target, {"format": 1})


def test_the_header_covers_exactly_the_payload(saved: Path):
    head, _, payload = saved.read_bytes().partition(b"\n")
    assert head.startswith(b"dataflex-checkpoint/1 sha256=") and int(head.rsplit(b"bytes=", 1)[1]) == len(payload)
    assert torch.load(io.BytesIO(payload), weights_only=True)["kit"] == {"steps": 2}


def test_a_state_is_streamed_to_its_file_not_serialized_in_memory_first(tmp_path: Path):
    """Before: the whole state (the replay store's rows) was serialized into a buffer, a second copy, and
    written in one piece; now torch.save writes through the checksum to the file piece by piece (no write
    larger than one tensor), the header filled in at the end."""
    from dataflex_bus.state_file import atomic_write, write_checked

    writes: list[int] = []

    def recording(path: Path, write) -> None:
        def spy(fh):
            real = fh.write
            fh.write = lambda data: (writes.append(len(data)), real(data))[1]
            write(fh)

        atomic_write(path, spy)

    state = {"format": 1, **{f"rows{i}": torch.arange(100_000) + i for i in range(4)}}
    write_checked(tmp_path / "s.pt", state, atomic=recording)
    assert max(writes) <= 100_000 * 8 < sum(writes) / 3
    back = read_state(tmp_path / "s.pt", FRESH)
    assert all(torch.equal(back[k], v) for k, v in state.items() if k != "format")


def test_state_files_are_pruned_with_the_hosts_retention(tmp_path: Path):
    """Of the files this process wrote, the newest ``keep`` stay (verl's max_actor_ckpt_to_keep counts its own
    saves alike); an emptied folder goes too; ``None`` or 0 keeps every file."""
    from dataflex_bus.state_file import Retention

    kept = Retention(2)
    for step in range(1, 5):
        (tmp_path / f"global_step_{step}").mkdir()
        save_state(tmp_path / f"global_step_{step}" / "dataflex_state.pt", {"format": 1})
        kept.wrote(tmp_path / f"global_step_{step}" / "dataflex_state.pt")
    (tmp_path / "global_step_4" / "actor").mkdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3", "global_step_4"]
    for keep in (None, 0):
        every = Retention(keep)
        for step in range(5, 8):
            every.wrote(tmp_path / f"s{step}.pt")
            save_state(tmp_path / f"s{step}.pt", {"format": 1})
        assert every.wrote(tmp_path / "s7.pt") == [] and (tmp_path / "s5.pt").exists()
