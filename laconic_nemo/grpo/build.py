"""What a run builds before its first step that needs no GPU, in one place for the trainer and `plan`.

The trainer (:class:`~laconic_nemo.grpo.trainer.GRPOTrainer`) takes its shaper (and lambda controller),
advantage and loss settings from here, the entry points their math reward; ``laconic-nemo plan`` calls
:func:`build_step_one`, which builds the same objects on CPU (plus the tokenizer and one rendered prompt
when their paths exist here), so a recipe that `plan` accepts does not fail in one of these constructors
after the cluster has allocated its GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from laconic_nemo.core import SHAPERS, DualController, Shaper, group_advantages


def build_shaper(cfg: DictConfig) -> Shaper:
    """The recipe's reward shaper (a registered function and its ``laconic:`` settings); the recipe was checked at
    load time, :func:`needs_targets_range` aside."""
    lc = cfg.laconic
    if SHAPERS[lc.shaper].needs_targets and cfg.data.target_length_range is None:
        raise ValueError(f"laconic.shaper = {lc.shaper} needs per-prompt target lengths: "
                         "set data.target_length_range = [min, max]")
    return Shaper(lc.shaper, budget=lc.budget, max_length=cfg.rollout.max_new_tokens, penalty_cap=lc.penalty_cap,
                  hit_cap=lc.hit_cap, alpha=lc.alpha, overlong_buffer=lc.overlong_buffer,
                  overlong_penalty=lc.overlong_penalty)


def build_dual(cfg: DictConfig) -> DualController | None:
    """The lambda controller of an adaptive shaper (laconic, linear); None for the others."""
    lc = cfg.laconic
    if SHAPERS[lc.shaper].lam != "dual":
        return None
    return DualController(lc.budget, lc.eta, ceiling=lc.ceiling, max_length=cfg.rollout.max_new_tokens,
                          init=lc.lambda_init, floor=lc.floor, controller=lc.controller, kp=lc.kp, kd=lc.kd)


def constant_lambda(cfg: DictConfig) -> float:
    """lambda of a shaper without a controller: laconic.lambda_init for ``fixed``, 0 for the others."""
    return cfg.laconic.lambda_init if SHAPERS[cfg.laconic.shaper].lam == "fixed" else 0.0


def advantage_settings(cfg: DictConfig) -> dict[str, Any]:
    """Keyword arguments of :func:`laconic_nemo.core.group_advantages` from ``grpo:``."""
    g = cfg.grpo
    return {"eps": float(g.advantage_eps), "leave_one_out": bool(g.leave_one_out), "std": str(g.advantage_std)}


def loss_settings(cfg: DictConfig) -> dict[str, Any]:
    """Keyword arguments of :func:`laconic_nemo.grpo.loss.make_grpo_loss_fn` from ``grpo:`` (without the
    per-minibatch global token / sequence counts)."""
    g = cfg.grpo
    return {
        "clip_eps": float(g.clip_eps),
        "clip_eps_high": None if g.clip_eps_high is None else float(g.clip_eps_high),
        "clip_dual": None if g.clip_dual is None else float(g.clip_dual),
        "kl_beta": float(g.kl_beta),
        "aggregation": str(g.loss_aggregation),
    }


@dataclass
class StepOneBuild:
    """What :func:`build_step_one` built (plain values, printable and JSON-serialisable)."""

    shaper: str
    lambda_init: float
    dual: dict | None             # DualController settings (budget, eta, ceiling, floor, controller, kp, kd)
    advantages: dict
    loss: dict
    reward: str
    count_eos: bool
    prompt_template: str
    tokenizer: str | None = None  # what was loaded, or None when its path is not here
    prompt_preview: str | None = None
    warnings: list[str] = field(default_factory=list)


def _tokenizer_path(cfg: DictConfig, hf_model: str | None) -> str | None:
    path = hf_model if cfg.model.source == "nemo" else (cfg.model.path if cfg.model.source == "hf" else None)
    return str(path) if path and Path(str(path)).is_dir() else None


def build_step_one(cfg: DictConfig, hf_model: str | None = None, tokenizer: Any = None) -> StepOneBuild:
    """Build, on CPU, what the trainer builds before step 1 and needs no GPU; raise ValueError on failure.

    Shaper + lambda controller (and one shaping call, one dual step on a copy), the advantage settings
    (one call), the GRPO loss (one forward / backward on a 2 x 3 toy batch), the reward function (math:
    MathReward without starting its workers; synthetic: the task's checker), and, when the paths exist
    here, the tokenizer (HF directory: ``model.path``, or ``hf_model`` for a .nemo recipe) and the prompt
    template applied to the first row of the first data file. Nothing is allocated on a GPU and no
    process is started. ``tokenizer``: that folder's tokenizer when the caller has loaded it already
    (``plan``'s folder checks do), so it is not loaded twice; None loads it here.
    """
    from laconic_nemo.grpo.interfaces import TrainBatch
    from laconic_nemo.grpo.loss import make_grpo_loss_fn

    G = cfg.grpo.group_size
    shaper, controller = build_shaper(cfg), build_dual(cfg)
    lam = controller.value if controller is not None else constant_lambda(cfg)
    lmax = cfg.rollout.max_new_tokens
    lengths = torch.tensor([[1, lmax][i % 2] for i in range(G)], dtype=torch.long)
    shaped, _ = shaper(torch.linspace(0.0, 1.0, G), lengths, lengths >= lmax, G, lam,
                       torch.full((G,), float(lmax)) if shaper.fn.needs_targets else None)
    adv = group_advantages(shaped, G, **advantage_settings(cfg))
    dual = None
    if controller is not None:
        import copy

        copy.deepcopy(controller).update(float(lengths.float().mean()))
        dual = {k: v for k, v in controller.state_dict().items()
                if k in ("budget", "eta", "ceiling", "floor", "controller", "kp", "kd")}

    loss_kw = loss_settings(cfg)
    mask = torch.ones(2, 3)
    fn = make_grpo_loss_fn(**loss_kw, global_num_tokens=6.0, global_num_seqs=2.0)
    logp = (-torch.rand(2, 3)).requires_grad_(True)
    batch = TrainBatch(tokens=torch.zeros(2, 4, dtype=torch.long), prompt_lengths=torch.ones(2, dtype=torch.long),
                       response_lengths=torch.full((2,), 3, dtype=torch.long), response_mask=mask,
                       advantages=adv[:2].float() if G >= 2 else torch.zeros(2), old_logprobs=logp.detach() - 0.1,
                       ref_logprobs=logp.detach() if loss_kw["kl_beta"] > 0 else None)
    loss, _ = fn(logp, batch)
    loss.backward()

    out = StepOneBuild(
        shaper=shaper.name, lambda_init=float(lam), dual=dual,
        advantages=advantage_settings(cfg), loss=loss_kw, reward="", count_eos=cfg.laconic.count_eos,
        prompt_template=str(cfg.data.prompt_template),
    )
    if cfg.reward.kind == "math":
        from laconic_nemo.rewards.format import build_reward_fn

        _, grader = build_reward_fn(OmegaConf.to_container(cfg.reward, resolve=True))
        grader.close()
        out.reward = (f"math ({cfg.reward.format}, format_weight {cfg.reward.format_weight:g}, "
                      f"{cfg.reward.num_workers} workers)")
    else:
        out.reward = "synthetic"

    if cfg.data.kind == "math":
        _preview(cfg, out, _tokenizer_path(cfg, hf_model), tokenizer)
    return out


def _preview(cfg: DictConfig, out: StepOneBuild, tok_path: str | None, tok: Any = None) -> None:
    """Tokenizer and the template applied to the first data row, each only when its path exists here
    (``tok``: the tokenizer of ``tok_path`` if already loaded)."""
    from laconic_nemo.data.datasets import chat_messages, check_row, read_rows, render

    template = str(cfg.data.prompt_template)
    render(template, "")  # an unknown template name fails here, with or without data
    files = [str(f) for f in cfg.data.train_files]
    row = None
    if files and Path(files[0]).is_file():
        rows = read_rows(files[0])
        if not rows:
            raise ValueError(f"data.train_files: {files[0]} has no rows")
        loc, row = rows[0]
        check_row(row, f"{files[0]} {loc}")
        out.prompt_preview = render(template, str(row["problem"]))
    if tok_path is None:
        return
    if tok is None:
        from laconic_nemo.tokenizer_checks import load_hf_tokenizer

        tok = load_hf_tokenizer(tok_path)
    if tok.eos_token_id is None:
        raise ValueError(f"model.path: the tokenizer at {tok_path} has no EOS token")
    out.tokenizer = f"{type(tok).__name__} from {tok_path} ({len(tok)} tokens, eos {tok.eos_token!r})"
    problem = str(row["problem"]) if row is not None else "What is 1 + 1?"
    messages = chat_messages(template, problem)
    if messages is not None and getattr(tok, "chat_template", None):
        own = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if own != render(template, problem):
            out.warnings.append(f"data.prompt_template = {template} differs from the checkpoint's own chat template "
                                f"for the same turn: template {render(template, problem)!r} vs chat template {own!r}")
    if out.prompt_preview is not None:
        ids = tok.encode(out.prompt_preview, add_special_tokens=False)
        out.prompt_preview += f"   [{len(ids)} tokens]"
