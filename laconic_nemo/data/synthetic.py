"""A synthetic verifiable task on which response length buys accuracy (the tiny CPU demo).

Problem: the sum modulo 10 of ``k`` single digits, ``k`` drawn from ``[min_terms, max_terms]``; each
digit is labelled with a letter so that a worked solution can look it up by content::

    prompt:   "Q:a3b5c2d7\n"
    answer:   "7"

Three ways of answering, mixed in the warm-up (supervised) data:

* **worked** (long, reliable): one 5-token step per term, ``<letter><digit>:<running sum>,``, then
  the boxed answer::

      a3:3,b5:8,c2:0,d7:7,\boxed{7}

  Each step is a lookup of the next letter's digit in the prompt plus a single-digit addition mod 10
  with the running sum four tokens back, which a tiny model learns well, so the worked style is
  right almost always. Its length is ``5 k + 9`` tokens.
* **compact** (middle length, fairly reliable): the running sums alone, keyed by the letters,
  ``a3b8c0d7\\boxed{7}`` (``2 k + 9`` tokens). The lookup and the addition happen in one step, so
  it is somewhat less accurate than the worked style, but far more than the abbreviated one.
* **padded**: a worked or compact answer preceded by ``filler`` repetitions of a thinking phrase ("hmm. "),
  which costs length and changes nothing about correctness (the filler is BEFORE the work, so it
  cannot disturb the arithmetic).
* **abbreviated** (short, unreliable): the boxed answer alone, ``\boxed{7}`` (9 tokens). A tiny model
  cannot add several digits in one step, so this style is right mostly for small ``k``.

**End-of-reasoning marker** (``reasoning_marker``, off by default): when set, every warm-up answer closes its
reasoning with the marker right before the final boxed answer, as an R1-style model closes it with ``</think>``::

    a3:3,b5:8,c2:0,d7:7,ok.\boxed{7}        (reasoning_marker "ok.")
    hmm. a3b8c0d7ok.\boxed{7}
    ok.\boxed{7}                            (the abbreviated style: an empty reasoning span)

The reasoning span is the text before the marker, the answer the boxed result after it (9 tokens). The marker
must be written in the tokenizer's alphabet (``ok.``: three tokens no prompt or answer style contains). Off,
the answers (and the random draws that make them) are exactly those above.

With the budget B between the compact mean length and the worked mean length, the length
constraint is active at the optimum: a policy at B must give up some worked solutions (the long
problems, whose worked answers are over B, switch to compact ones), and LACONIC's lambda settles
above zero with the mean length at B. Under the paper's ceiling Lambda = B / (L_max - B) a switch
from a long answer of length L to a short one happens only when the accuracy lost is below
(L - B) / (L_max - B), so the short alternative must be nearly as good: the compact style is that
alternative (the abbreviated one is not). Plain GRPO has no reason to shorten (worked answers score
best), so it stays well above B.

**Stated budgets in the warm-up** (``stated_share``, 0 by default): a share of the warm-up prompts state a
budget B, drawn uniformly from ``stated_range``, with the instruction the RL prompts state theirs with
(``data.target_instruction``, e.g. ``Q:a3b5c2d7\nm24\n``). Of those, a share ``budget_follow`` is answered to
fit B (:meth:`SyntheticTask.fitted_solution`): the answer whose length is nearest B among the abbreviated one and
the compact and worked ones with 0..max_filler filler phrases (a tie goes to the more reliable style), so the
length lands within 2 tokens of B wherever B is within the styles' reach; the rest are drawn as without a budget.
``budget_follow`` is the knob of how strongly the warm-up's length follows B: over the styles' reach the mean
length of a stated example rises by about ``budget_follow`` tokens per token of B (0.47 at 0.5, 0.93 at 1 over
B = 16..56 with ``max_filler`` 6; :meth:`SyntheticTask.length_slope` measures it). A policy warmed up on it follows
less well than its data (a tiny model reads the budget imperfectly). With ``stated_share`` 0 no draw is added: the
warm-up's examples (and the random draws that make them) are exactly those above.

**Per-prompt budgets from the data** (``budgets_by_terms``): a problem's budget B_i is a function of what its
prompt shows, the number of terms k: entry ``k - min_terms`` of the list. :meth:`SyntheticTask.rows` writes it
into each data row under the field ``data.budget_key`` names, where a math data file carries its budgets.

The character-level :class:`CharTokenizer` maps each character to one token, so "tokens" and
characters coincide and the lengths above are the L of the cost.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

PAD, EOS = "<pad>", "<eos>"
LETTERS = "abcdefghijkl"
ALPHABET = "0123456789:,Q\n\\boxed{}hm. " + LETTERS


class CharTokenizer:
    """One token per character of :data:`ALPHABET`, plus ``<pad>`` (id 0) and ``<eos>`` (id 1)."""

    def __init__(self, alphabet: str = ALPHABET):
        chars = sorted(set(alphabet))
        self.itos = [PAD, EOS, *chars]
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_id, self.eos_id = 0, 1

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the tokenizer alphabet {ALPHABET!r}") from None

    def decode(self, ids) -> str:
        return "".join(self.itos[i] for i in ids if i > 1 and i < len(self.itos))


@dataclass(frozen=True)
class Problem:
    terms: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return "Q:" + "".join(f"{LETTERS[i]}{t}" for i, t in enumerate(self.terms)) + "\n"

    @property
    def answer(self) -> str:
        return str(sum(self.terms) % 10)


FILLER = "hmm. "


def _solution(problem: Problem, filler: int, step: str) -> str:
    """``filler`` thinking phrases, one ``step.format(letter, digit, running sum)`` per term, the boxed answer."""
    parts = [FILLER * filler]
    acc = 0
    for i, t in enumerate(problem.terms):
        acc = (acc + t) % 10
        parts.append(step.format(LETTERS[i], t, acc))
    parts.append(f"\\boxed{{{acc}}}")
    return "".join(parts)


def worked_solution(problem: Problem, filler: int = 0) -> str:
    """The worked style: ``<letter><digit>:<running sum>,`` per term (5 tokens), the boxed answer."""
    return _solution(problem, filler, "{0}{1}:{2},")


def compact_solution(problem: Problem, filler: int = 0) -> str:
    """The compact style: ``<letter><running sum>`` per term (2 tokens), the boxed answer."""
    return _solution(problem, filler, "{0}{2}")


def abbreviated_solution(problem: Problem) -> str:
    return f"\\boxed{{{problem.answer}}}"


def close_reasoning(response: str, marker: str | None) -> str:
    """``response`` with ``marker`` inserted right before its final ``\\boxed{`` (unchanged when marker is None)."""
    if marker is None:
        return response
    i = response.rindex("\\boxed{")
    return response[:i] + marker + response[i:]


def closes_reasoning(text: str, marker: str) -> bool:
    """Whether a response closes its reasoning with ``marker``: the marker occurs and is followed directly by a
    ``\\boxed{`` (the warm-up's shape: the boxed answer right after the marker)."""
    return (marker + "\\boxed{") in text


def check_marker(marker: str, key: str = "data.synthetic.reasoning_marker") -> None:
    """Refuse a marker the character tokenizer cannot encode (or an empty one), naming ``key``."""
    missing = sorted({c for c in marker} - set(ALPHABET))
    if not marker or missing:
        raise ValueError(f"{key} = {marker!r} is invalid: allowed a non-empty string of the synthetic tokenizer's "
                         f"characters {ALPHABET!r}" + (f" (not encodable: {missing})" if missing else ""))


@dataclass
class SyntheticTask:
    """Generator of problems and warm-up solutions.

    min_terms, max_terms: range of k (inclusive).
    p_abbreviated: share of warm-up solutions in the abbreviated style.
    p_compact: share of warm-up solutions in the compact style (the rest are worked).
    max_filler: worked and compact solutions carry uniform 0..max_filler filler phrases.
    reasoning_marker: None, or the end-of-reasoning marker every warm-up solution places right before its final
        boxed answer (see the module docstring).
    stated_share: share of warm-up prompts that state a budget (0: none, and no draw for it).
    stated_range: (lo, hi), the stated budgets' range (uniform integers).
    budget_follow: share of the stated-budget examples answered to fit their budget (the rest ignore it).
    budgets_by_terms: None, or the budget B_i of a problem with k terms at entry ``k - min_terms`` (the rows'
        budget field, :meth:`rows`).
    """

    min_terms: int = 2
    max_terms: int = 8
    p_abbreviated: float = 0.15
    p_compact: float = 0.25
    max_filler: int = 4
    reasoning_marker: str | None = None
    stated_share: float = 0.0
    stated_range: Sequence[int] = (16, 56)
    budget_follow: float = 1.0
    budgets_by_terms: Sequence[int] | None = None

    def __post_init__(self):
        if self.reasoning_marker is not None:
            check_marker(self.reasoning_marker)
        if not 2 <= self.min_terms <= self.max_terms <= len(LETTERS):
            raise ValueError(f"data.synthetic: need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}"
                             f" (max_terms at most {len(LETTERS)})")
        if not (0.0 <= self.p_abbreviated and 0.0 <= self.p_compact and self.p_abbreviated + self.p_compact <= 1.0):
            raise ValueError(f"data.synthetic.p_abbreviated = {self.p_abbreviated}, p_compact = {self.p_compact}: "
                             "both must be >= 0 with a sum <= 1")
        if not 0.0 <= self.stated_share <= 1.0:
            raise ValueError(f"data.synthetic.stated_share = {self.stated_share} is invalid: allowed [0, 1]")
        if not 0.0 <= self.budget_follow <= 1.0:
            raise ValueError(f"data.synthetic.budget_follow = {self.budget_follow} is invalid: allowed [0, 1]")
        lo_hi = list(self.stated_range)
        if len(lo_hi) != 2 or not 1 <= lo_hi[0] <= lo_hi[1]:
            raise ValueError(f"data.synthetic.stated_range = {lo_hi} is invalid: allowed [lo, hi] with 1 <= lo <= hi")
        if self.budgets_by_terms is not None:
            n = self.max_terms - self.min_terms + 1
            b = list(self.budgets_by_terms)
            if len(b) != n or not all(isinstance(x, int) and x >= 1 for x in b):
                raise ValueError(f"data.synthetic.budgets_by_terms = {b} is invalid: allowed {n} integers >= 1 (one "
                                 f"per k = {self.min_terms}..{self.max_terms}), or null")

    def problem(self, rng: random.Random) -> Problem:
        k = rng.randint(self.min_terms, self.max_terms)
        return Problem(tuple(rng.randint(0, 9) for _ in range(k)))

    def problems(self, n: int, seed: int) -> list[Problem]:
        """``n`` problems, stratified by k: every consecutive block of ``max_terms - min_terms + 1``
        problems holds each k once (in random order), so any run of consecutive prompts has nearly
        the same difficulty and length mix (less step-to-step noise in the mean length)."""
        rng = random.Random(seed)
        ks = list(range(self.min_terms, self.max_terms + 1))
        out: list[Problem] = []
        while len(out) < n:
            rng.shuffle(ks)
            out += [Problem(tuple(rng.randint(0, 9) for _ in range(k))) for k in ks]
        return out[:n]

    def warmup_example(self, rng: random.Random, state: Callable[[int], str] | None = None) -> tuple[str, str]:
        """(prompt, response) for supervised warm-up, styles mixed as configured.

        state: budget -> the instruction stating it (``data.target_instruction`` as the RL prompts state theirs);
        needed when ``stated_share > 0``. A prompt that states a budget B is the problem followed by ``state(B)``;
        its answer fits B with probability ``budget_follow`` (:meth:`answer`)."""
        if self.stated_share > 0 and state is None:
            raise ValueError("data.synthetic.stated_share > 0 needs the instruction that states a budget")
        p = self.problem(rng)
        budget = None
        if self.stated_share > 0 and rng.random() < self.stated_share:  # no draw at all when off
            budget = rng.randint(int(self.stated_range[0]), int(self.stated_range[1]))
        prompt = p.prompt if budget is None else p.prompt + state(budget)
        return prompt, self.answer(p, rng, budget)

    def answer(self, problem: Problem, rng: random.Random, budget: int | None = None) -> str:
        """A warm-up answer of ``problem``: with a stated ``budget``, fitted to it (:meth:`fitted_solution`) with
        probability ``budget_follow``; otherwise the configured mix of styles with uniform filler."""
        if budget is not None and rng.random() < self.budget_follow:
            return self.fitted_solution(problem, budget)
        u = rng.random()
        if u < self.p_abbreviated:
            response = abbreviated_solution(problem)
        else:
            filler = rng.randint(0, self.max_filler)
            style = compact_solution if u < self.p_abbreviated + self.p_compact else worked_solution
            response = style(problem, filler=filler)
        return close_reasoning(response, self.reasoning_marker)

    def fitted_solution(self, problem: Problem, budget: int) -> str:
        """The answer of ``problem`` whose length is nearest ``budget``: among the abbreviated answer and the compact
        and worked ones with 0..max_filler filler phrases, the one with the smallest ``|L - budget|``, a tie going
        to the more reliable style (worked, then compact), then to the shorter. The marker, when set, counts."""
        m = len(self.reasoning_marker or "")
        k = len(problem.terms)
        # (distance, preference (0 = worked first), length, maker)
        options = [(abs(9 + m - budget), 2, 9 + m, lambda: abbreviated_solution(problem))]
        for pref, (style, base) in enumerate(((worked_solution, 5 * k + 9 + m), (compact_solution, 2 * k + 9 + m))):
            for f in range(self.max_filler + 1):
                n = base + len(FILLER) * f
                options.append((abs(n - budget), pref, n, lambda s=style, f=f: s(problem, filler=f)))
        best = min(options, key=lambda o: o[:3])
        return close_reasoning(best[3](), self.reasoning_marker)

    def length_slope(self, budgets: Sequence[int], n: int, seed: int = 0) -> tuple[float, list[float]]:
        """How the warm-up's length follows a stated budget: for each budget b, the mean response length (tokens,
        EOS excluded) of ``n`` warm-up answers to prompts stating b (:meth:`answer`; problems and draws from
        ``Random(seed)``, the same for every b), and the least-squares slope of those means on b.
        Returns (slope, [len(budgets)] means)."""
        means = []
        for b in budgets:
            rng = random.Random(seed)
            means.append(sum(len(self.answer(self.problem(rng), rng, int(b))) for _ in range(n)) / n)
        xm, ym = sum(budgets) / len(budgets), sum(means) / len(means)
        slope = sum((b - xm) * (y - ym) for b, y in zip(budgets, means)) / sum((b - xm) ** 2 for b in budgets)
        return slope, means

    def budget_of(self, problem: Problem) -> int:
        """The problem's budget B_i from ``budgets_by_terms`` (a function of its number of terms)."""
        if self.budgets_by_terms is None:
            raise ValueError("data.synthetic.budgets_by_terms is not set: the synthetic problems carry no budget")
        return int(self.budgets_by_terms[len(problem.terms) - self.min_terms])

    def rows(self, n: int, seed: int, budget_key: str | None = None) -> list[dict]:
        """The RL prompt set (:meth:`problems`) as data rows ``{"problem": prompt, "answer": digit}``, each with its
        budget B_i (:meth:`budget_of`) under the field ``budget_key`` when one is given."""
        out = []
        for p in self.problems(n, seed):
            row = {"problem": p.prompt, "answer": p.answer}
            if budget_key is not None:
                row[budget_key] = self.budget_of(p)
            out.append(row)
        return out

    def style_lengths(self) -> dict[str, float]:
        """Expected response length (tokens, EOS excluded) of each style under this task's k range (the marker's
        tokens included when it is set)."""
        ks = range(self.min_terms, self.max_terms + 1)
        m = len(self.reasoning_marker or "")
        worked = sum(5 * k + 9 + m for k in ks) / len(ks)
        compact = sum(2 * k + 9 + m for k in ks) / len(ks)
        filler = len(FILLER) * self.max_filler / 2
        p_worked = 1.0 - self.p_abbreviated - self.p_compact
        return {
            "abbreviated": 9.0 + m,
            "compact": compact,
            "worked": worked,
            "padded_worked": worked + filler,
            "warmup_mix": self.p_abbreviated * (9.0 + m) + self.p_compact * (compact + filler) + p_worked * (worked + filler),
        }
