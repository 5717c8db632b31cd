"""What the trainer builds before step 1 that needs no GPU, built on CPU by ``laconic-nemo plan`` and ``train``'s
pre-flight (:func:`build_step_one`), so that a recipe that `plan` accepts does not fail in one of these constructors
after the cluster has allocated its GPUs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from laconic_nemo.config import Config
from laconic_nemo.core import SHAPERS, group_advantages, shape
from laconic_nemo.core.dual import STATE_SETTINGS
from laconic_nemo.grpo.interfaces import TrainBatch
from laconic_nemo.grpo.loss import make_grpo_loss_fn


@dataclass
class StepOneBuild:
    """What :func:`build_step_one` built (plain values, printable and JSON-serialisable)."""

    shaper: str
    lambda_init: float
    dual: dict | None             # DualController settings (core.dual.STATE_SETTINGS)
    advantages: dict
    loss: dict
    reward: str
    count_eos: bool
    prompt_template: str
    tokenizer: str | None = None  # what was loaded, or None when its path is not here
    prompt_preview: str | None = None
    warnings: list[str] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)  # the constraints beyond the mean and their multipliers


def _tokenizer_path(cfg: Config, hf_model: str | None) -> str | None:
    path = hf_model if cfg.model.source == "nemo" else (cfg.model.path if cfg.model.source == "hf" else None)
    return str(path) if path and Path(str(path)).is_dir() else None


def build_step_one(cfg: Config, hf_model: str | None = None, tokenizer: Any = None) -> StepOneBuild:
    """Build, on CPU, what the trainer builds before step 1 and needs no GPU; raise ValueError on failure.

    Shaper + lambda controller (and one shaping call, one dual step on a copy), the advantage settings
    (one call), the GRPO loss (one forward / backward on a 2 x 3 toy batch), the reward function (math:
    MathReward without starting its workers; synthetic: the task's checker), and, when the paths exist
    here, the tokenizer (HF directory: ``model.path``, or ``hf_model`` for a .nemo recipe) and the prompt
    template applied to the first row of the first data file. Nothing is allocated on a GPU and no
    process is started. ``tokenizer``: that folder's tokenizer when the caller has loaded it already
    (``plan``'s folder checks do), so it is not loaded twice; None loads it here.
    """
    lc, g, lmax = cfg.laconic, cfg.grpo, cfg.rollout.max_new_tokens
    G = g.group_size
    from laconic_nemo.grpo.constraints import build_constraints

    built = build_constraints(cfg)  # lambda's controller as GRPOTrainer builds it (the classes: constraint_lines)
    controller, lam = built.dual, built.lam
    lengths = torch.tensor([[[1, lmax][i % 2] for i in range(G)]], dtype=torch.long)  # one group [1, G]
    shaped, _ = shape(lc, torch.linspace(0.0, 1.0, G).view(1, G), lengths, lam, max_length=lmax,
                      truncated=lengths >= lmax,
                      targets=torch.full((1, G), float(lmax)) if SHAPERS[lc.shaper].needs_targets else None)
    advantages = {"eps": g.advantage_eps, "leave_one_out": g.leave_one_out, "std": g.advantage_std}
    adv = group_advantages(shaped, **advantages).view(-1)
    dual = None
    if controller is not None:
        copy.deepcopy(controller).update(float(lengths.float().mean()))
        dual = {k: v for k, v in controller.state_dict().items() if k in STATE_SETTINGS}

    loss_kw = {"clip_eps": g.clip_eps, "clip_eps_high": g.clip_eps_high, "clip_dual": g.clip_dual,
               "kl_beta": g.kl_beta, "aggregation": g.loss_aggregation}
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
        shaper=lc.shaper, lambda_init=float(lam), dual=dual,
        advantages=advantages, loss=loss_kw, reward="", count_eos=lc.count_eos,
        prompt_template=cfg.data.prompt_template,
    )
    if cfg.reward.kind == "math":
        from laconic_nemo.rewards.format import build_reward_fn

        _, grader = build_reward_fn(cfg.reward)
        grader.close()
        out.reward = (f"math ({cfg.reward.format}, format_weight {cfg.reward.format_weight:g}, "
                      f"{cfg.reward.num_workers} workers)")
    else:
        out.reward = "synthetic"

    if cfg.data.kind == "math":
        _preview(cfg, out, _tokenizer_path(cfg, hf_model), tokenizer)
    out.constraints = constraint_lines(cfg, tokenizer)
    return out


def constraint_lines(cfg: Config, tokenizer: Any = None) -> list[str]:
    """Build the constraints beyond the mean as the trainer does (core/constraints.py) and describe each with its
    multipliers; raise ValueError naming the key on a bad one: a marker the tokenizer cannot encode (the synthetic
    task's character tokenizer, or ``tokenizer`` when loaded), a budget class without a budget."""
    from laconic_nemo.grpo.constraints import build_constraints, run_budgets

    lc, d, lmax = cfg.laconic, cfg.data, cfg.rollout.max_new_tokens
    lines = []
    if lc.reasoning_marker is not None:
        marker = lc.reasoning_marker
        if cfg.data.kind == "synthetic":
            from laconic_nemo.data.synthetic import CharTokenizer

            try:
                ids = CharTokenizer().encode(marker)
            except ValueError as exc:
                raise ValueError(f"laconic.reasoning_marker = {marker!r} is invalid: the synthetic tokenizer cannot "
                                 f"encode it ({exc})") from None
            where = "synthetic tokenizer"
        elif tokenizer is not None:
            try:
                ids = tokenizer.encode(marker, add_special_tokens=False)
            except Exception as exc:  # a tokenizer's own error type (e.g. a lone surrogate)
                raise ValueError(f"laconic.reasoning_marker = {marker!r} is invalid: the tokenizer cannot encode it "
                                 f"({type(exc).__name__}: {exc})") from None
            if not ids or tokenizer.decode(ids) != marker:
                raise ValueError(f"laconic.reasoning_marker = {marker!r} is invalid: the tokenizer encodes it to "
                                 f"{ids} which decodes to {tokenizer.decode(ids)!r}")
            where = "tokenizer"
        else:
            ids, where = None, "tokenizer not here: not encoded"
        lines.append(f"reasoning-only L: tokens before {marker!r} ({where}{'' if ids is None else f': ids {ids}'}); "
                     "a response without it is charged in full")
    stated = d.stated_budgets()  # a synthetic instruction's characters are checked with the config (config.py)
    budgets = None
    if lc.per_prompt_budget:
        budgets = stated
        source = "data.target_lengths" if d.target_lengths is not None else "data.target_length_range"
        if budgets is None:
            source = f"data.budget_key {d.budget_key!r}"
            files = [str(f) for f in d.train_files]
            if d.kind == "synthetic":  # the synthetic rows carry B_i (data.synthetic.budgets_by_terms)
                budgets = run_budgets(cfg)
            elif files and all(Path(f).is_file() for f in files):
                from laconic_nemo.data.datasets import prompt_budgets

                budgets = prompt_budgets(files, str(d.budget_key), d.budget_missing, lc.budget, lmax)
        if budgets is None:
            lines.append(f"per-prompt budgets from {source} (data files not here: classes built at start)")
        else:
            try:
                classes = build_constraints(cfg, budgets).classes
            except ValueError as exc:
                raise ValueError(f"laconic.budget_classes: {exc}") from None
            desc = ", ".join(f"{n} (lambda_init {dl.value:g}, Lambda {dl.ceiling:g})"
                             for n, dl in zip(classes.names, classes.duals))
            lines.append(f"per-prompt budgets from {source}: {len(classes)} classes, one multiplier each, eta "
                         f"{lc.eta:g}: {desc}")
    lines += _band_lines(cfg, budgets)
    t = build_constraints(cfg).tail
    if t is not None:
        lines.append(f"tail: share of L > B_tail = {t.tail_budget:g} at most q = {t.share:g}; mu_init {t.value:g}, "
                     f"eta {lc.tail_eta:g}, ceiling {t.dual.ceiling:g}")
    return lines


def _band_lines(cfg: Config, budgets: list[float] | None) -> list[str]:
    """The band's line of ``plan`` (laconic.band): per class (``budgets``: the run's per-prompt budgets; None
    without them, or where the data files are not here) its lower bound B_lo = rho B and lambda_lo's eta and
    ceiling; without per-prompt budgets the mean-length constraint's."""
    from laconic_nemo.grpo.constraints import build_constraints

    lc = cfg.laconic
    if lc.band is None:
        return []
    head = f"band: L in [{lc.band:g} B, B], a lower bound B_lo = {lc.band:g} B beside each upper bound with its own"
    if not lc.per_prompt_budget:
        lo = build_constraints(cfg).band
        return [f"{head} lambda_lo (init 0, eta {lo.eta:g}, ceiling {lo.ceiling:g}) of the mean length: B_lo = "
                f"{lc.band * lc.budget:g} beside B = {lc.budget:g}"]
    if budgets is None:
        return [f"{head} lambda_lo per budget class (classes built at start)"]
    classes = build_constraints(cfg, budgets).classes
    desc = ", ".join(f"{n}: B_lo = {lc.band * classes.class_budgets(k)[0]:g}"
                     + ("" if len(classes.members[k]) == 1 else f"..{lc.band * classes.class_budgets(k)[-1]:g}")
                     + f" (eta {lo.eta:g}, ceiling {lo.ceiling:g})"
                     for k, (n, lo) in enumerate(zip(classes.names, classes.lower)))
    return [f"{head} lambda_lo per budget class (init 0): {desc}"]


def _preview(cfg: Config, out: StepOneBuild, tok_path: str | None, tok: Any = None) -> None:
    """Tokenizer and the template applied to the first data row, each only when its path exists here
    (``tok``: the tokenizer of ``tok_path`` if already loaded)."""
    from laconic_nemo.data.datasets import chat_messages, check_row, read_rows, render

    template = cfg.data.prompt_template
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
        from laconic_nemo.bridge.hf_folder import load_hf_tokenizer

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
