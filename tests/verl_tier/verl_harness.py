"""A semi-end-to-end CPU harness around the real ``dataflex_sync`` trainer (verl 0.9.1).

Real: the composed ``ppo_trainer`` config, the registered trainer class and its ``__init__``, verl's
``fit``/``step``/``_step_once``, the sync ReplayBuffer (DAPO included), ``_balance_batch`` padding,
``_compute_old_log_prob``, ``_compute_advantage`` with rollout correction, ``_update_actor``,
``_compute_metrics``, ``_save_checkpoint``/``_load_checkpoint``, the RLHFDataset and TransferQueue, and
verl's ``ppo_loss`` on a tiny random Llama.

Faked (no GPU here, no CPU rollout backend in verl 0.9.1): the agent loop (:class:`FakeAgentLoop`
writes trajectories and tags the way ``AgentLoopWorkerTQ`` does) and the actor worker group
(:class:`FakeActorWG` turns the meta into exactly what a worker receives, through verl's own
``kv_batch_meta2batch_meta`` + ``_meta_to_realdata``), plus stubs for tokenizer, reward loop,
checkpoint engine and resource pools.

Rewards are a fixed function of the dataset row and session id (never of the random uid), so every
method decision is reproducible across runs and resumes.
"""

from __future__ import annotations

import heapq
import os
import random
from pathlib import Path
from typing import Any

import torch

#: domain -> which sessions (of n=4) succeed: math solves half, logic a quarter, code nothing.
SOLVED = {"math": (0, 2), "logic": (0,), "code": ()}


def write_dataset(path: Path, domains: dict[str, int]) -> Path:
    """A parquet file in verl's RL format with ``domains[name]`` rows per domain."""
    import pandas as pd

    rows = []
    for name, count in domains.items():
        for _ in range(count):
            i = len(rows)
            rows.append({
                "data_source": name,
                "prompt": [{"role": "user", "content": f"{name} question {i}"}],
                "ability": name,
                "reward_model": {"style": "rule", "ground_truth": str(i)},
                "extra_info": {"index": i, "split": "train"},
            })
    pd.DataFrame(rows).to_parquet(path)
    return path


def compose(overrides: list[str]):
    """verl's ``ppo_trainer`` config composed with Hydra, as ``main_ppo`` does (``dataflex doctor``'s
    composition)."""
    from dataflex_bus.verl.doctor import compose_main_ppo

    return compose_main_ppo(overrides)


def base_overrides(data: Path, ckpt: Path, *, steps: int = 2, batch: int = 4, mini: int = 2,
                   n: int = 4, mode: str = "dataflex_sync") -> list[str]:
    """A tiny GRPO run that passes verl's ``validate_config`` on a CPU box."""
    return [
        f"trainer.v1.trainer_mode={mode}",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={batch}",
        "data.dataloader_num_workers=0",
        "data.filter_overlong_prompts=False",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "data.seed=7",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        "actor_rollout_ref.actor.shuffle=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.model.path=/nonexistent/tiny-llama",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        "trainer.logger=[]",
        f"trainer.default_local_dir={ckpt}",
        "trainer.resume_mode=auto",
        "trainer.project_name=dataflex-test",
        "trainer.experiment_name=semi-e2e",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


# ---------------------------------------------------------------------------- stubs
class StubTokenizer:
    eos_token_id = 1
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # verl's _validate logs the texts
        return " ".join(str(int(i)) for i in ids)


class StubReward:
    # Non-None: rewards come from the agent loop (streaming path), no colocated reward model.
    reward_loop_worker_handles: list[Any] = ["agent-loop-reward"]


class StubCheckpointEngine:
    def __init__(self) -> None:
        self.updates: list[int] = []

    def update_weights(self, global_steps: int | None = None) -> None:
        self.updates.append(global_steps)

    def sleep_replicas(self) -> None:
        return None

    # the async modes also pause and resume generation around the update
    def abort_replicas(self, reject_request: bool = False) -> None:
        return None

    def resume_generation_replicas(self) -> None:
        return None


class StubPools:
    def get_n_gpus(self) -> int:
        return 1


# ---------------------------------------------------------------------------- fake rollout
def behaviour_log_probs(row: int, session: int, length: int) -> torch.Tensor:
    """The rollout log-probs the fake agent loop reports: a fixed function of (row, session, token), so a
    replayed row's stored behaviour log-probs can be told from another's."""
    return -1.0 - 0.1 * ((row + session + torch.arange(length)) % 4).to(torch.float32)


def tool_response(session: int) -> torch.Tensor:
    """The response mask of a tool-agent trajectory (verl's ``ToolAgentLoop``): model turns (1) and tool
    responses (0). Even sessions were cut after a tool response (``tool_agent_loop.py``: the response length is
    reached), so they end on mask-0 tokens; odd sessions make two tool calls and end on a model turn."""
    if session % 2 == 0:
        spans = [(1, 2), (0, 3), (1, 2), (0, 2 + session % 3)]
    else:
        spans = [(1, 2), (0, 2), (1, 1), (0, 3), (1, 2 + session % 3)]
    return torch.cat([torch.full((length,), bit, dtype=torch.int64) for bit, length in spans])


class FakeAgentLoop:
    """Writes ``n`` trajectories per prompt into TQ like ``AgentLoopWorkerTQ`` and finishes the prompt.

    ``solved``: per domain, the sessions whose answer is right (default :data:`SOLVED`). ``prompts`` maps
    each generated prompt's uid to its ``(data_source, extra_info.index)``."""

    def __init__(self, n: int, events: list[str], solved: dict[str, tuple[int, ...]] | None = None,
                 shape: str = "plain", delays: int | None = None) -> None:
        self.n = n
        #: ``delays`` (a seed): each prompt finishes after a seeded number (1 to 4) of reads of TransferQueue
        #: (:meth:`advance`), prompts due at the same read in a seeded order, so completion order differs from
        #: dispatch order as on a real rollout engine; ``None``: a prompt finishes as it is dispatched.
        self.delays = None if delays is None else random.Random(delays)
        self.reads = 0
        self._due: list[tuple[int, float, int, dict[str, Any]]] = []
        #: ``("dispatch" | "finish", uid)`` in the order they happened.
        self.log: list[tuple[str, str]] = []
        self.events = events
        self.solved = SOLVED if solved is None else solved
        #: ``plain``: one model turn, every response token in the mask; ``tool``: tool-agent trajectories
        #: (:func:`tool_response`); ``multi``: two outputs per session.
        self.shape = shape
        self.generated_domains: list[list[str]] = []
        self.prompts: dict[str, tuple[str, int]] = {}

    def generate_sequences(self, batch) -> None:
        import transfer_queue as tq
        from tensordict.tensorclass import NonTensorData, NonTensorStack

        self.events.append("generate")
        size = len(batch)
        prompts: list[dict[str, Any]] = [{} for _ in range(size)]
        for k, v in batch.items():
            for i in range(size):
                if isinstance(v, torch.Tensor):
                    prompts[i][k] = v[i]
                elif isinstance(v, NonTensorStack):
                    prompts[i][k] = v[i].data
                elif isinstance(v, NonTensorData):
                    prompts[i][k] = v.data
        self.generated_domains.append([p["data_source"] for p in prompts])
        for p in prompts:
            self.log.append(("dispatch", str(p["uid"])))
            if self.delays is None:
                self._finish(p)
                continue
            partition = "val" if bool(p.get("validate", False)) else "train"
            tq.kv_put(key=p["uid"], partition_id=partition, tag={"status": "running"})
            heapq.heappush(self._due, (self.reads + self.delays.randint(1, 4), self.delays.random(), len(self.log), p))

    def advance(self) -> None:
        """One read of TransferQueue passes: the prompts due by now finish, in their seeded order."""
        self.reads += 1
        while self._due and self._due[0][0] <= self.reads:
            self._finish(heapq.heappop(self._due)[-1])

    def _finish(self, p: dict[str, Any]) -> None:
        """Write one prompt's trajectories into TQ and mark it finished, as ``AgentLoopWorkerTQ._run_prompt``."""
        import transfer_queue as tq
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        self.log.append(("finish", str(p["uid"])))
        uid, row, domain = p["uid"], int(p["extra_info"]["index"]), p["data_source"]
        # As AgentLoopManagerTQ._run_prompt: validation prompts go to the "val" partition, val_kwargs.n (1)
        # sessions each; a per-prompt __rollout_n__ column overrides rollout.n.
        partition = "val" if bool(p.get("validate", False)) else "train"
        if partition == "train":
            self.prompts[str(uid)] = (domain, row)
        n = int(p.pop("__rollout_n__", self.n if partition == "train" else 1))
        tq.kv_put(key=uid, partition_id=partition, tag={"status": "running"})
        keys, fields, tags = [], [], []
        for s in range(n):
            plen, rlen = 3 + row % 3, 2 + (row + s) % 4
            mask = torch.ones(rlen, dtype=torch.int64) if self.shape == "plain" else tool_response(s)
            rlen = mask.numel()
            prompt = torch.tensor([(row * 7 + j) % 120 + 2 for j in range(plen)], dtype=torch.int64)
            resp = torch.tensor([(row * 11 + s * 5 + j) % 120 + 2 for j in range(rlen)], dtype=torch.int64)
            # As verl's agent loop (agent_loop.py): the score on the last response token, whatever its mask.
            rm = torch.zeros(rlen, dtype=torch.float32)
            rm[-1] = 1.0 if s % self.n in self.solved[domain] else 0.0
            step = int(p["global_steps"])
            field = {k: v for k, v in p.items()}
            field.update(
                prompts=prompt, responses=resp, response_mask=mask, loss_mask=mask,
                rollout_log_probs=behaviour_log_probs(row, s, rlen), rm_scores=rm, num_turns=2,
                input_ids=torch.cat([prompt, resp]), position_ids=torch.arange(plen + rlen),
                extra_fields={"min_global_steps": step, "max_global_steps": step, "reward_extra_info": {}},
                session_id=s,
            )
            # ``multi``: an agent loop returning two outputs per session (keys ``_0`` and ``_1``, both carrying
            # the session's final score, as AgentLoopWorkerTQ._agent_loop_postprocess writes them).
            outputs = 2 if self.shape == "multi" else 1
            if self.shape == "multi":
                field["agent_name"] = "two_output_agent"
            for index in range(outputs):
                keys.append(f"{uid}_{s}_{index}")
                fields.append(field)
                tags.append({"status": "success", "prompt_len": plen, "response_len": rlen,
                             "seq_len": plen + rlen, "global_steps": step,
                             "min_global_steps": step, "max_global_steps": step})
        tq.kv_batch_put(keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(fields), tags=tags)
        tq.kv_put(key=uid, partition_id=partition, tag={"status": "finished"})


# ---------------------------------------------------------------------------- fake actor worker group
def tiny_model(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(cfg)


def kit_metrics(trainer, metrics: dict | None = None) -> dict:
    """``metrics`` with what the host kit gathered so far in the trainer's current step (published at the
    step's end, read here by tests that call the trainer's hooks one by one)."""
    return {**(metrics or {}), **trainer._current_step().metrics}


def worker_view(meta):
    """Exactly what a verl worker receives for ``meta`` (the tqbridge conversion)."""
    from verl.utils.transferqueue_utils import _meta_to_realdata, kv_batch_meta2batch_meta

    return _meta_to_realdata(kv_batch_meta2batch_meta(meta))


def sequence_log_probs(model, input_ids_nested: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-prob of the next token and entropy, as nested tensors with input_ids' offsets."""
    lengths = input_ids_nested.offsets().diff()
    ids = input_ids_nested.to_padded_tensor(0)
    width = ids.shape[1]
    attn = (torch.arange(width)[None, :] < lengths[:, None]).long()
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    token_logp = logp.gather(-1, nxt[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    valid = attn.bool()
    offsets, longest = input_ids_nested.offsets(), int(lengths.max())
    return (torch.nested.nested_tensor_from_jagged(token_logp[valid], offsets=offsets, max_seqlen=longest),
            torch.nested.nested_tensor_from_jagged(entropy[valid], offsets=offsets, max_seqlen=longest))


class FakeActorWG:
    """The actor worker group: compute_log_prob and update_actor on a tiny Llama with verl's ppo_loss."""

    def __init__(self, config, events: list[str], seed: int = 0) -> None:
        from verl.utils.config import omega_conf_to_dataclass

        self._dispatch_info = {"actor": [0]}
        self.actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        self.model = tiny_model(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.events = events
        self.log_prob_keys: list[list[str]] = []
        self.updates: list[dict[str, Any]] = []

    def _query_dispatch_info(self, role: str):
        return [0]

    def compute_log_prob(self, meta):
        import transfer_queue as tq
        from tensordict import TensorDict

        self.events.append("compute_log_prob")
        self.log_prob_keys.append(list(meta.keys))
        data = worker_view(meta)
        with torch.no_grad():
            logp, ent = sequence_log_probs(self.model, data["input_ids"])
        return tq.kv_batch_put(keys=list(meta.keys), partition_id=meta.partition_id,
                               fields=TensorDict({"log_probs": logp, "entropy": ent}, batch_size=len(meta.keys)))

    def update_actor(self, meta):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.losses import ppo_loss

        self.events.append("update_actor")
        data = worker_view(meta)
        info = meta.extra_info
        record = {"keys": list(meta.keys), "fields": sorted(data.keys()), "losses": [], "mini_batch_sizes": [],
                  "is_padding": [bool(t.get("is_padding", False)) for t in meta.tags]}
        for name in ("rollout_is_weights", "response_mask", "loss_mask", "advantages", "old_log_probs",
                     "rollout_log_probs"):
            if name in data.keys():
                record[name] = data[name].to_padded_tensor(-1.0 if name != "response_mask" else -1)
        for name in ("data_source", "index", "session_id"):  # what a row was generated as (replayed ones too)
            if name in data.keys():
                record[name] = [getattr(x, "data", x) for x in data[name]]
        mini = int(info["mini_batch_size"])
        pg_losses = []
        for mb in tu.make_iterator(data, mini_batch_size=mini, epochs=int(info["epochs"]), seed=int(info["seed"]),
                                   dataloader_kwargs=dict(info["dataloader_kwargs"])):
            tu.assign_non_tensor(mb, dp_size=1, batch_num_tokens=mb["loss_mask"].values().sum(),
                                 global_batch_size=mini)
            logp, ent = sequence_log_probs(self.model, mb["input_ids"])
            loss, metrics = ppo_loss(self.actor_config, {"log_probs": logp, "entropy": ent}, mb)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            pg_losses.append(float(metrics["actor/pg_loss"].values[0]))
            record["losses"].append(float(loss))
            record["mini_batch_sizes"].append(mb.batch_size[0])
        self.updates.append(record)
        return {"metrics": {"pg_loss": pg_losses, "mfu": [0.0]}}

    # separate_async keeps pi_old on the CPU between the updates of one parameter_sync_step cycle
    def save_model_to_cpu(self, slot: int) -> None:
        self.cpu_models = getattr(self, "cpu_models", {})
        self.cpu_models[slot] = {k: v.clone() for k, v in self.model.state_dict().items()}

    def restore_model_from_cpu(self, slot: int) -> None:
        self.model.load_state_dict(self.cpu_models[slot])

    def clear_cpu_model(self, slot: int) -> None:
        self.cpu_models.pop(slot, None)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict()},
                   os.path.join(local_path, "fake_actor.pt"))

    def load_checkpoint(self, local_path, del_local_after_load=False):
        state = torch.load(os.path.join(local_path, "fake_actor.pt"), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


# ---------------------------------------------------------------------------- the run
class Run:
    """One trainer built from ``overrides`` with the fakes wired in (what ``TaskRunnerV1.run`` does)."""

    def __init__(self, overrides: list[str]) -> None:
        from verl.trainer.ppo.v1 import get_trainer_cls

        self.config = compose(overrides)
        self.events: list[str] = []
        self.trainer = get_trainer_cls(self.config.trainer.v1.trainer_mode)(self.config)
        self._spy_events()

    def _spy_events(self) -> None:
        """Record each bus event in ``self.events`` (wraps the runtime's emit, behaviour unchanged)."""
        runtime = self.trainer.dataflex
        emit = runtime.emit
        self.decisions: list[tuple[str, Any]] = []

        def spy(event, batch, step, **how):
            self.events.append(event)
            decision = emit(event, batch, step, **how)
            self.decisions.append((event, decision, batch))
            return decision

        runtime.emit = spy

    def setup(self) -> Run:
        """``PPOTrainer._setup`` minus the GPU resources."""
        t = self.trainer
        t.tokenizer, t.processor = StubTokenizer(), None
        t._init_dataloader()
        t._init_dump_executor()
        t.resource_pool_manager = StubPools()
        t.ref_in_actor = False
        t.actor_rollout_wg = FakeActorWG(self.config, self.events)
        t.reward_loop_manager = StubReward()
        t.teacher_model_manager, t.distillation_config = None, None
        t.checkpoint_manager = StubCheckpointEngine()
        t.checkpoint_manager.sleep_replicas()
        if hasattr(t, "hybrid_rollout_config"):  # separate_async: a standalone rollout pool only
            from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

            t.standalone_checkpoint_manager = StubCheckpointEngine()
            t._enable_hybrid_replicas = False
            t.current_mode = HybridEngineMode.TRAINER
        t._load_checkpoint()
        t.on_init_end()
        return self

    def fit(self, solved: dict[str, tuple[int, ...]] | None = None, shape: str = "plain",
            delays: int | None = None) -> Run:
        """Train to the end. ``delays``: the fake agent loop's completion-delay seed (:class:`FakeAgentLoop`);
        a read of TransferQueue by the replay buffer is what lets time pass."""
        self.agent_loop = FakeAgentLoop(int(self.config.actor_rollout_ref.rollout.n), self.events, solved, shape,
                                        delays)
        self.logged: list[dict[str, Any]] = []
        trainer = self.trainer
        if delays is not None:
            buffer, agent_loop = trainer.replay_buffer, self.agent_loop
            sync = buffer._sync_metadata_from_transfer_queue

            def read() -> None:
                agent_loop.advance()
                sync()

            buffer._sync_metadata_from_transfer_queue = read
        original = trainer._compute_metrics

        def capture(batch, metrics, *args, **kwargs):
            out = original(batch, metrics, *args, **kwargs)
            self.logged.append(dict(metrics))
            return out

        trainer._compute_metrics = capture
        trainer.fit(self.agent_loop)
        return self


def sampled(tmp_path: Path, extra: list[str], *, batch: int = 3, mini: int = 2, domains: dict[str, int] | None = None,
            mode: str = "dataflex_sync", steps: int = 2) -> tuple[Run, Any]:
    """A set-up trainer with one generated and sampled batch (before on_rollout), and that batch's meta."""
    from verl.utils.skip import SkipManager

    data = write_dataset(tmp_path / "train.parquet", domains or {"math": 4, "logic": 4, "code": 4})
    run = Run(base_overrides(data, tmp_path / "ckpt", batch=batch, mini=mini, steps=steps, mode=mode)
              + extra).setup()
    t = run.trainer
    SkipManager.init(t.config)
    t.global_steps = 1
    t.agent_loop_manager = FakeAgentLoop(int(t.config.actor_rollout_ref.rollout.n), run.events)
    t._add_batch_to_generate()
    meta, _ = t.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=batch)
    return run, meta
