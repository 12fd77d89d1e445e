"""The facts of `sgl-kvq eval longdoc`: one long document per length with every fact planted at its own depth, then one
question per fact, each reading the document from the radix cache.

Five kinds, four facts each (RULER's needle kinds, at a size a small model can copy back): a digit code with
separators, a name, a multi-word phrase, a key among similar keys (the document also holds two distractor sentences
that differ from it in the key only), and a value split over two places (both halves must appear in the answer, in
order). The assistant turn starts with the fact's own words up to the answer (`answer_prefix`), as the needles of
`eval niah` do (bench/eval/needles.py), so a hit is read from the cache, not recalled. None of the facts is true.

The halves are the even and odd positions of FACTS (two facts of each kind per half, so one question is 10 points of
a half): `choose` is the half a default is chosen on, `report` the half results are read from. The document is the
same for both halves (every fact and distractor is planted); only the questions differ. A result records how many facts
its document planted (`settings.facts_planted`); one without it planted the first ten.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fact:
    kind: str  # "code", "name", "phrase", "multikey", "split"
    sentences: tuple[str, ...]  # planted at their own depths (a split fact's halves; a multikey's distractors too)
    question: str
    answers: tuple[str, ...]  # a hit holds each, case-insensitively, in this order
    answer_prefix: str  # how the assistant turn starts


def _fact(kind: str, sentence: str, question: str, answer: str, *distractors: str) -> Fact:
    """A fact whose answer prefix is its sentence up to the answer."""
    prefix = sentence[:sentence.lower().index(answer.lower())].rstrip()
    return Fact(kind, (sentence, *distractors), question, (answer,), prefix)


FACTS = (
    _fact("code", "The vault in the harbor office opens with the code 47-19-83.",
          "What is the code that opens the vault in the harbor office?", "47-19-83"),
    _fact("code", "The serial number stamped on the brass telescope is 5208-3316.",
          "What is the serial number stamped on the brass telescope?", "5208-3316"),
    _fact("name", "The keeper of the mountain observatory is named Ingrid Vasquez.",
          "What is the name of the keeper of the mountain observatory?", "Vasquez"),
    _fact("name", "The captain of the ferry to the outer islands was Teodor Brannigan.",
          "Who was the captain of the ferry to the outer islands?", "Brannigan"),
    _fact("phrase", "The motto carved above the workshop door reads patience turns copper into gold.",
          "What does the motto carved above the workshop door read?", "copper into gold"),
    _fact("phrase", "The note left inside the piano said the orchard gate is never locked.",
          "What did the note left inside the piano say?", "orchard gate"),
    _fact("multikey", "The access code for room 471 is 9061.", "What is the access code for room 471?", "9061",
          "The access code for room 417 is 2853.", "The access code for room 714 is 3378."),
    _fact("multikey", "The locker number of Elena Parker is 197.", "What is the locker number of Elena Parker?", "197",
          "The locker number of Elena Park is 612.", "The locker number of Helena Parker is 854."),
    Fact("split", ("The first half of the launch password is RIVER.",
                   "The second half of the launch password is STONE."),
         "What is the launch password? Give its first half and then its second half.", ("river", "stone"),
         "The first half of the launch password is"),
    Fact("split", ("The first clue on the treasure map points to the old mill.",
                   "The second clue on the treasure map points to the willow tree."),
         "Where do the first and the second clue on the treasure map point?", ("mill", "willow"),
         "The first clue on the treasure map points to the"),
    _fact("code", "The combination of the lighthouse strongbox is 62-08-57.",
          "What is the combination of the lighthouse strongbox?", "62-08-57"),
    _fact("code", "The permit number painted on the fishing boat is 3917-4420.",
          "What is the permit number painted on the fishing boat?", "3917-4420"),
    _fact("name", "The founder of the village library was Margit Okonkwo.",
          "Who was the founder of the village library?", "Okonkwo"),
    _fact("name", "The pilot of the mail plane is named Ruben Castellano.",
          "What is the name of the pilot of the mail plane?", "Castellano"),
    _fact("phrase", "The inscription on the old bell says listen before the tide turns.",
          "What does the inscription on the old bell say?", "before the tide"),
    _fact("phrase", "The sign at the bakery counter says bread waits for no one.",
          "What does the sign at the bakery counter say?", "waits for no one"),
    _fact("multikey", "The badge number of Oliver Grant is 356.", "What is the badge number of Oliver Grant?", "356",
          "The badge number of Oliver Granton is 583.", "The badge number of Olivia Grant is 635."),
    _fact("multikey", "The shelf code for box 283 is 7140.", "What is the shelf code for box 283?", "7140",
          "The shelf code for box 238 is 4071.", "The shelf code for box 832 is 1704."),
    Fact("split", ("The first word of the gate phrase is AMBER.", "The second word of the gate phrase is FALCON."),
         "What is the gate phrase? Give its first word and then its second word.", ("amber", "falcon"),
         "The first word of the gate phrase is"),
    Fact("split", ("The first stop of the night train is at Linden.",
                   "The second stop of the night train is at Marlow."),
         "What are the first and the second stop of the night train?", ("linden", "marlow"),
         "The first stop of the night train is at"),
)
HALVES = {"choose": FACTS[0::2], "report": FACTS[1::2]}
FACT_SETS = ("all", *HALVES)


def half_of(fact: Fact) -> str | None:
    return next((name for name, facts in HALVES.items() if fact in facts), None)


def fact_set(name: str) -> tuple[Fact, ...]:
    if name == "all":
        return FACTS
    if name not in HALVES:
        raise ValueError(f"fact set {name!r}; choose one of {', '.join(FACT_SETS)}")
    return HALVES[name]


def sentences() -> list[str]:
    """Every planted sentence, in a fixed order."""
    return [s for f in FACTS for s in f.sentences]


def depths(n: int, length_index: int) -> list[float]:
    """Depths of the n planted sentences in the document of the length_index-th length: spread over 0.04..0.96, each
    sentence moved on by a prime stride per length so a fact sits at another depth at every length (a split fact's
    halves stay apart)."""
    slots = [0.04 + 0.92 * i / (n - 1) for i in range(n)] if n > 1 else [0.5]
    step = 7 if n % 7 else 5
    return [slots[(i * step + 3 * length_index) % n] for i in range(n)]


def hit(fact: Fact, answer: str) -> bool:
    """Each of the fact's answers occurs in `answer`, case-insensitively, in order."""
    text, at = answer.lower(), 0
    for part in fact.answers:
        i = text.find(part.lower(), at)
        if i < 0:
            return False
        at = i + len(part)
    return True
