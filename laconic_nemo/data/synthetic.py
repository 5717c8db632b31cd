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

The character-level :class:`CharTokenizer` maps each character to one token, so "tokens" and
characters coincide and the lengths above are the L of the cost.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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
    """

    min_terms: int = 2
    max_terms: int = 8
    p_abbreviated: float = 0.15
    p_compact: float = 0.25
    max_filler: int = 4
    reasoning_marker: str | None = None

    def __post_init__(self):
        if self.reasoning_marker is not None:
            check_marker(self.reasoning_marker)
        if not 2 <= self.min_terms <= self.max_terms <= len(LETTERS):
            raise ValueError(f"data.synthetic: need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}"
                             f" (max_terms at most {len(LETTERS)})")
        if not (0.0 <= self.p_abbreviated and 0.0 <= self.p_compact and self.p_abbreviated + self.p_compact <= 1.0):
            raise ValueError(f"data.synthetic.p_abbreviated = {self.p_abbreviated}, p_compact = {self.p_compact}: "
                             "both must be >= 0 with a sum <= 1")

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

    def warmup_example(self, rng: random.Random) -> tuple[str, str]:
        """(prompt, response) for supervised warm-up, styles mixed as configured."""
        p = self.problem(rng)
        u = rng.random()
        if u < self.p_abbreviated:
            response = abbreviated_solution(p)
        else:
            filler = rng.randint(0, self.max_filler)
            style = compact_solution if u < self.p_abbreviated + self.p_compact else worked_solution
            response = style(p, filler=filler)
        return p.prompt, close_reasoning(response, self.reasoning_marker)

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
