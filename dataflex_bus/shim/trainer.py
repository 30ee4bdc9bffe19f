"""An in-process GRPO trainer that emits the dataflex bus events in verl v1's ``_step_once`` order.

One step: draw prompts (through the mixer's probabilities when the method is a ``mix``) -> roll out
``group_size`` responses per prompt -> binary exact-match reward (``rm_scores`` on the last valid token)
-> ``on_rollout`` (a selector may drop whole groups: the rows are removed before any further compute)
-> old log-probs -> reference log-probs (when ``kl_coef > 0``) -> GRPO advantages -> ``on_advantage``
(weights multiplied into ``rollout_is_weights``, rows dropped, or advantages replaced) -> PPO update
(clipped loss x ``rollout_is_weights``, token-mean over ``loss_mask``) -> ``on_step_end`` (mixers update)
-> metrics -> checkpoint. The batch carries verl's field names, so a plugin sees the same data here as
inside verl.

Everything random comes from generators this module owns, so a run is a function of its config and
seed, and a resumed run continues bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import __version__
from ..batch import Batch
from ..errors import ConfigError, DataflexError
from ..ops import grpo_outcome_advantage, segment_count, segment_sum
from ..pipeline import Decision
from ..runtime import Runtime
from .config import diff, fingerprint, resolve_config
from .losses import low_var_kl, policy_loss, token_mean
from .policy import TinyPolicy, generate, pretrain, token_log_probs
from .split import Split
from .tasks import TASKS, Prompts, exact_match, vocab_size, zero_signal_fraction

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
RECORD = "run.json"
PLOT = "curves.png"
#: Files a run directory holds; ``--force`` removes exactly these, nothing else.
RUN_FILES = (CHECKPOINT, METRICS, RECORD, PLOT)
FORMAT = "dataflex-shim-checkpoint/1"
_GENERATORS = ("init", "data", "rollout", "update", "pretrain")
#: Generators of the base policy, seeded by ``model.seed``; the others by ``trainer.seed``.
_BASE_GENERATORS = ("init", "pretrain")


class RunDirError(DataflexError):
    """The output directory holds a run that would be overwritten, or no run to resume."""


class CheckpointError(DataflexError):
    """A checkpoint cannot be read, or was written by a different config or method."""


@dataclass
class RunResult:
    """What :func:`run_training` returns: one metrics dict per step, the run record and the directory."""

    metrics: list[dict[str, float]]
    record: dict[str, Any]
    out: Path | None = None
    summary: dict[str, float] = field(default_factory=dict)


def _generator(seed: int, which: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 64 + _GENERATORS.index(which) + 1)


class ShimTrainer:
    """State of one run: policy, optimizer, generators, sampler position and the dataflex runtime."""

    def __init__(self, resolved: Mapping[str, Any], runtime: Runtime, *, warm_start: bool = True) -> None:
        self.config = resolved
        self.runtime = runtime
        t, m = resolved["trainer"], resolved["model"]
        self.t = t
        self.domains: list[str] = list(resolved["data"]["domains"])
        self.learnable = torch.tensor([TASKS[d].learnable for d in self.domains])
        seed = t["seed"]
        self.gens = {name: _generator(m["seed"] if name in _BASE_GENERATORS else seed, name)
                     for name in _GENERATORS}
        # Built even without evaluation: a run trains on the same prompts whether or not it evaluates.
        self.split = Split(self.domains, resolved["data"]["seed"], resolved["data"]["heldout"])
        vocab = vocab_size(len(self.domains))
        self.policy = TinyPolicy(vocab, m["hidden"], m["layers"], self.gens["init"])
        if warm_start and m["pretrain_steps"]:
            pretrain(self.policy, self.domains, self.split.draw, m["pretrain_steps"], self.gens["pretrain"],
                     batch=m["pretrain_batch"])
        self.reference: TinyPolicy | None = None
        if t["kl_coef"] > 0:
            self.reference = TinyPolicy(vocab, m["hidden"], m["layers"], _generator(m["seed"], "init"))
            self.reference.load_state_dict(self.policy.state_dict())
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=t["lr"])
        self.step = 0
        self.next_uid = 0
        self.skipped_updates = 0
        self.mix = runtime.pipeline is not None and runtime.mechanism == "mix"
        if self.mix:
            runtime.pipeline.set_domains(self.domains)

    # ------------------------------------------------------------------ sampling
    def domain_probabilities(self) -> Tensor:
        """Sampling probabilities over ``self.domains`` for the next prompts (uniform unless mixing)."""
        if self.mix:
            probs = self.runtime.pipeline.domain_probabilities() or {}
            p = torch.tensor([float(probs.get(d, 0.0)) for d in self.domains], dtype=torch.float64)
            if not bool(torch.isfinite(p).all()) or bool((p < 0).any()) or float(p.sum()) <= 0:
                raise DataflexError(f"mixer {self.runtime.pipeline_name!r} published invalid domain "
                                    f"probabilities {probs}")
            return p / p.sum()
        return torch.full((len(self.domains),), 1.0 / len(self.domains), dtype=torch.float64)

    def _draw(self, probs: Tensor) -> tuple[Prompts, Tensor]:
        n_prompts = self.t["prompts_per_step"]
        domains = torch.multinomial(probs, n_prompts, replacement=True, generator=self.gens["data"])
        prompts = self.split.draw(domains, self.gens["data"])
        uid = torch.arange(self.next_uid, self.next_uid + n_prompts)
        self.next_uid += n_prompts
        return prompts, uid

    # ------------------------------------------------------------------ one step
    def _batch(self, uid: Tensor, domains: Tensor, **fields: Tensor) -> Batch:
        return Batch.from_tensors(uid=uid, domains=domains, domain_names=self.domains,
                                  is_padding=torch.zeros(uid.shape[0], dtype=torch.bool), **fields)

    def _reward_metrics(self, rewards: Tensor, domains: Tensor, lengths: Tensor,
                        metrics: dict[str, float]) -> None:
        d = len(self.domains)
        count = segment_count(domains, d)
        total = segment_sum(rewards.double(), domains, d)
        metrics["reward/mean"] = float(rewards.double().mean())
        for i, name in enumerate(self.domains):
            if int(count[i]):
                metrics[f"reward/{name}"] = float(total[i] / count[i])
        learn = self.learnable[domains]
        if bool(learn.any()):
            metrics["reward/learnable"] = float(rewards[learn].double().mean())
        metrics["response/length_mean"] = float(lengths.double().mean())

    def train_step(self) -> dict[str, float]:
        """Run one GRPO step and return its metrics (deterministic given the trainer state)."""
        step, t, n = self.step, self.t, self.t["group_size"]
        metrics: dict[str, float] = {"step": float(step)}
        every = t["eval_every"]
        if every and step == 0:
            metrics.update(self.evaluate())  # the base policy, before any update
        probs = self.domain_probabilities()
        for name, p in zip(self.domains, probs.tolist()):
            metrics[f"data/prob/{name}"] = p
        prompts, uid = self._draw(probs)
        rows = prompts.repeat(n)
        uid = uid.repeat_interleave(n)

        # rollout + reward (rm_scores: the outcome reward on the last valid token, as verl writes it)
        self.policy.eval()
        responses, response_mask, rollout_lp = generate(self.policy, rows.tokens, t["temperature"],
                                                        self.gens["rollout"])
        reward = exact_match(responses, response_mask, rows.targets)
        lengths = response_mask.sum(-1)
        rm_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
        rm_scores.scatter_(1, (lengths - 1).clamp_min(0)[:, None], reward[:, None])
        self._reward_metrics(reward, rows.domains, lengths, metrics)
        n_prompts = len(prompts.domains)
        metrics["data/zero_signal_groups"] = zero_signal_fraction(
            reward, torch.arange(n_prompts).repeat_interleave(n), n_prompts)
        rolled = len(uid)
        batch = self._batch(uid, rows.domains, prompts=rows.tokens, responses=responses,
                            response_mask=response_mask, loss_mask=response_mask.clone(),
                            rm_scores=rm_scores, rollout_log_probs=rollout_lp)

        decision = self.runtime.emit("on_rollout", batch, step)
        skip = decision.skip_update
        metrics.update(decision.metrics)
        if decision.keep is not None and not skip:
            # Physical removal before any further compute, as the verl adapter does in _balance_batch.
            batch = batch.select(decision.keep)

        # old log-probs, reference log-probs, GRPO advantages
        with torch.no_grad():
            old_lp = token_log_probs(self.policy, batch["prompts"], batch["responses"], t["temperature"])
            extra = {}
            if self.reference is not None:
                extra["ref_log_prob"] = token_log_probs(self.reference, batch["prompts"], batch["responses"],
                                                        t["temperature"])
        mask = batch["response_mask"].to(torch.float32)
        adv = grpo_outcome_advantage(batch.rewards, batch.group_index, batch.num_groups)[:, None] * mask
        batch = batch.with_fields(old_log_probs=old_lp, advantages=adv, returns=adv,
                                  rollout_is_weights=torch.ones_like(mask), **extra)

        decision = self.runtime.emit("on_advantage", batch, step)
        skip = skip or decision.skip_update
        metrics.update(decision.metrics)
        batch = self._carry_out(batch, decision, skip)

        # policy update
        trained = 0 if skip else len(batch)
        metrics["train/kept_fraction"] = trained / rolled if rolled else 0.0
        metrics["train/skipped_update"] = float(skip or trained == 0)
        if skip or trained == 0:
            self.skipped_updates += 1
        else:
            metrics.update(self._update(batch))
        metrics["train/skipped_updates"] = float(self.skipped_updates)

        decision = self.runtime.emit("on_step_end", batch, step)
        metrics.update(decision.metrics)
        self.step += 1
        if every and self.step % every == 0 and step > 0:
            metrics.update(self.evaluate())
        return metrics

    @staticmethod
    def _carry_out(batch: Batch, decision: Decision, skip: bool) -> Batch:
        """Apply an ``on_advantage`` decision: replace advantages, multiply weights, drop rows."""
        fields: dict[str, Tensor] = {}
        if decision.advantages is not None:
            adv = decision.advantages.to(torch.float32) * batch["response_mask"]
            fields.update(advantages=adv, returns=adv)
        if decision.weights is not None:
            fields["rollout_is_weights"] = batch["rollout_is_weights"] * decision.weights
        if fields:
            batch = batch.with_fields(**fields)
        if decision.keep is not None and not skip:
            batch = batch.select(decision.keep)
        return batch

    def _update(self, batch: Batch) -> dict[str, float]:
        t = self.t
        self.policy.train()
        prompts, responses = batch["prompts"], batch["responses"]
        old_lp, adv, weights = batch["old_log_probs"], batch["advantages"], batch["rollout_is_weights"]
        response_mask, loss_mask = batch["response_mask"], batch["loss_mask"]
        ref = batch.get("ref_log_prob")
        rows = len(batch)
        sums = {"pg_loss": 0.0, "kl_loss": 0.0, "clip_frac": 0.0, "ppo_kl": 0.0, "grad_norm": 0.0}
        updates = 0
        for _ in range(t["ppo_epochs"]):
            order = (torch.randperm(rows, generator=self.gens["update"]) if t["mini_batches"] > 1
                     else torch.arange(rows))
            for idx in torch.tensor_split(order, min(t["mini_batches"], rows)):
                num_tokens = loss_mask[idx].sum()
                if int(num_tokens) == 0:
                    continue
                logp = token_log_probs(self.policy, prompts[idx], responses[idx], t["temperature"])
                loss, info = policy_loss(logp, old_lp[idx], adv[idx], response_mask[idx],
                                         clip_ratio=t["clip_ratio"], clip_ratio_c=t["clip_ratio_c"],
                                         rollout_is_weights=weights[idx], num_tokens=num_tokens)
                sums["pg_loss"] += float(loss.detach())
                if ref is not None:
                    kl = token_mean(low_var_kl(logp, ref[idx]), response_mask[idx].to(torch.bool), num_tokens)
                    loss = loss + t["kl_coef"] * kl
                    sums["kl_loss"] += float(kl.detach())
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), t["max_grad_norm"])
                if not bool(torch.isfinite(norm)):
                    raise DataflexError(f"non-finite gradient at step {self.step}: check the advantages "
                                        "and rollout_is_weights the method produced")
                self.optimizer.step()
                sums["grad_norm"] += float(norm)
                sums["clip_frac"] += info["clip_frac"]
                sums["ppo_kl"] += info["ppo_kl"]
                updates += 1
        out = {f"train/{k}": v / max(updates, 1) for k, v in sums.items()}
        if ref is None:
            del out["train/kl_loss"]
        out["train/optimizer_steps"] = float(updates)
        return out

    def evaluate(self) -> dict[str, float]:
        """Exact greedy accuracy on every held-out prompt (``eval/heldout/...``)."""
        return self.split.evaluate(self.policy)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "fingerprint": fingerprint(self.config),
            "step": self.step,
            "policy": self.policy.state_dict(),
            "reference": None if self.reference is None else self.reference.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": {name: g.get_state() for name, g in self.gens.items()},
            "sampler": {"next_uid": self.next_uid},
            "counters": {"skipped_updates": self.skipped_updates},
            "runtime": self.runtime.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], source: str = "checkpoint") -> None:
        if not isinstance(state, Mapping) or state.get("format") != FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(f"{source}: not a dataflex shim checkpoint (format {found!r}, "
                                  f"expected {FORMAT!r})")
        mismatch = diff(state.get("fingerprint"), fingerprint(self.config))
        if mismatch:
            raise CheckpointError(f"{source} was written by a different config; refusing to resume:\n"
                                  + "\n".join(f"  - {m}" for m in mismatch)
                                  + "\nstart a fresh run (--force) or resume with the original config")
        try:
            self.policy.load_state_dict(state["policy"])
            if self.reference is not None:
                self.reference.load_state_dict(state["reference"])
            self.optimizer.load_state_dict(state["optimizer"])
            for name, g in self.gens.items():
                g.set_state(state["rng"][name])
            self.next_uid = int(state["sampler"]["next_uid"])
            self.skipped_updates = int(state["counters"]["skipped_updates"])
            self.step = int(state["step"])
        except (KeyError, TypeError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{source} is damaged ({type(exc).__name__}: {exc}); start a fresh "
                                  "run (--force)") from exc
        try:
            self.runtime.load_state_dict(state["runtime"])
        except ConfigError as exc:
            raise CheckpointError(f"{source}: the dataflex state does not fit this config: {exc}") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: cannot restore the plugins' state ({type(exc).__name__}: "
                                  f"{exc})") from exc


# ---------------------------------------------------------------------------- files
def _atomic_write_bytes(path: Path, write: Callable[[Any], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_checkpoint(trainer: ShimTrainer, out: Path) -> None:
    """Write ``checkpoint.pt`` atomically (temporary file, then rename): a crash leaves the old one."""
    state = trainer.state_dict()
    _atomic_write_bytes(out / CHECKPOINT, lambda fh: torch.save(state, fh))


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise RunDirError(f"{path.parent}: no checkpoint to resume from ({path.name} missing)")
    try:
        # Our own file (it holds optimizer and plugin state, plain containers and tensors).
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({type(exc).__name__}: {exc}); "
                              "start a fresh run (--force)") from exc


def _write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, default=str)
    _atomic_write_bytes(path, lambda fh: fh.write(text.encode()))


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The per-step metrics of a run directory (``metrics.jsonl``)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def existing_run_files(out: Path) -> list[str]:
    return [name for name in RUN_FILES if (out / name).exists()]


def machine_info() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "dataflex_bus": __version__}


def summarize(metrics: list[dict[str, float]], domains: list[str], tail: int | None = None) -> dict[str, float]:
    """Final numbers of a run: mean over the last ``tail`` steps (10%, at least 1) of the reward
    metrics, the kept fraction and the last eval accuracies."""
    if not metrics:
        return {}
    tail = tail or max(1, len(metrics) // 10)
    last = metrics[-tail:]
    out: dict[str, float] = {}
    keys = ["reward/mean", "reward/learnable", "train/kept_fraction"] + [f"reward/{d}" for d in domains]
    for key in keys:
        vals = [m[key] for m in last if key in m and math.isfinite(m[key])]
        if vals:
            out[key] = sum(vals) / len(vals)
    for m in reversed(metrics):
        evals = {k: v for k, v in m.items() if k.startswith("eval/")}
        if evals:
            out.update(evals)
            break
    kept = [m["train/kept_fraction"] for m in metrics if "train/kept_fraction" in m]
    if kept:
        out["train/kept_fraction_all"] = sum(kept) / len(kept)
    for d in domains:
        key = f"data/prob/{d}"
        if key in metrics[-1]:
            out[key] = metrics[-1][key]
    return out


# ---------------------------------------------------------------------------- the public entry point
def prepare_config(config: Mapping[str, Any], *, steps: int | None = None,
                   seed: int | None = None) -> dict[str, Any]:
    """Apply the ``steps``/``seed`` overrides and check the shim sections (not the dataflex block)."""
    if not isinstance(config, Mapping):
        return resolve_config(config)
    raw = dict(config)
    trainer = raw.get("trainer")
    if (steps is not None or seed is not None) and (trainer is None or isinstance(trainer, Mapping)):
        trainer = dict(trainer or {})
        if steps is not None:
            trainer["steps"] = steps
        if seed is not None:
            trainer["seed"] = seed
        raw["trainer"] = trainer
    return resolve_config(raw)


def host_context(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """What the foundation checks a method against: GRPO with ``group_size`` responses per prompt."""
    return {"adv_estimator": "grpo", "rollout_n": resolved["trainer"]["group_size"]}



def run_training(config: Mapping[str, Any], *, steps: int | None = None, seed: int | None = None,
                 out: str | Path | None = None, resume: bool = False, progress: bool = False) -> RunResult:
    """Train the shim's tiny policy with GRPO and the configured dataflex method (if any).

    ``config`` holds ``trainer``/``model``/``data`` sections and an optional ``dataflex`` block;
    ``steps``/``seed`` override ``trainer.steps``/``trainer.seed``. With ``out=None`` nothing is written
    to disk. With ``out``, per-step metrics go to ``metrics.jsonl``, the run record to ``run.json`` and
    checkpoints (atomic) to ``checkpoint.pt``; an existing run there is never overwritten, and
    ``resume=True`` continues it. Everything is validated before the first step.
    """
    resolved = prepare_config(config, steps=steps, seed=seed)
    t = resolved["trainer"]
    runtime = Runtime(resolved["dataflex"], context=host_context(resolved))

    out_dir = Path(out) if out is not None else None
    if resume and out_dir is None:
        raise RunDirError("resume needs a run directory (out=...)")
    if out_dir is not None and not resume:
        found = existing_run_files(out_dir) if out_dir.exists() else []
        if found:
            raise RunDirError(f"{out_dir} already holds a run ({', '.join(found)}); use --force to overwrite "
                              "it or --resume to continue it")

    threads = torch.get_num_threads()
    torch.set_num_threads(t["threads"])
    try:
        return _train(resolved, runtime, out_dir, resume, progress)
    finally:
        torch.set_num_threads(threads)


def _train(resolved: dict[str, Any], runtime: Runtime, out_dir: Path | None, resume: bool,
           progress: bool) -> RunResult:
    t = resolved["trainer"]
    # A resumed run takes its weights from the checkpoint: no warm start to redo.
    trainer = ShimTrainer(resolved, runtime, warm_start=not resume)
    history: list[dict[str, float]] = []
    record: dict[str, Any] = {
        "config": resolved, "seed": t["seed"], "steps": t["steps"], "domains": trainer.domains,
        "split": trainer.split.record(),
        "dataflex": runtime.record(), "machine": machine_info(), "sessions": [], "status": "running",
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            trainer.load_state_dict(load_checkpoint(out_dir / CHECKPOINT), source=str(out_dir / CHECKPOINT))
            history = read_metrics(out_dir / METRICS)[: trainer.step]
            if len(history) != trainer.step:
                raise CheckpointError(f"{out_dir / METRICS} holds {len(history)} steps but the checkpoint is at "
                                      f"step {trainer.step}")
            previous = out_dir / RECORD
            if previous.exists():
                try:
                    record["sessions"] = json.loads(previous.read_text()).get("sessions", [])
                except (OSError, ValueError):
                    record["sessions"] = []
            # Drop metrics of steps after the checkpoint (a crash between saves): they are redone.
            _write_lines(out_dir / METRICS, history)
        _write_json(out_dir / RECORD, record)

    show = _Progress(t["steps"], trainer.step) if progress else None
    session = {"start_step": trainer.step, "started": time.time()}
    started = time.perf_counter()
    metrics_fh = open(out_dir / METRICS, "a") if out_dir is not None else None
    try:
        while trainer.step < t["steps"]:
            m = trainer.train_step()
            history.append(m)
            if metrics_fh is not None:
                metrics_fh.write(json.dumps(m, sort_keys=True) + "\n")
                metrics_fh.flush()
                every = t["save_every"]
                if (every and trainer.step % every == 0) or trainer.step == t["steps"]:
                    save_checkpoint(trainer, out_dir)
            if show is not None:
                show.update(trainer.step, m)
    except BaseException as exc:
        record["status"] = "failed"
        record["error"] = f"{type(exc).__name__}: {exc}"
        raise
    else:
        record["status"] = "complete"
    finally:
        if metrics_fh is not None:
            metrics_fh.close()
        if show is not None:
            show.close()
        wall = time.perf_counter() - started
        session.update(end_step=trainer.step, wall_s=round(wall, 3))
        record["sessions"].append(session)
        record["wall_s"] = round(sum(s.get("wall_s", 0.0) for s in record["sessions"]), 3)
        record["summary"] = summarize(history, trainer.domains)
        record["counters"] = {"skipped_updates": trainer.skipped_updates, "steps_done": trainer.step}
        if out_dir is not None:
            _write_json(out_dir / RECORD, record)
    return RunResult(metrics=history, record=record, out=out_dir, summary=record["summary"])


def _write_lines(path: Path, rows: list[dict[str, float]]) -> None:
    text = "".join(json.dumps(m, sort_keys=True) + "\n" for m in rows)
    _atomic_write_bytes(path, lambda fh: fh.write(text.encode()))


class _Progress:
    """A one-line progress bar on stderr with live reward and kept fraction (no dependency)."""

    def __init__(self, total: int, start: int) -> None:
        self.total, self.start = total, start
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.last_pct = -1

    def update(self, done: int, m: Mapping[str, float]) -> None:
        pct = int(100 * done / self.total)
        if not self.tty and pct // 10 == self.last_pct // 10 and done != self.total:
            return
        self.last_pct = pct
        width = 24
        filled = int(width * done / self.total)
        rate = (done - self.start) / max(time.perf_counter() - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else 0.0
        parts = [f"reward {m.get('reward/mean', float('nan')):.2f}",
                 f"kept {m.get('train/kept_fraction', float('nan')):.2f}"]
        if "eval/heldout/learnable" in m:
            parts.append(f"held-out {m['eval/heldout/learnable']:.2f}")
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  " + "  ".join(parts)
                + f"  {rate:.1f} it/s  eta {eta:.0f}s")
        sys.stderr.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def check_run_dir(out: Path, *, force: bool) -> None:
    """Refuse to overwrite a run unless ``force``; with ``force``, remove only the run's own files."""
    found = existing_run_files(out) if out.exists() else []
    if not found:
        return
    if not force:
        raise RunDirError(f"{out} already holds a run ({', '.join(found)}); use --force to overwrite it or "
                          "--resume to continue it")
    for name in found:
        (out / name).unlink()


__all__ = ["CheckpointError", "RunDirError", "RunResult", "ShimTrainer", "run_training"]
