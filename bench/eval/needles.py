"""The needles of `sgl-kvq eval niah`: twelve facts of three kinds (digits, names, phrases), split into a half that
chooses defaults and a half that reports them, so no default is tuned on the needles its results are read from.

Each needle is one sentence a small model can copy back: the assistant turn starts with the sentence's own words up
to the fact (`answer_prefix`), so a hit means the answer's tokens were read from the cached haystack, not recalled
from the model's knowledge (none of the facts is true of anything). A trial is a hit when `answer` is a
case-insensitive substring of the generated text; for names and phrases it is the least guessable part.

The halves are the even and odd positions of NEEDLES, which lists the kinds in pairs: each half has two needles of
each kind. Each (needle, context length) trial takes its own depth from DEPTHS, so every half covers every depth
at every length.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Needle:
    kind: str  # "digits", "name", "phrase" ("custom" for one given on the command line)
    sentence: str  # hidden in the haystack at a sentence boundary
    question: str
    answer: str  # the key fact: a hit is a case-insensitive substring of the answer
    answer_prefix: str  # how the assistant turn starts ('' for none)


def _needle(kind: str, sentence: str, question: str, answer: str) -> Needle:
    """A needle whose answer prefix is its sentence up to the answer."""
    prefix = sentence[:sentence.lower().index(answer.lower())].rstrip()
    return Needle(kind, sentence, question, answer, prefix)


NEEDLES = (
    _needle("digits", "The magic number that Alice wrote on the blackboard was 4817.",
            "What was the magic number that Alice wrote on the blackboard?", "4817"),
    _needle("digits", "The locker combination that Tom memorized is 2961.",
            "What is the locker combination that Tom memorized?", "2961"),
    _needle("name", "The lighthouse keeper on the northern island is named Margaret Quill.",
            "What is the name of the lighthouse keeper on the northern island?", "Quill"),
    _needle("name", "The winner of the village baking contest was Henrik Dalberg.",
            "Who won the village baking contest?", "Dalberg"),
    _needle("phrase", "The password to the old library is purple elephant dancing.",
            "What is the password to the old library?", "purple elephant"),
    _needle("phrase", "The secret ingredient in grandmother's soup is roasted chestnuts.",
            "What is the secret ingredient in grandmother's soup?", "chestnut"),
    _needle("digits", "The train to the coast leaves from platform 38.",
            "Which platform does the train to the coast leave from?", "38"),
    _needle("digits", "The museum opened its new wing in the year 1874.",
            "In which year did the museum open its new wing?", "1874"),
    _needle("name", "The ship that carried the spices was called the Silver Heron.",
            "What was the ship that carried the spices called?", "Heron"),
    _needle("name", "The best friend of the young painter was a dog named Biscuit.",
            "What was the name of the young painter's dog?", "Biscuit"),
    _needle("phrase", "The message hidden in the bottle said meet me at the red bridge.",
            "What did the message hidden in the bottle say?", "red bridge"),
    _needle("phrase", "The favorite hobby of the quiet engineer is building wooden kites.",
            "What is the favorite hobby of the quiet engineer?", "wooden kite"),
)
HALVES = {"choose": NEEDLES[0::2], "report": NEEDLES[1::2]}
NEEDLE_SETS = ("all", *HALVES, "single")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def half_of(needle: Needle) -> str | None:
    return next((name for name, needles in HALVES.items() if needle in needles), None)


def needle_set(name: str) -> tuple[Needle, ...]:
    if name == "all":
        return NEEDLES
    if name not in HALVES:
        raise ValueError(f"needle set {name!r}; choose one of {', '.join(NEEDLE_SETS)}")
    return HALVES[name]


def schedule(needles: tuple[Needle, ...], lengths: list[int]) -> list[tuple[Needle, int, float]]:
    """(needle, context length, depth) trials: every needle at every length, each pair at its own depth."""
    return [(n, length, DEPTHS[(NEEDLES.index(n) + 2 * j) % len(DEPTHS)])
            for n in needles for j, length in enumerate(lengths)]


def sentence_boundary(tok, ids: list[int], k: int, reach: int = 200) -> int:
    """k moved back to just after a sentence end ("."), if one lies within `reach` tokens before it: a planted
    sentence then starts a sentence of the text."""
    back = k
    while back > 0 and k - back < reach and not tok.decode(ids[back - 1:back]).rstrip().endswith("."):
        back -= 1
    return back if back > 0 and k - back < reach else k
